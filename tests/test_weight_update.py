"""Weight updates into a running pipeline: real SmolLM2 stages (two replicas), real pushes.

The oracle: SmolLM2 ties its input and output embeddings, so version B = version A with
two token rows swapped answers exactly A's greedy answer with those two ids exchanged
(ids A's answer uses and the prompt does not). Every token is attributed to a version by
its spans and checked against that version's answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import pytest_asyncio
import torch
from vllm import SamplingParams

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient, WeightUpdateError
from omni_engine.weights.sender import WeightSender
from tests.helpers import llm_engine_args

pytestmark = pytest.mark.llm

QUESTION = "Tell me a short story about a cat."
MAX_TOKENS = 32
IDLE_TIMEOUT_S = 3.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pipeline(smollm2_path):
    config = parse_pipeline_config({
        "stage_args": [{
            "stage_id": 0, "stage_type": "llm", "engine_args": llm_engine_args(smollm2_path),
            # A warm spare: the killed replica below comes back as it, vLLM imported already.
            "runtime": {"num_replicas": 2, "restart": "on-failure", "warm_spare": True},
            "final_output": True, "final_output_type": "text",
        }],
        "weights": {"backend": "shm", "idle_timeout_s": IDLE_TIMEOUT_S},
    })
    client = await MultiStageEngineClient.from_config(config)
    yield client
    await client.shutdown_async()


@pytest.fixture(scope="module")
def oracle(pipeline, smollm2_path, chat_prompt):
    """The prompt, A's state dict, B's (two embedding rows swapped) and each one's greedy answer."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = chat_prompt(QUESTION)
    state_a = {name: t.float() for path in sorted(smollm2_path.glob("*.safetensors"))
               for name, t in load_file(path).items()}
    return {"prompt": prompt, "prompt_ids": set(tokenizer(prompt)["input_ids"]), "eos": tokenizer.eos_token_id,
            "A": state_a}


async def answer(client, prompt: str, request_id: str, max_tokens: int = MAX_TOKENS, progress: dict | None = None):
    final = None
    async for output in client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id):
        final = output
        if progress is not None:
            progress[request_id] = len(output.outputs[0].token_ids) if output.outputs else 0
    return final


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def versions(pipeline, oracle):
    """Answers per state: {"A": ids, "B": ids}, and B's state dict; the pipeline starts on A."""
    first = await answer(pipeline, oracle["prompt"], "oracle-a")
    ids = list(first.outputs[0].token_ids)
    candidates = [t for t in dict.fromkeys(ids) if t not in oracle["prompt_ids"] and t != oracle["eos"]]
    assert len(candidates) >= 2, f"A's answer {ids} has fewer than two ids that are not in the prompt"
    i, j = candidates[:2]
    state_b = dict(oracle["A"])
    swapped = state_b["model.embed_tokens.weight"].clone()
    swapped[[i, j]] = swapped[[j, i]]
    state_b["model.embed_tokens.weight"] = swapped
    expected_b = [j if t == i else i if t == j else t for t in ids]
    sender = WeightSender("shm")
    await pipeline.init_weight_transfer_engine({})
    yield {"answers": {"A": ids, "B": expected_b}, "states": {"A": oracle["A"], "B": state_b}, "sender": sender,
           "on": ["A"], "next": [1], "labels": {"default": "A"}}
    sender.close()


def tokens_by_version(output) -> list[tuple[str, list[int]]]:
    """(version, tokens) per span of the final output (vLLM's spans; an aborted output without them
    has the one version its stage saw)."""
    completion = output.outputs[0]
    ids = list(completion.token_ids)
    if not ids:
        return []
    if completion.weight_versions:
        return [(span.version, ids[span.start:span.end]) for span in completion.weight_versions]
    seen = output.stage_versions[0]
    assert len(seen) == 1, f"an output without spans names several versions: {seen}"
    return [(seen[0], ids)]


async def push(pipeline, versions, to: str, mode: str) -> str:
    """Fenced push of state ``to``; returns the version label it got."""
    label = str(versions["next"][0])
    versions["next"][0] += 1
    await versions["sender"].push_async(pipeline, versions["states"][to], label, mode=mode)
    versions["on"][0] = to
    versions["labels"][label] = to
    return label


@pytest.mark.parametrize("mode", ["wait", "abort", "keep"])
async def test_row_swap_oracle_under_load(pipeline, oracle, versions, mode):
    """16 streams under way while the other state is pushed: every token is the answer of the version
    its span names; under wait/abort no request spans two versions, under keep some do; requests that
    arrive during the fence are all served by the new version."""
    old = versions["on"][0]
    new = "B" if old == "A" else "A"
    labels = versions["labels"]
    progress: dict[str, int] = {}
    load = [asyncio.create_task(answer(pipeline, oracle["prompt"], f"{mode}-load-{k}", progress=progress))
            for k in range(16)]
    async with asyncio.timeout(60):  # the streams are decoding (and far from done) when the fence starts
        while sum(1 for n in progress.values() if n >= 2) < 8:
            await asyncio.sleep(0.01)
    fence = asyncio.create_task(push(pipeline, versions, new, mode))
    while not await pipeline.is_paused():
        await asyncio.sleep(0.01)
    late = [asyncio.create_task(answer(pipeline, oracle["prompt"], f"{mode}-late-{k}")) for k in range(4)]
    new_label = await fence
    outputs = await asyncio.gather(*load)
    late_outputs = await asyncio.gather(*late)

    split = 0
    for output in outputs:
        parts = tokens_by_version(output)
        position = 0
        for label, tokens in parts:
            state = labels[label]
            expected = versions["answers"][state]
            if len(parts) == 1 or label != parts[-1][0]:
                # Tokens of a version from the start of the answer are that version's answer.
                assert tokens == expected[position:position + len(tokens)], (mode, label, parts)
            position += len(tokens)
        if len(parts) > 1:
            split += 1
            assert mode == "keep", f"under {mode} a request spans versions: {parts}"
            assert [labels[label] for label, _ in parts] == [old, new], parts
        if mode == "abort" and output.outputs[0].finish_reason == "abort":
            assert all(labels[label] == old for label, _ in parts)
    if mode == "keep":
        assert split > 0, "under keep no request went on across the update"
    for output in late_outputs:
        assert tokens_by_version(output) == [(new_label, versions["answers"][new])]
        assert output.stage_versions == {0: [new_label]}
    assert await pipeline.get_weight_version() == new_label
    assert not await pipeline.is_paused()


async def test_both_replicas_switch_and_a_bad_push_changes_nothing(pipeline, oracle, versions):
    on = versions["on"][0]
    label = await pipeline.get_weight_version()
    # Sequential requests rotate over the two replicas (ties are rotated): both answer the current version.
    before = [s.submitted for s in pipeline.replica_status(0)]
    for k in range(4):
        output = await answer(pipeline, oracle["prompt"], f"both-{k}")
        assert list(output.outputs[0].token_ids) == versions["answers"][on]
    after = [s.submitted for s in pipeline.replica_status(0)]
    assert all(b > a for a, b in zip(before, after)), (before, after)

    bad = dict(versions["states"]["B" if on == "A" else "A"])
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(7, 576)
    with pytest.raises(WeightUpdateError) as err:
        await versions["sender"].push_async(pipeline, bad, str(versions["next"][0]), mode="wait")
    message = str(err.value)
    assert "stage 0 replica 0" in message and "stage 0 replica 1" in message
    assert "'model.layers.0.mlp.up_proj.weight' has shape [7, 576], the model's is [1536, 576]" in message
    assert await pipeline.get_weight_version() == label
    assert not pipeline.weights.active and not await pipeline.is_paused()
    output = await answer(pipeline, oracle["prompt"], "after-bad")
    assert list(output.outputs[0].token_ids) == versions["answers"][on]

    # Replicas that disagree are named, each with its version; one label for all mends it.
    await pipeline.stage_contexts[0].client.replicas[1].call_utility_async("update_weight_version", "odd")
    with pytest.raises(WeightUpdateError, match=f"stage 0 replica 0: {label!r}, stage 0 replica 1: 'odd'"):
        await pipeline.get_weight_version()
    mended = str(versions["next"][0])
    versions["next"][0] += 1
    await pipeline.update_weight_version(mended)
    versions["labels"][mended] = on
    assert await pipeline.get_weight_version() == mended


async def expect_refused(pipeline, oracle, versions, coro, *fragments: str) -> None:
    with pytest.raises(WeightUpdateError) as err:
        await coro
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))
    assert not pipeline.weights.active
    output = await answer(pipeline, oracle["prompt"], f"refused-{id(err)}")
    assert list(output.outputs[0].token_ids) == versions["answers"][versions["on"][0]]


async def test_every_bad_input_is_refused_by_name_and_leaves_the_weights_serving(pipeline, oracle, versions):
    sender = versions["sender"]
    state = versions["states"][versions["on"][0]]
    label = await pipeline.get_weight_version()
    nxt = str(versions["next"][0])

    unknown = {**state, "model.bogus.weight": torch.zeros(3)}
    await expect_refused(pipeline, oracle, versions, sender.push_async(pipeline, unknown, nxt),
                         "unknown weight 'model.bogus.weight'", "stage 0 replica 0")
    half = {**state, "model.norm.weight": state["model.norm.weight"].half()}
    await expect_refused(pipeline, oracle, versions, sender.push_async(pipeline, half, nxt),
                         "'model.norm.weight' has dtype float16", "cast it before sending")
    incomplete = dict(list(state.items())[: len(state) // 2])
    await expect_refused(pipeline, oracle, versions, sender.push_async(pipeline, incomplete, nxt),
                         "the push is incomplete", "nothing was loaded")
    info = next(iter(sender.update_infos(state)))
    await expect_refused(pipeline, oracle, versions, pipeline.update_weights(info),
                         "update_weights without start_weight_update")
    await expect_refused(pipeline, oracle, versions, pipeline.finish_weight_update(nxt),
                         "finish_weight_update without start_weight_update")
    stale = str(int(label) - 1) if label.isdigit() else label
    await expect_refused(pipeline, oracle, versions, sender.push_async(pipeline, state, stale),
                         f"weight version {stale!r}")
    assert await pipeline.get_weight_version() == label


async def test_a_sender_that_vanishes_mid_update_changes_nothing(pipeline, oracle, versions):
    """zmq: the sender's socket is gone when the stages fetch (they fail within its timeout, the update
    is aborted); shm: the trainer stops calling (the update is abandoned after weights.idle_timeout_s,
    and the pipeline it paused resumes)."""
    label = await pipeline.get_weight_version()
    state = versions["states"][versions["on"][0]]
    gone = WeightSender("zmq", timeout_s=2.0)
    await pipeline.init_weight_transfer_engine(gone.init_info())
    infos = gone.update_infos(state)
    first = next(infos)
    gone.close()
    await pipeline.start_weight_update()
    await expect_refused(pipeline, oracle, versions, pipeline.update_weights(first),
                         "did not send chunk 0", "within 2 s", "stage 0 replica 1")

    await pipeline.pause_generation(mode="wait")
    await pipeline.start_weight_update()
    await pipeline.update_weights(next(iter(versions["sender"].update_infos(state))))
    assert pipeline.weights.active and await pipeline.is_paused()
    await asyncio.sleep(IDLE_TIMEOUT_S + 1.0)
    assert not pipeline.weights.active and not await pipeline.is_paused()
    assert await pipeline.get_weight_version() == label
    output = await answer(pipeline, oracle["prompt"], "after-vanish")
    assert list(output.outputs[0].token_ids) == versions["answers"][versions["on"][0]]


SENDER_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from safetensors.torch import load_file
    from omni_engine.weights.sender import WeightSender
    state = {k: v.float() for k, v in load_file(sys.argv[1]).items()}
    i, j = int(sys.argv[2]), int(sys.argv[3])
    w = state["model.embed_tokens.weight"]
    w[[i, j]] = w[[j, i]]
    with WeightSender("zmq", bind="tcp://127.0.0.1:0", curve=True, chunk_bytes=64 << 20) as sender:
        print(json.dumps(sender.init_info()), flush=True)
        for info in sender.update_infos(state):
            print(json.dumps(info), flush=True)
            sys.stdin.readline()  # the stages have the chunk
        print(json.dumps({"fetches": sender._server.fetches}), flush=True)
""")


async def test_zmq_push_from_another_process_over_tcp_with_curve(pipeline, oracle, versions, smollm2_path):
    """A trainer process serves the push over tcp + CURVE in 64 MiB chunks; both replicas fetch each
    chunk; a peer without the handed-out key gets nothing."""
    from omni_engine.stage_engine.security import KeyPair
    from omni_engine.weights.zmq_transport import ChunkFetcher

    a, b = versions["answers"]["A"], versions["answers"]["B"]
    i, j = next((x, y) for x, y in zip(a, b) if x != y)
    checkpoint = sorted(smollm2_path.glob("*.safetensors"))[0]
    # The script swaps rows i, j of the checkpoint: it pushes B.
    proc = subprocess.Popen([sys.executable, "-c", SENDER_SCRIPT, str(checkpoint), str(i), str(j)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        init_info = json.loads(proc.stdout.readline())
        assert init_info["address"].startswith("tcp://") and init_info["server_public_key"]
        await pipeline.init_weight_transfer_engine(init_info)
        stranger = KeyPair.generate()
        intruder = ChunkFetcher(init_info["address"], init_info["server_public_key"], 1.0,
                                stranger.public.decode(), stranger.secret.decode())
        label = str(versions["next"][0])
        versions["next"][0] += 1
        async with pipeline.weight_update(label, mode="wait"):
            chunks = 0
            while True:
                line = json.loads(proc.stdout.readline())
                if "fetches" in line:
                    break
                if chunks == 0:
                    with pytest.raises(ValueError, match="did not send chunk 0"):
                        await asyncio.to_thread(intruder.fetch, line["push_id"], 0)
                await pipeline.update_weights(line)
                chunks += 1
                proc.stdin.write("\n")
                proc.stdin.flush()
        intruder.close()
        # Two replicas and the pipeline's own store fetch every chunk.
        assert chunks >= 8 and line["fetches"] == 3 * chunks
    finally:
        proc.kill()
        proc.wait()
    versions["on"][0] = "B"
    versions["labels"][label] = "B"
    output = await answer(pipeline, oracle["prompt"], "after-zmq")
    assert list(output.outputs[0].token_ids) == versions["answers"]["B"]
    assert output.stage_versions == {0: [label]}


def engine_core_of(stage_pid: int) -> int:
    """The pid of vLLM's EngineCore under a stage process (it titles itself ``VLLM::EngineCore``)."""
    import psutil

    cores = [p.pid for p in psutil.Process(stage_pid).children(recursive=True) if "EngineCor" in p.name()]
    assert len(cores) == 1, f"stage pid {stage_pid} has EngineCores {cores}"
    return cores[0]


async def test_a_replica_whose_engine_core_is_killed_comes_back_on_the_current_weights(pipeline, oracle, versions):
    """Replica 1's EngineCore is killed (as the OOM killer does) while a utility call waits on it and no
    request is in flight (an update_weights fetching a chunk its sender never serves): the call fails at
    once naming the EngineCore and its signal, the stage ends with DEAD, and the warm spare takes its
    place on the current weights."""
    from omni_engine.errors import StageDeadError

    on = versions["on"][0]
    if on == "A":  # make the current weights differ from what a fresh process loads
        await push(pipeline, versions, "B", "wait")
        on = "B"
    label = await pipeline.get_weight_version()
    victim = pipeline.replica_status(0)[1]
    spare = pipeline.supervisor.spares[0].process.pid
    replica = pipeline.stage_contexts[0].client.replicas[1]
    silent = WeightSender("zmq", timeout_s=120.0)  # replica 1 alone: the pipeline's own transfer is untouched
    await replica.call_utility_async("init_weight_transfer_engine", silent.init_info())
    first = next(iter(silent.update_infos(versions["states"][on])))
    silent.close()
    await replica.call_utility_async("start_weight_update")
    update = asyncio.create_task(replica.call_utility_async("update_weights", first))
    await asyncio.sleep(1.0)
    assert not update.done(), "update_weights returned though its sender serves nothing"
    os.kill(engine_core_of(victim.pid), signal.SIGKILL)
    async with asyncio.timeout(30):  # without the stage's watch on its EngineCore: 120 s, then a fetch error
        with pytest.raises(StageDeadError, match=r"EngineCore \(pid \d+\) was killed by SIGKILL"):
            await update
    for _ in range(600):
        status = pipeline.replica_status(0)[1]
        if status.alive and status.pid not in (None, victim.pid):
            break
        await asyncio.sleep(0.2)
    else:
        pytest.fail("replica 1 was not restarted")
    assert pipeline.stage_restarts()[0] >= 1
    # The spare (the first replica's spec) became replica 1, and was put on the current weights too.
    assert status.pid == spare
    assert await pipeline.get_weight_version() == label
    before = pipeline.replica_status(0)[1].submitted
    for k in range(4):
        output = await answer(pipeline, oracle["prompt"], f"restored-{k}")
        assert list(output.outputs[0].token_ids) == versions["answers"][on]
        assert output.stage_versions == {0: [label]}
    assert pipeline.replica_status(0)[1].submitted > before
