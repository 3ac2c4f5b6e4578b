"""The stress runs in CI, short, on one speech pipeline (SmolLM2 -> eSpeak NG, async_chunk) of this
module's own (one vLLM start for both):

* the abort storm: 100 requests, about half aborted at a random point, by every method. Afterwards
  no request state anywhere, every shared-memory slot back, and every request that was not aborted
  complete. The full-size run is ``tests/stress/abort_storm.py --requests 1000`` (both architectures);
* the soak: 150 requests at steady concurrency after a warm-up of 50, every one complete, no state
  left, and the RSS of every process (client, stages, vLLM's EngineCore) reported. Growth is checked
  only loosely here (a short run is noisy, and it follows the storm); the real check is
  ``tests/stress/soak.py --requests 10000`` (< 5 % per process)."""

from __future__ import annotations

import json

import pytest

from tests.stress.checks import wait_clean
from tests.stress.pipeline import QUESTIONS
from tests.stress.soak import soak
from tests.stress.storm import KINDS, make_plans, run_storm, summarize

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.llm, pytest.mark.tts]

REQUESTS = 100
CONCURRENCY = 8

SOAK_REQUESTS = 150
SOAK_WARMUP = 50
# 8 tokens still make a sentence to speak; more does not fit 200 requests in CI time on two CPU cores.
SOAK_MAX_TOKENS = 8
SOAK_MAX_GROWTH_PCT = 25.0


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


async def test_short_soak_completes_every_request_with_flat_memory(speech_pipeline, chat_prompt):
    report = await soak(speech_pipeline, [chat_prompt(q) for q in QUESTIONS], requests=SOAK_REQUESTS, duration=None,
                        concurrency=16, warmup=SOAK_WARMUP, max_tokens=SOAK_MAX_TOKENS, sample_every=50)
    result = report.to_dict()
    print(json.dumps(result, indent=1))
    assert report.failed == 0, report.errors
    assert report.completed == SOAK_REQUESTS
    assert not report.leftovers
    # Every process was measured at both ends: the client, both stages and vLLM's EngineCore.
    growth = report.rss_growth_pct()
    assert {"client", "stage0", "stage1"} <= set(growth) and len(growth) >= 4, growth
    assert all(pct is not None and pct < SOAK_MAX_GROWTH_PCT for pct in growth.values()), growth
