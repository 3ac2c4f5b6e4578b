"""Session-wide fixtures: the real SmolLM2 model and real stage processes.

Engines start once per test session (vLLM takes ~25 s here); tests share them.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# Before vLLM is imported anywhere: a small KV cache on these machines.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Stage logs of this session (failed stages keep theirs: several tests kill
# stages on purpose) go to a directory removed when the session ends.
_LOG_DIR = tempfile.mkdtemp(prefix="omni_test_logs_")
os.environ["OMNI_ENGINE_LOG_DIR"] = _LOG_DIR

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import pytest_asyncio  # noqa: E402

from omni_engine.connectors.shm import list_segments  # noqa: E402
from omni_engine.stage_engine.stage_process import StageProcessSpec  # noqa: E402
from tests.early_release import EarlyRelease  # noqa: E402
from tests.helpers import RawFrameClient, llm_engine_args, tts_spec  # noqa: E402

# The session-scoped engines below end right after the last test of the run that uses them.
EARLY_RELEASE = EarlyRelease()
SHARED_ENGINES = ("text_server", "text_pipeline", "llm_stage", "tts_stage")


def pytest_collection_finish(session: pytest.Session) -> None:
    EARLY_RELEASE.plan(session.items, SHARED_ENGINES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    EARLY_RELEASE.after(item)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from omni_engine.models.prepare import prepare_model

    return prepare_model("smollm2", progress=lambda msg: print(f"[prepare-model] {msg}"))


@pytest.fixture(scope="module")
def omni_dir() -> Path:
    """The tiny seeded Qwen2.5-Omni checkpoint (``prepare-model qwen2.5-omni-tiny``)."""
    from omni_engine.models.prepare import prepare_model

    return prepare_model("qwen2.5-omni-tiny")


@pytest.fixture(scope="module")
def reference(omni_dir):
    """transformers' Qwen2.5-Omni on it, the reference of the family's tests (one per module: ~90 MB)."""
    from tests.qwen_omni_reference import load_reference

    return load_reference(omni_dir)


@pytest.fixture(scope="session")
def chat_prompt(smollm2_path):
    """Render a one-turn chat with the model's own template (as vLLM's server would)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)

    def render(question: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )

    return render


@pytest.fixture(scope="session")
def text_server(tmp_path_factory, smollm2_path):
    """``omni-engine serve`` of the text pipeline as model ``smollm2-test``, for the modules that only
    send it requests (one vLLM start instead of one per module). Dev mode: vLLM's RL routes
    (/pause, /resume, /abort_requests) are on, as RL trainers use them."""
    from contextlib import ExitStack

    from tests.serve_helpers import running_server

    stack = ExitStack()
    srv = stack.enter_context(running_server("stage_configs/smollm2_text.yaml", "smollm2-test",
                                             tmp_path_factory.mktemp("serve"), env={"VLLM_SERVER_DEV_MODE": "1"}))
    release = EARLY_RELEASE.register("text_server", stack.close)
    yield srv
    release()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def text_pipeline(smollm2_path):
    """The text pipeline (smollm2_text.yaml) in this process, for the modules that only send it
    requests (the AsyncLLM parity checks, the engine sampler): one vLLM start for them all.
    Checked after shutdown for leftover processes, segments and request state."""
    from tests.stress.checks import after_shutdown
    from tests.stress.pipeline import REPO, speech_config, start_pipeline

    client = await start_pipeline(speech_config(REPO / "stage_configs" / "smollm2_text.yaml", model=smollm2_path))

    async def stop() -> None:
        await client.shutdown_async()
        assert not await after_shutdown(client)

    release = EARLY_RELEASE.register_async("text_pipeline", stop)
    yield client
    await release()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def llm_stage(smollm2_path):
    # Priority scheduling: a request's deadline becomes vLLM's priority (test_stage_llm); without
    # one every request is due a fixed slack after it arrived, which is first come, first served.
    # Its EngineCore comes from a warm forkserver (test_stage_llm checks it); the suite's other llm
    # stages fork theirs, the default.
    client = RawFrameClient(0, process=StageProcessSpec("llm", llm_engine_args(smollm2_path,
                                                                               scheduling_policy="priority"),
                                                        engine_core_start="forkserver"))
    await client.start()
    release = EARLY_RELEASE.register_async("llm_stage", client.shutdown)
    yield client
    await release()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def tts_stage():
    client = RawFrameClient(1, process=tts_spec(max_batch_size=4))
    await client.start()
    release = EARLY_RELEASE.register_async("tts_stage", client.shutdown)
    yield client
    await release()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def speech_pipeline(smollm2_path):
    """A speech pipeline of the module's own (stress tests: no other test's requests in it),
    checked after shutdown for leftover processes, segments and request state. Module-scoped
    on purpose: held for the whole session, its EngineCore's 2.3 GB helped push the Ray
    sampler's workers past Ray's memory threshold (CI run of 2026-11-26)."""
    from tests.stress.checks import after_shutdown
    from tests.stress.pipeline import speech_config, start_pipeline

    client = await start_pipeline(speech_config(model=smollm2_path))
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments():
    """After the whole session, no shared-memory segment of ours may remain."""
    yield
    leftover = [n for n in list_segments() if n.startswith(f"omni_{os.getpid()}_")]
    shutil.rmtree(_LOG_DIR, ignore_errors=True)
    assert not leftover, f"shared-memory segments leaked: {leftover}"
