"""A talker's requests that lead their listeners wait while another request's first audio is made
(``engines/lead_limit.py``), through ``InputSession``'s chunks as vLLM takes them."""

from __future__ import annotations

import asyncio
import time

import pytest
from vllm import SamplingParams

from omni_engine.engines.input_session import InputSession
from omni_engine.engines.lead_limit import LeadLimit, LeadLimitConfig, lead_limit_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def session_of(limit: LeadLimit, rid: str, allowed: int | None = None) -> tuple[InputSession, object]:
    session = InputSession(1, rid, limit)
    limit.opened(session)
    chunks, _ = session.chunks({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=1000))
    session.allow(allowed)
    return session, chunks


async def run_chunk(session: InputSession, chunks, made: int | None = None) -> int:
    """Take the next chunk and make its tokens (all, or ``made``); returns the chunk's max_tokens."""
    chunk = await asyncio.wait_for(chunks.__anext__(), 5)
    n = chunk.sampling_params.max_tokens if made is None else made
    for _ in range(n):
        session.observe([7], None)
    if made is None:
        session.observe([], "length")
    return chunk.sampling_params.max_tokens


async def test_a_request_that_leads_waits_for_another_s_first_audio_then_goes():
    clock = Clock()
    # 1 token a second: a lead of 24 s, so only the other's first audio (not the clock) can let it go
    limit = LeadLimit(LeadLimitConfig(tokens_per_second=1, lead_s=1.0, first_tokens=4, chunk_tokens=12), clock)
    ahead, ahead_chunks = session_of(limit, "ahead")
    assert await run_chunk(ahead, ahead_chunks) == 12, "a free-running request's chunks are chunk_tokens long"
    assert await run_chunk(ahead, ahead_chunks) == 12  # no one waits for first audio: no hold
    assert ahead.made == 24 and limit.held == 0  # 24 s of speech made at once

    new, new_chunks = session_of(limit, "new")
    taken = asyncio.ensure_future(run_chunk(ahead, ahead_chunks))
    await asyncio.sleep(0.05)
    assert not taken.done() and limit.held == 1, "it led by 24 s while another request had no audio"
    await run_chunk(new, new_chunks, made=3)  # the new one is never held; 3 tokens: not its first audio yet
    await asyncio.sleep(0.05)
    assert not taken.done()
    new.observe([7], None)  # its 4th token: its first audio can be made
    assert await asyncio.wait_for(taken, 5) == 12  # (its lead alone would hold it 23 s)


async def test_a_held_request_goes_when_its_lead_has_shrunk_to_the_limit():
    # the real clock: 30 tokens at 100 a second lead by 0.3 s; the limit is 0.1 s, so ~0.2 s held
    limit = LeadLimit(LeadLimitConfig(tokens_per_second=100, lead_s=0.1, first_tokens=4, chunk_tokens=30))
    ahead, ahead_chunks = session_of(limit, "ahead")
    await run_chunk(ahead, ahead_chunks)
    session_of(limit, "new")  # waits for its first audio and never gets it
    start = time.monotonic()
    await run_chunk(ahead, ahead_chunks)
    waited = time.monotonic() - start
    assert limit.held == 1 and 0.1 < waited < 3, f"held {waited:.3f} s for a lead of ~0.2 s over the limit"


async def test_a_request_that_ends_or_is_closed_before_its_first_audio_lets_the_others_go():
    clock = Clock()
    limit = LeadLimit(LeadLimitConfig(tokens_per_second=1, lead_s=0.5, chunk_tokens=10), clock)
    ahead, ahead_chunks = session_of(limit, "ahead")
    await run_chunk(ahead, ahead_chunks)
    stopped, stopped_chunks = session_of(limit, "stopped")
    closed, _ = session_of(limit, "closed")
    taken = asyncio.ensure_future(run_chunk(ahead, ahead_chunks))
    await asyncio.sleep(0.05)
    assert not taken.done()
    await run_chunk(stopped, stopped_chunks, made=0)
    stopped.observe([7], "stop")  # ended at its stop token after one token
    await asyncio.sleep(0.05)
    assert not taken.done(), "another request still waits for its first audio"
    limit.closed(closed)  # aborted: the stage closes it
    assert await asyncio.wait_for(taken, 5) == 10
    assert limit.held == 1


async def test_no_hold_for_a_request_within_its_lead_or_still_starting_itself():
    clock = Clock()
    limit = LeadLimit(LeadLimitConfig(tokens_per_second=10, lead_s=2.0, chunk_tokens=10), clock)
    within, within_chunks = session_of(limit, "within")
    await run_chunk(within, within_chunks)  # leads by 1 s: under the limit
    starting, starting_chunks = session_of(limit, "starting", allowed=2)
    session_of(limit, "other")
    assert await run_chunk(within, within_chunks) == 10
    assert await run_chunk(starting, starting_chunks) == 2, "a request short of its first audio is never held"
    clock.now += 5  # the listener played on: 2 s made, 5 s passed
    assert await run_chunk(within, within_chunks) == 10
    assert limit.held == 0


async def test_the_thinker_s_allowance_still_bounds_a_chunk():
    limit = LeadLimit(LeadLimitConfig(tokens_per_second=10, chunk_tokens=12), Clock())
    session, chunks = session_of(limit, "r", allowed=5)
    assert await run_chunk(session, chunks) == 5
    session.allow(40)
    assert await run_chunk(session, chunks) == 12 and await run_chunk(session, chunks) == 12
    assert await run_chunk(session, chunks) == 11  # up to the allowance


def test_lead_limit_settings_are_checked_by_name():
    assert lead_limit_of(1, {}) is None
    args = {"lead_limit": {"tokens_per_second": 12.5, "lead_s": 3}, "model": "m"}
    limit = lead_limit_of(1, args)
    assert limit.config == LeadLimitConfig(tokens_per_second=12.5, lead_s=3.0) and args == {"model": "m"}
    for bad, says in [({"lead_s": 1}, "tokens_per_second"), ({"tokens_per_second": 0}, "tokens_per_second"),
                      ({"tokens_per_second": 1, "first_token": 4}, "first_token"),
                      ({"tokens_per_second": 1, "chunk_tokens": 0}, "chunk_tokens")]:
        with pytest.raises(ValueError, match=f"stage 1: engine_args.lead_limit: .*{says}"):
            lead_limit_of(1, {"lead_limit": bad})


def test_an_llm_stage_takes_its_lead_limit_and_gives_it_to_its_requests_fed_in_parts():
    from omni_engine.engines.llm import LLMStageEngine

    engine = LLMStageEngine(1, {"model": "m", "request_adapter": "a:B",
                                "lead_limit": {"tokens_per_second": 12.5}})
    assert "lead_limit" not in engine.engine_args and engine.lead_limit.config.tokens_per_second == 12.5
    engine.adapter = type("Adapter", (), {"adapt_parts": None})()
    engine.open_request("r", input_stream=True, stream_states=False)
    session = engine.sessions["r"]
    assert session.lead is engine.lead_limit and engine.lead_limit.sessions == {session}
    engine.close_request("r")
    assert not engine.lead_limit.sessions
    assert LLMStageEngine(1, {"model": "m"}).lead_limit is None
    with pytest.raises(ValueError, match="stage 2: engine_args.lead_limit"):
        LLMStageEngine(2, {"model": "m", "lead_limit": {"lead_s": 1}})
