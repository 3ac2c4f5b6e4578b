"""The generation engine's batcher and aborts, in-process (the engine is what is tested)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_engine.engines.generation import GenerationStageEngine

SINK = {"model_factory": "tests.models:make_tensor_sink"}  # sleeps a request's "delay", ignoring aborts


async def run(engine: GenerationStageEngine, request_id: str, delay: float) -> list:
    prompt = {"tensor": torch.full((8,), 3, dtype=torch.uint8), "delay": delay}
    return [o async for o in engine.generate(request_id, prompt, None)]


async def until_running(engine: GenerationStageEngine, n: int) -> None:
    async with asyncio.timeout(10):
        while engine.num_running() != n:
            await asyncio.sleep(0.01)


@pytest.fixture
async def engine(request):
    engine = GenerationStageEngine(0, SINK, max_batch_size=request.param)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.mark.parametrize("engine", [1], indirect=True)
@pytest.mark.parametrize("how", ["abort", "caller cancels"])
async def test_a_batch_whose_requests_all_went_away_stops_and_frees_the_stage(engine, how):
    """A model that ignores ``request.aborted`` must not hold the stage for a request nobody wants."""
    held = asyncio.create_task(run(engine, "held", 600))
    await until_running(engine, 1)
    if how == "abort":
        await engine.abort(["held"])
    else:
        held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    async with asyncio.timeout(10):  # not 600 s
        (output,) = await run(engine, "next", 0)
    assert output.finished and output.multimodal_output["first"] == 3
    assert engine.num_unfinished_requests() == 0 and engine.num_running() is None


@pytest.mark.parametrize("engine", [2], indirect=True)
async def test_a_batch_with_one_request_left_runs_to_its_end(engine):
    first = asyncio.create_task(run(engine, "aborted", 0.5))
    second = asyncio.create_task(run(engine, "kept", 0.5))
    await until_running(engine, 2)
    await engine.abort(["aborted"])
    with pytest.raises(asyncio.CancelledError):
        await first
    (output,) = await asyncio.wait_for(second, 10)
    assert output.request_id == "kept" and output.finished and output.multimodal_output["all_same"]


async def test_a_model_that_batches_by_key_gets_the_earliest_request_and_only_requests_of_its_key():
    """A model whose pass takes one shape (``batch_key``) answers a batch after its last pass: the
    engine hands it the earliest-deadline request with the queued ones of its key, and picks the
    next batch by deadline again, so a stream's first piece does not wait for later pieces of other
    shapes. A request it cannot key goes alone and fails alone."""
    engine = GenerationStageEngine(0, {"model_factory": "tests.models:make_keyed_batches"}, max_batch_size=8)
    await engine.start()
    try:
        hold = asyncio.Event()
        first = engine.submit("hold", {"shape": "a", "hold": hold}, None, deadline=0.0)
        await until_running(engine, 1)
        # Queued while the stage is busy, deadlines out of order: b(1) a(2) c(3) b(4) a(5) and one unkeyed.
        queued = {rid: engine.submit(rid, prompt, None, deadline=deadline) for rid, prompt, deadline in [
            ("a2", {"shape": "a"}, 2.0), ("b4", {"shape": "b"}, 4.0), ("b1", {"shape": "b"}, 1.0),
            ("c3", {"shape": "c"}, 3.0), ("a5", {"shape": "a"}, 5.0), ("bad", {}, 2.5)]}
        hold.set()
        await first
        results = await asyncio.gather(*queued.values(), return_exceptions=True)
        assert engine.model.batches == [["hold"], ["b1", "b4"], ["a2", "a5"], ["bad"], ["c3"]]
        outcome = dict(zip(queued, results))
        assert isinstance(outcome.pop("bad"), ValueError)
        assert {rid: out.multimodal_output["shape"] for rid, out in outcome.items()} == {
            "a2": "a", "b4": "b", "b1": "b", "c3": "c", "a5": "a"}
        assert engine.num_unfinished_requests() == 0
    finally:
        await engine.shutdown()
