#!/usr/bin/env bash
# Installs everything, prepares SmolLM2 offline, and asks it a question through
# a vLLM stage process and an eSpeak NG stage process: text on stdout,
# out/answer.txt and out/answer.wav on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec omni-engine ask "${1:-What is the capital of France?}" --output-dir "${2:-out}"
