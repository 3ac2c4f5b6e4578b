"""``MultiStageEngineClient`` held to vLLM's own ``AsyncLLM`` contract (vLLM's engine tests), on the
one-stage SmolLM2 pipeline: exact token counts under concurrency, abort ending each stream with a
final partial output (``finish_reason="abort"``), ``finished`` only on the last output with ``n > 1``."""

from __future__ import annotations

import asyncio
import sys

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind


pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.llm]

DELTA, FINAL_ONLY, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE


@pytest.fixture
def client(text_pipeline):
    """conftest's session text pipeline (checked for leftovers when it shuts down); every test here
    ends with no request state of its own."""
    return text_pipeline


def params(max_tokens: int, kind: RequestOutputKind, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind, n=n, temperature=0.8 if n > 1
                          else 0.0, seed=0)


async def token_counts(client, prompt, request_id: str, p: SamplingParams) -> tuple[dict[int, int], list]:
    """Tokens per completion index (summed for DELTA, last for the others), and every output."""
    outputs = [o async for o in client.generate(prompt, p, request_id)]
    counts: dict[int, int] = {}
    for out in outputs:
        for c in out.outputs:
            counts[c.index] = counts.get(c.index, 0) + len(c.token_ids) if p.output_kind is DELTA else len(c.token_ids)
    return counts, outputs


@pytest.mark.parametrize("kind", [DELTA, FINAL_ONLY])
async def test_64_concurrent_requests_get_exact_token_counts(client, chat_prompt, kind):
    prompt = chat_prompt("Tell me a story.")
    lengths = [8 + (i % 5) * 6 for i in range(64)]
    results = await asyncio.gather(*(token_counts(client, prompt, f"exact-{kind.name}-{i}", params(n, kind))
                                     for i, n in enumerate(lengths)))
    for n, (counts, outputs) in zip(lengths, results):
        assert counts == {0: n}
        assert [o.finished for o in outputs][-1] and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].finish_reason == "length"
        if kind is FINAL_ONLY:
            assert len(outputs) == 1
    assert client.state_counts() == {k: 0 for k in client.state_counts()}


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE, FINAL_ONLY])
async def test_abort_of_some_ends_their_streams_with_partial_outputs_and_the_rest_complete(client, chat_prompt,
                                                                                        kind):
    prompt = chat_prompt("Write a long story about a dragon.")
    n_requests, aborted_ids, max_tokens = 8, {f"ab-{kind.name}-{i}" for i in range(0, 8, 2)}, 300
    streams: dict[str, list] = {f"ab-{kind.name}-{i}": [] for i in range(n_requests)}
    started = {rid: asyncio.Event() for rid in streams}

    async def read(rid: str) -> None:
        # FINAL_ONLY streams have nothing before the end: they count as started once submitted.
        if kind is FINAL_ONLY:
            started[rid].set()
        async for out in client.generate(prompt, params(max_tokens, kind), rid):
            streams[rid].append(out)
            started[rid].set()

    readers = [asyncio.create_task(read(rid)) for rid in streams]
    witness_tokens = 0
    witnessed = asyncio.Event()

    async def witness() -> None:
        # FINAL_ONLY streams show nothing before the end. A streaming request submitted after
        # them runs in the same batch (max_num_seqs 16): once it has 3 tokens, every earlier
        # request has some (a synchronization, where a sleep would only be a guess).
        nonlocal witness_tokens
        async for out in client.generate(prompt, params(max_tokens, DELTA), f"witness-{kind.name}"):
            witness_tokens += len(out.outputs[0].token_ids)
            if witness_tokens >= 3:
                witnessed.set()

    watcher = asyncio.create_task(witness()) if kind is FINAL_ONLY else None
    async with asyncio.timeout(120):
        await asyncio.gather(*(started[rid].wait() for rid in aborted_ids))
        if watcher is not None:
            await witnessed.wait()
        await client.abort(list(aborted_ids) + ["no-such-request"] + ([f"witness-{kind.name}"] if watcher else []))
        await asyncio.gather(*readers, *([watcher] if watcher else []))  # every stream ends; none raises
    for rid, outputs in streams.items():
        last = outputs[-1]
        assert last.finished and not any(o.finished for o in outputs[:-1]), rid
        total = (sum(len(o.outputs[0].token_ids) for o in outputs) if kind is DELTA
                 else len(last.outputs[0].token_ids))
        if rid in aborted_ids:
            assert last.outputs[0].finish_reason == "abort", (rid, last)
            assert 0 < total < max_tokens, (rid, total)
            if kind is not DELTA:
                assert last.outputs[0].text  # the partial answer, not an empty one
        else:
            assert last.outputs[0].finish_reason == "length" and total == max_tokens, (rid, total)
    await client.abort(list(aborted_ids))  # aborting what has ended is a no-op
    assert client.state_counts() == {k: 0 for k in client.state_counts()}


@pytest.mark.parametrize("kind", [DELTA, CUMULATIVE])
async def test_with_n_3_finished_is_only_on_the_last_output_also_when_aborted(client, chat_prompt, kind):
    prompt = chat_prompt("Tell me a story.")
    counts, outputs = await token_counts(client, prompt, f"n3-{kind.name}", params(12, kind, n=3))
    assert counts == {0: 12, 1: 12, 2: 12}
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])

    stream = client.generate(prompt, params(500, kind, n=3), f"n3-abort-{kind.name}")
    seen = [await anext(stream)]
    await client.abort(f"n3-abort-{kind.name}")
    seen += [o async for o in stream]
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    reasons = {c.index: c.finish_reason for o in seen for c in o.outputs if c.finish_reason}
    assert reasons == {0: "abort", 1: "abort", 2: "abort"}


# The client's half of the README's "path of one request" (``scripts/request_path.py`` prints
# both halves): every omni_engine module whose code runs for a request in the client.
CLIENT_PATH = {"entrypoints/multi_stage_engine_client.py", "pipeline/orchestrator.py", "pipeline/request_state.py",
               "pipeline/request_events.py", "pipeline/request_endings.py", "metrics.py",
               "stage_engine/base_client.py", "stage_engine/stage_core_client.py", "stage_engine/loop_socket.py",
               "wire/protocol.py", "wire/stage_serialization.py", "wire/stage_decoder.py"}


async def test_a_request_runs_only_the_modules_the_readme_names(client, chat_prompt):
    prompt, p = chat_prompt("Say hi."), params(4, DELTA)
    assert [o async for o in client.generate(prompt, p, "path-warm-up")][-1].finished
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and "/omni_engine/" in frame.f_code.co_filename:
            seen.add(frame.f_code.co_filename.rsplit("/omni_engine/", 1)[1])

    sys.setprofile(profile)
    try:
        outputs = [o async for o in client.generate(prompt, p, "path-traced")]
    finally:
        sys.setprofile(None)
    assert outputs[-1].finished
    assert seen == CLIENT_PATH, f"new on the path: {sorted(seen - CLIENT_PATH)}; gone: {sorted(CLIENT_PATH - seen)}"
