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

# Before serving, say where to point a client, read from the config about to be served (nothing when it
# does not load: `ctxproxy serve` then names the problems itself).
define WHERE
import sys
from proxy.settings import load_config
try:
    c = load_config(sys.argv[1])
except Exception:
    sys.exit(0)
s = c.settings
bound = s.server.host
host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bound, bound)
host = f"[{host}]" if ":" in host else host
up = s.upstreams[c.default_upstream]
if c.tenants:
    names = ", ".join(t.name for t in c.tenants)
    access = (f"keyed: {len(c.tenants)} tenant(s) ({names}); a client sends its tenant's proxy key "
              "as its API key; " + ("the configured upstream key is sent upstream" if up.api_key
                                            else "no upstream key is configured"))
elif up.api_key:
    access = "open: no tenants; any client key is accepted, the configured upstream key is sent upstream"
else:
    access = "open: no tenants; the client's own API key is forwarded upstream"
where = "" if bound == host else f" (bound to {bound or 'all interfaces'}: from elsewhere, use this host's address)"
print(f"ctxproxy: point a client's base_url at http://{host}:{s.server.port}/v1{where}")
print(f"  config    {sys.argv[1]}")
print(f"  upstream  {c.default_upstream}: {up.base_url}")
print(f"  access    {access}", flush=True)
endef
export WHERE

run: $(VENV)/.installed
	@$(PY) -c "$$WHERE" $(CONFIG)
	$(VENV)/bin/ctxproxy serve --config $(CONFIG)

test: $(VENV)/.installed-dev
	@command -v redis-server >/dev/null || echo "note: redis-server not found; Redis tests will be skipped (.ci/run installs it)"
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check proxy plugins tests bench

typecheck: $(VENV)/.installed-dev
	$(VENV)/bin/mypy

# The side-by-side overhead benchmark from a clone (bench/README.md): direct vs ctxproxy under and over
# budget, plus LiteLLM when LITELLM_VENV names a venv with litellm[proxy]. Needs wrk.
# e.g. make bench BENCH_ARGS="--rounds 1 --duration 2s --warmup 1s"   (results in $(BENCH_OUT))
LITELLM_VENV ?=
BENCH_ARGS ?=
BENCH_OUT ?= bench/results/latest
bench: $(VENV)/.installed
	BENCH_OUT=$(BENCH_OUT) LITELLM_VENV=$(LITELLM_VENV) bench/compare.sh $(BENCH_ARGS)

check: $(VENV)/.installed-dev
	@$(PIP) install -q 'schemathesis>=4.30' || echo "note: schemathesis not installed; its live run will be skipped"
	$(PY) -m pytest -q -p no:cacheprovider -m slow --run-slow

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
