#!/usr/bin/env bash
# vLLM's own OpenAI entrypoint tests (tests/entrypoints/ of the installed vLLM's release source) run
# against `omni-engine serve stage_configs/smollm2_text.yaml` and against vLLM's own api_server on the
# same model; prints a side-by-side table (README, "Conformance with vLLM's own tests").
#   bash scripts/conformance.sh [--files F ...] [--only ours|vllm] [--out report.json] [--timeout S]
# Needs the README's install (bash scripts/install.sh). Exits 1 when a test passes on vLLM's server
# and not on ours without being named in scripts/conformance.py's KNOWN_DIFFERENCES.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
CONFORMANCE_PIDFILE=$(mktemp -t omni-conformance-pids.XXXXXX)
export CONFORMANCE_PIDFILE
driver=
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [[ -n "$driver" ]] && kill -0 "$driver" 2>/dev/null; then
        kill -TERM "$driver" 2>/dev/null || true
        wait "$driver" 2>/dev/null || true
    fi
    # every server the driver started leads its own process group
    while read -r pgid; do
        [[ -n "$pgid" ]] && kill -KILL -- "-$pgid" 2>/dev/null || true
    done < "$CONFORMANCE_PIDFILE"
    rm -f "$CONFORMANCE_PIDFILE"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
python3 scripts/conformance.py "$@" &
driver=$!
wait "$driver"
