#!/usr/bin/env bash
# Side-by-side overhead benchmark: the shared harness (../shared/bench/compare.py) run for ctxproxy
# in two configurations (agent_long under budget = pure pass-through; over budget = summarising with
# a cached summary) and, when a LiteLLM venv is given, for LiteLLM in the same run.
#
# usage: bench/compare.sh [LITELLM_VENV] [extra compare.py options, e.g. --rounds 3 --duration 10s]
# output: bench/results/<label>.md tables and <label>.json raw data
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
shared="${SHARED_BENCH:-$root/../shared/bench}"
py="$root/.venv/bin/python"
out="$here/results"
mkdir -p "$out"
litellm_venv=""
if [ $# -gt 0 ] && [ -d "$1" ]; then litellm_venv="$(realpath "$1")"; shift; fi
export LITELLM_LOCAL_MODEL_COST_MAP=True LITELLM_TELEMETRY=False LITELLM_LOG=ERROR

run() {  # label, proxy command, extra options...
  local label="$1" cmd="$2"; shift 2
  echo "== $label" >&2
  "$py" "$shared/compare.py" --label "$label" --proxy-cmd "$cmd" --log-dir "$out/logs" \
      --json-out "$out/$label.json" "$@" | tee "$out/$label.md"
}

cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
export CTXPROXY_CACHE_DIR="$cache"
run ctxproxy-under "$root/.venv/bin/ctxproxy serve --config $here/configs/under_budget.yaml --port {port}" "$@"
run ctxproxy-over "$root/.venv/bin/ctxproxy serve --config $here/configs/over_budget.yaml --port {port}" "$@"
if [ -n "$litellm_venv" ]; then
  run litellm "$litellm_venv/bin/litellm --config $shared/litellm_config.yaml --host 127.0.0.1 --port {port}" "$@"
fi
