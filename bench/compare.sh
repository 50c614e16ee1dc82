#!/usr/bin/env bash
# Side-by-side overhead benchmark: the harness in this folder (compare.py: fake upstream + wrk, direct vs
# proxy, alternating) run for ctxproxy in two configurations (agent_long under budget = pure pass-through;
# over budget = summarising with a cached summary) and, when a LiteLLM venv is given, for LiteLLM in the
# same run. `make bench` calls it.
#
# usage: bench/compare.sh [LITELLM_VENV] [extra compare.py options, e.g. --rounds 3 --duration 10s]
#        (LITELLM_VENV may also come from the environment; BENCH_OUT sets the output folder)
# output: <BENCH_OUT, default bench/results>/<label>.md tables and <label>.json raw data
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
py="$root/.venv/bin/python"
out="${BENCH_OUT:-$here/results}"
mkdir -p "$out"
out="$(realpath "$out")"
litellm_venv="${LITELLM_VENV:-}"
if [ $# -gt 0 ] && [ -d "$1" ]; then litellm_venv="$1"; shift; fi
if [ -n "$litellm_venv" ]; then
  [ -x "$litellm_venv/bin/litellm" ] || { echo "no litellm in $litellm_venv (pip install 'litellm[proxy]' there)" >&2; exit 2; }
  litellm_venv="$(realpath "$litellm_venv")"
fi
command -v wrk >/dev/null || { echo "the benchmark needs wrk (Debian: apt-get install -y wrk)" >&2; exit 2; }
[ -x "$py" ] || { echo "no $py: run make .venv/.installed first" >&2; exit 2; }
export LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_TELEMETRY=False LITELLM_LOG=ERROR

run() {  # label, proxy command, extra options...
  local label="$1" cmd="$2"; shift 2
  echo "== $label" >&2
  "$py" "$here/compare.py" --label "$label" --proxy-cmd "$cmd" --log-dir "$out/logs" \
      --json-out "$out/$label.json" "$@" | tee "$out/$label.md"
}

cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
export CTXPROXY_CACHE_DIR="$cache"
run ctxproxy-under "$root/.venv/bin/ctxproxy serve --config $here/configs/under_budget.yaml --port {port}" "$@"
run ctxproxy-over "$root/.venv/bin/ctxproxy serve --config $here/configs/over_budget.yaml --port {port}" "$@"
if [ -n "$litellm_venv" ]; then
  run litellm "$litellm_venv/bin/litellm --config $here/litellm_config.yaml --host 127.0.0.1 --port {port}" "$@"
else
  echo "== litellm: skipped (give LITELLM_VENV=<a venv with litellm[proxy]> to run it in the same session)" >&2
fi
echo "== tables and raw data in $out" >&2
