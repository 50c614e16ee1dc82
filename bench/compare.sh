#!/usr/bin/env bash
# Side-by-side overhead benchmark: the harness in this folder (compare.py: fake upstream + wrk, direct vs
# proxy, alternating) run for ctxproxy in two configurations (agent_long under budget = pure pass-through;
# over budget = summarising with a cached summary) and, when a LiteLLM venv is given, for LiteLLM in the
# same run, and for context-guardian when a venv of it is given; and the HTTP stack's floor (floor_relay.py:
# aiohttp relaying bytes, nothing else). `make bench` calls it.
#
# usage: bench/compare.sh [LITELLM_VENV] [extra compare.py options, e.g. --rounds 3 --duration 10s]
#        (LITELLM_VENV and CG_VENV may also come from the environment; BENCH_OUT sets the output folder)
# output: <BENCH_OUT, default bench/results>/<label>.md tables and <label>.json raw data, and summary.md: the
#         proxies side by side (bench/summary.py)
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
cg_venv="${CG_VENV:-}"
if [ -n "$cg_venv" ]; then
  [ -x "$cg_venv/bin/context-guardian" ] || { echo "no context-guardian in $cg_venv (pip install context-guardian there)" >&2; exit 2; }
  cg_venv="$(realpath "$cg_venv")"
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
# the floor: the same HTTP stack relaying bytes and nothing else (floor_relay.py)
run floor "$py $here/floor_relay.py --port {port}" "$@"
run ctxproxy-under "$root/.venv/bin/ctxproxy serve --config $here/configs/under_budget.yaml --port {port}" "$@"
run ctxproxy-over "$root/.venv/bin/ctxproxy serve --config $here/configs/over_budget.yaml --port {port}" "$@"
if [ -n "$litellm_venv" ]; then
  run litellm "$litellm_venv/bin/litellm --config $here/litellm_config.yaml --host 127.0.0.1 --port {port}" "$@"
else
  echo "== litellm: skipped (give LITELLM_VENV=<a venv with litellm[proxy]> to run it in the same session)" >&2
fi
if [ -n "$cg_venv" ]; then
  mkdir -p "$cache/guardian"
  # context-guardian 0.12 as bench/RESULTS-anchor.md ran it: bound to loopback, a 128k window (neither payload is
  # compacted), no version check, a fresh data folder
  run context-guardian "env GUARDIAN_HOST=127.0.0.1 GUARDIAN_PORT={port} GUARDIAN_UPSTREAM_URL={upstream} \
GUARDIAN_NUM_CTX=128000 GUARDIAN_VERSION_CHECK=0 GUARDIAN_DATA_DIR=$cache/guardian $cg_venv/bin/context-guardian" "$@"
else
  echo "== context-guardian: skipped (give CG_VENV=<a venv with context-guardian> to run it in the same session)" >&2
fi
"$py" "$here/summary.py" "$out" | tee "$out/summary.md"
echo "== tables and raw data in $out" >&2
