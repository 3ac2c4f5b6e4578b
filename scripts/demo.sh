#!/usr/bin/env bash
# Installs everything, prepares SmolLM2 offline, and runs the speech pipeline:
# SmolLM2 (vLLM stage process) answers, eSpeak NG (second stage process) speaks
# each sentence as it completes. Text on stdout, out/answer.txt and out/answer.wav on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec omni-engine generate --config stage_configs/smollm2_speech.yaml \
    --prompt "${1:-What is the capital of France?}" --output-dir "${2:-out}"
