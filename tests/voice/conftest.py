"""The voice assistant server (Whisper -> SmolLM2 -> Piper) the modules of this package share.

Package-scoped: it starts before the first of them and stops after the last, so it does not stay up
(holding memory, processes and shared memory) while the rest of the suite runs.
"""

from __future__ import annotations

import pytest

from tests.serve_helpers import openai_client, running_server


@pytest.fixture(scope="package")
def server(tmp_path_factory, smollm2_path):
    """``omni-engine serve`` of stage_configs/voice_assistant.yaml as model ``voice-assistant`` behind an
    API key."""
    with running_server("stage_configs/voice_assistant.yaml", "voice-assistant", tmp_path_factory.mktemp("serve-va"),
                        api_key="va-key") as srv:
        yield srv


@pytest.fixture(scope="package")
def client(server):
    """The official ``openai`` client for ``server``."""
    return openai_client(server)
