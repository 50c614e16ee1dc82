# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONFIG ?= config/ctxproxy.yaml
export LITELLM_LOCAL_MODEL_COST_MAP := True
export LITELLM_TELEMETRY := False

.PHONY: run test check lint typecheck bench clean

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

check: $(VENV)/.installed-dev
	@$(PIP) install -q 'schemathesis>=4.30' || echo "note: schemathesis not installed; its live run will be skipped"
	$(PY) -m pytest -q -p no:cacheprovider -m slow --run-slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
