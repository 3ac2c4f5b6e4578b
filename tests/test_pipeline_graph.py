"""Routing follows the stage graph (engine_input_source), not list order:
fan-out (one stage feeds two) and fan-in (a stage waits for all its sources)."""

from __future__ import annotations

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

pytestmark = pytest.mark.asyncio(loop_scope="session")


def calc_stage(stage_id, op, sources=(), final=False):
    stage = {"stage_id": stage_id, "stage_type": "generation", "engine_input_source": list(sources),
             "engine_args": {"model_factory": "tests.models:make_calc", "op": op}}
    if sources:
        stage["custom_process_input_func"] = "tests.models:CollectValues"
    if final:
        stage.update(final_output=True, final_output_type="tensor")
    return stage


async def test_fan_out_and_fan_in_follow_the_graph():
    # Listed out of order on purpose: 3 <- (1, 2) <- 0.
    config = parse_pipeline_config({"stage_args": [
        calc_stage(3, "sum", sources=[1, 2], final=True),
        calc_stage(1, "times10", sources=[0], final=True),
        calc_stage(0, "add1"),
        calc_stage(2, "add1", sources=[0]),
    ]}, "<graph>")
    async with await MultiStageEngineClient.from_config(config) as client:
        for x in (2, 5):
            outputs = [o async for o in client.generate({"values": [x]}, None, f"g{x}")]
            by_stage = {o.stage_id: o.multimodal_output["value"] for o in outputs}
            assert by_stage == {1: (x + 1) * 10, 3: (x + 1) * 10 + (x + 1) + 1}
            assert [o.stage_id for o in outputs if o.finished] == [1, 3]  # 3 waited for 1 and 2
        # Only what stage 1 needs runs for final_stage_id=1.
        outputs = [o async for o in client.generate({"values": [1]}, None, "only-1", final_stage_id=1)]
        assert [(o.stage_id, o.multimodal_output["value"]) for o in outputs] == [(1, 20)]
        assert client.metrics.stage(2).requests == 2 and client.metrics.stage(3).requests == 2
        assert client.orchestrator.num_requests == 0
        # entry_stage_id: stage 1 alone, on the caller's input (its source 0 does not run).
        runs0 = client.metrics.stage(0).requests
        outputs = [o async for o in client.generate({"values": [4]}, None, "entry-1", entry_stage_id=1)]
        assert [(o.stage_id, o.multimodal_output["value"]) for o in outputs] == [(1, 40)]
        assert client.metrics.stage(0).requests == runs0
        # From stage 2 on to 3: 3 also needs 1, which stage 2 does not feed.
        with pytest.raises(ValueError, match="entry stage 2"):
            [o async for o in client.generate({"values": [4]}, None, "entry-2", entry_stage_id=2, final_stage_id=3)]
        with pytest.raises(ValueError, match="entry_stage_id 9"):
            [o async for o in client.generate({"values": [4]}, None, "entry-9", entry_stage_id=9)]
        assert client.orchestrator.num_requests == 0


async def test_each_edge_into_a_stage_uses_its_own_input_processor():
    """Two edges into stage 2: 0 -> 2 keeps the stage's processor (CollectValues), 1 -> 2 has its own
    (NegateValues, from runtime.edges). Each builds stage 2's input from its own source."""
    config = parse_pipeline_config({
        "runtime": {"edges": [{"from": 1, "to": 2, "custom_process_input_func": "tests.models:NegateValues"}]},
        "stage_args": [calc_stage(0, "add1"), calc_stage(1, "times10", sources=[0]),
                       calc_stage(2, "sum", sources=[0, 1], final=True)],
    }, "<edges>")
    async with await MultiStageEngineClient.from_config(config) as client:
        outputs = [o async for o in client.generate({"values": [2]}, None, "edges")]
        # One input per edge processor, in source order: [3] from stage 0, [-30] from stage 1.
        assert [o.multimodal_output["value"] for o in outputs if o.multimodal_output] == [3, -30]
        assert client.metrics.stage(2).requests == 2
        # Sampling params reach the pipeline keyed by stage id, whatever form the caller used.
        assert client.sampling_params_by_stage({"max_tokens": 3}) == {0: {"max_tokens": 3}}  # one stage's, as a dict
        assert client.sampling_params_by_stage("p", 1) == {1: "p"}
        assert client.sampling_params_by_stage([None, "b"]) == {1: "b"}  # the seed's list, in stage order
        assert client.sampling_params_by_stage({2: "c"}) == {2: "c"}
        with pytest.raises(ValueError, match="4 entries for 3 stages"):
            client.sampling_params_by_stage(["a", "b", "c", "d"])
        with pytest.raises(ValueError, match=r"stage\(s\) \[7\], which are not in the pipeline"):
            [o async for o in client.generate({"values": [2]}, {7: None, 0: None}, "bad-params")]
    # Without the override both edges share the stage's processor: one input [3, 30].
    config = parse_pipeline_config({"stage_args": [
        calc_stage(0, "add1"), calc_stage(1, "times10", sources=[0]), calc_stage(2, "sum", sources=[0, 1], final=True),
    ]}, "<edges>")
    async with await MultiStageEngineClient.from_config(config) as client:
        outputs = [o async for o in client.generate({"values": [2]}, None, "shared")]
        assert [o.multimodal_output["value"] for o in outputs if o.multimodal_output] == [33]


async def test_fatal_engine_error_sends_dead_and_the_stage_exits():
    from omni_engine.errors import StageDeadError
    from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
    from omni_engine.stage_engine.stage_process import StageProcessSpec

    client = StageEngineCoreClient(0, process=StageProcessSpec("generation", {"model_factory": "tests.models:make_fatal"}))
    await client.start()
    try:
        await client.submit_request("r", {"values": [1]})
        with pytest.raises(StageDeadError, match="stage 0 reported a fatal error: .*device lost"):
            while True:
                try:
                    await client.get_output_async()
                except Exception as exc:  # the request's own ERROR comes first
                    if isinstance(exc, StageDeadError):
                        raise
        client.process.join(10)
        assert client.process.exitcode == 1
    finally:
        await client.shutdown()
