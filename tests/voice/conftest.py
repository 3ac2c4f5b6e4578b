"""The voice assistant server (Whisper -> SmolLM2 -> Piper) the modules of this package share.

Package-scoped: it starts before the first of them and stops after the last, so it does not stay up
(holding memory, processes and shared memory) while the rest of the suite runs.
"""

from __future__ import annotations

import pytest

from tests.otlp_receiver import OtlpReceiver
from tests.serve_helpers import openai_client, running_server


@pytest.fixture(scope="package")
def receiver():
    """The OTLP/HTTP collector the server traces to (every test of the package runs traced)."""
    with OtlpReceiver() as rx:
        yield rx


@pytest.fixture(scope="package")
def server(tmp_path_factory, smollm2_path, receiver):
    """``omni-engine serve`` of stage_configs/voice_assistant.yaml as model ``voice-assistant`` behind an
    API key, traced to ``receiver``."""
    with running_server("stage_configs/voice_assistant.yaml", "voice-assistant", tmp_path_factory.mktemp("serve-va"),
                        api_key="va-key", extra_args=("--otlp-traces-endpoint", receiver.url),
                        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server):
    """The official ``openai`` client for ``server``."""
    return openai_client(server)
