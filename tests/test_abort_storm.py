"""The abort storm in CI: 100 requests through the real speech pipeline (SmolLM2 -> eSpeak NG,
async_chunk), about half aborted at a random point, by every method. Afterwards no request
state anywhere, every shared-memory slot back, and every request that was not aborted complete.
The full-size run is ``tests/stress/abort_storm.py --requests 1000`` (both architectures)."""

from __future__ import annotations

import json

import pytest

from tests.stress.checks import wait_clean
from tests.stress.pipeline import QUESTIONS
from tests.stress.storm import KINDS, make_plans, run_storm, summarize

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.llm, pytest.mark.tts]

REQUESTS = 100
CONCURRENCY = 8


async def test_abort_storm_leaves_no_state_and_the_rest_finish(speech_pipeline, chat_prompt):
    plans = make_plans(REQUESTS, [chat_prompt(q) for q in QUESTIONS], seed=1234, abort_fraction=0.5,
                       max_tokens=(16, 32))
    outcomes = await run_storm(speech_pipeline, plans, CONCURRENCY, timeout=180)
    summary = summarize(outcomes)
    print(json.dumps(summary, indent=1))
    assert not summary["failures"]
    assert summary["not_aborted_finished"] == sum(1 for p in plans if p.kind is None)
    # Every point of abort was hit, by more than one method.
    assert set(KINDS) <= set(summary["by_phase"]), summary["by_phase"]
    assert all(len(methods) >= 2 for methods in summary["by_kind"].values()), summary["by_kind"]
    assert not await wait_clean(speech_pipeline)
    # The audio went through the speech stage's shared-memory pool (so the lease checks meant something).
    stats = await speech_pipeline.stage_contexts[1].client.call_utility_async("shm_stats")
    assert stats["bytes"] > 0


async def test_the_pipeline_serves_after_the_storm(speech_pipeline, chat_prompt):
    plans = make_plans(4, [chat_prompt("What is the capital of France?")], seed=0, abort_fraction=0.0)
    outcomes = await run_storm(speech_pipeline, plans, 4, timeout=180)
    assert not summarize(outcomes)["failures"]
    assert all("Paris" in o.text for o in outcomes), [o.text for o in outcomes]
    assert not await wait_clean(speech_pipeline)
