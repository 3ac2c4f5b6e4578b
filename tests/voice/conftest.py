"""The voice assistant server (Whisper -> SmolLM2 -> Piper) the modules of this package share.

Package-scoped: it starts before the first of them and stops after the last, so it does not stay up
(holding memory, processes and shared memory) while the rest of the suite runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.otlp_receiver import OtlpReceiver
from tests.serve_helpers import openai_client, running_server


@pytest.fixture(scope="package")
def receiver():
    """The OTLP/HTTP collector the server traces to (every test of the package runs traced)."""
    with OtlpReceiver() as rx:
        yield rx


def steady_voice_config(directory: Path) -> Path:
    """stage_configs/voice_assistant.yaml with its Piper voice's duration noise off (``noise_w: 0``).

    VITS samples its phoneme durations at every synthesis: the same answer spoken twice differed by up
    to 8% in length (2.16-2.35 s for one 31-character answer), so a test comparing the audio of two
    requests either allowed for that and checked little, or failed now and then. With ``noise_w: 0``
    the same text is the same length every time; the timbre's noise (``noise_scale``) stays on."""
    config = yaml.safe_load(Path("stage_configs/voice_assistant.yaml").read_text())
    voice, = (stage for stage in config["stage_args"]
              if stage["engine_args"].get("model_factory", "").endswith(":make_piper_voice"))
    voice["engine_args"]["noise_w"] = 0.0
    path = directory / "voice_assistant.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="package")
def server(tmp_path_factory, smollm2_path, receiver):
    """``omni-engine serve`` of stage_configs/voice_assistant.yaml (durations steady:
    ``steady_voice_config``) as model ``voice-assistant`` behind an API key, traced to ``receiver``."""
    logs = tmp_path_factory.mktemp("serve-va")
    with running_server(str(steady_voice_config(logs)), "voice-assistant", logs,
                        api_key="va-key", extra_args=("--otlp-traces-endpoint", receiver.url),
                        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server):
    """The official ``openai`` client for ``server``."""
    return openai_client(server)
