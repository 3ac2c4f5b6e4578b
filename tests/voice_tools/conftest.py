"""The voice assistant with tools (Whisper -> Qwen2.5-Coder-0.5B -> Piper, vLLM's tool parsing on) that
this package's tests share; package-scoped, so it is up only while they run (it holds a 0.5B LLM)."""

from __future__ import annotations

import pytest

from tests.serve_helpers import running_server

MODEL = "voice-tools"


@pytest.fixture(scope="package")
def server(tmp_path_factory):
    """``omni-engine serve stage_configs/voice_assistant_tools.yaml --enable-auto-tool-choice
    --tool-call-parser hermes_json`` as model ``voice-tools`` behind an API key. Qwen is prepared first (a
    470 MB download and a conversion on a fresh machine), so the server's start is only the start."""
    from omni_engine.models.prepare import prepare_model

    prepare_model("qwen2.5-coder-0.5b", progress=lambda msg: print(f"[prepare-model] {msg}"))
    with running_server("stage_configs/voice_assistant_tools.yaml", MODEL, tmp_path_factory.mktemp("serve-tools"),
                        ("--enable-auto-tool-choice", "--tool-call-parser", "hermes_json"),
                        api_key="tools-key") as srv:
        yield srv
