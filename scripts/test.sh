#!/usr/bin/env bash
# Installs everything and runs the test suite (real vLLM, real eSpeak NG).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
python3 -m omni_engine.entrypoints.cli.main prepare-model smollm2 >/dev/null
exec python3 -m pytest -q -p no:cacheprovider --durations=40 "$@"
