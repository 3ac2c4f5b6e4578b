"""A short soak in CI: 150 requests through the real speech pipeline at steady concurrency after a
warm-up of 50, every one complete, no state left, and the RSS of every process (client, stages,
vLLM's EngineCore) reported. Growth is checked only loosely here (a short run is noisy); the real
check is ``tests/stress/soak.py --requests 10000`` (< 5 % per process)."""

from __future__ import annotations

import json

import pytest

from tests.stress.pipeline import QUESTIONS
from tests.stress.soak import soak

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.llm, pytest.mark.tts]

REQUESTS = 150
WARMUP = 50
# 8 tokens still make a sentence to speak; more does not fit 200 requests in CI time on two CPU cores.
MAX_TOKENS = 8
MAX_GROWTH_PCT = 25.0


async def test_short_soak_completes_every_request_with_flat_memory(speech_pipeline, chat_prompt):
    report = await soak(speech_pipeline, [chat_prompt(q) for q in QUESTIONS], requests=REQUESTS, duration=None,
                        concurrency=16, warmup=WARMUP, max_tokens=MAX_TOKENS, sample_every=50)
    result = report.to_dict()
    print(json.dumps(result, indent=1))
    assert report.failed == 0, report.errors
    assert report.completed == REQUESTS
    assert not report.leftovers
    # Every process was measured at both ends: the client, both stages and vLLM's EngineCore.
    growth = report.rss_growth_pct()
    assert {"client", "stage0", "stage1"} <= set(growth) and len(growth) >= 4, growth
    assert all(pct is not None and pct < MAX_GROWTH_PCT for pct in growth.values()), growth
