"""Two-model mixing across stages (the seed's optimal sampling) with real SmolLM2 stages: a
teacher whose rows become log q ∝ (1-α)·log π_θ + α·log π_t, and a theta stage scoring each
request's own prompt plus the tokens so far. Checked against an independent reference
(``transformers``, float32, each request alone, full vocabulary), the α of ``kl_symmetry``
against a direct numeric solution, per-request theta prompts (the seed's Bug 2), and the α
history under aborts."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal

import numpy as np
import pytest
import pytest_asyncio
import torch
import yaml
from vllm import SamplingParams

from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.logits.mixing import replica_for

pytestmark = [pytest.mark.llm, pytest.mark.asyncio(loop_scope="module")]

QUESTIONS = ["What is 7 times 6?", "Name the capital of France.", "What colour is the sky?", "How many legs has a cat?",
             "What is 12 minus 5?", "Spell the word dog.", "What is the opposite of hot?", "Which animal barks?"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mixing(tmp_path_factory, smollm2_path):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("mixing")
    config = yaml.safe_load(open("stage_configs/smollm2_mixing.yaml"))
    for stage in config["stage_args"]:
        stage["runtime"]["max_batch_size"] = 4  # few rows: reused and moved
        stage["engine_args"].update(model=str(smollm2_path), max_model_len=512)
    config["stage_args"][1]["runtime"]["num_replicas"] = 2  # a request's steps stay on one
    config["stage_args"][0]["mixing"].update(alpha_history=str(tmp / "alpha.jsonl"), record_rows=str(tmp / "rows"),
                                             theta_timeout_s=10)
    path = tmp / "mixing.yaml"
    path.write_text(yaml.safe_dump(config))
    client = await MultiStageEngineClient.from_config(path)
    yield {"client": client, "history": tmp / "alpha.jsonl", "rows": tmp / "rows",
           "tokenizer": AutoTokenizer.from_pretrained(smollm2_path), "model_path": smollm2_path}
    await client.shutdown_async()


def chat_ids(tokenizer, content: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def teacher_ids(tokenizer, question: str) -> list[int]:
    """The teacher sees the reference answer; theta sees the question alone (the seed's case)."""
    return chat_ids(tokenizer, f"{question} (Reference answer: keep it short and exact.)")


async def ask(client, tokenizer, rid: str, question: str, max_tokens: int, **xargs) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args={"theta_prompt": question, **xargs})
    tokens: list[int] = []
    async for out in client.generate({"prompt_token_ids": teacher_ids(tokenizer, question)}, params, rid):
        tokens = list(out.outputs[0].token_ids)
    return tokens


def history(mixing) -> dict[str, dict]:
    lines = [json.loads(line) for line in mixing["history"].read_text().splitlines()] if mixing["history"].exists() else []
    return {line["request_id"]: line for line in lines}


async def history_of(mixing, rids: list[str]) -> dict[str, dict]:
    """The history lines of ``rids``. A request's line is written when vLLM next updates
    its batch after the request's end, which the caller may see first: wait, bounded."""
    async def read() -> dict[str, dict]:
        return history(mixing)

    lines = await settled(read, lambda lines: all(rid in lines for rid in rids))
    assert all(rid in lines for rid in rids), f"no history line for {[r for r in rids if r not in lines]}"
    return lines


def recorded(mixing, rid: str, step: int) -> dict[str, np.ndarray]:
    with np.load(mixing["rows"] / f"{rid}.step{step}.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module")
def reference_model(mixing):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(mixing["model_path"], torch_dtype=torch.float32).eval()


async def settled(read, done, timeout: float = 30.0):
    """``read()`` until ``done(value)`` or ``timeout`` s; the last value (asserted by the caller)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done(value := await read()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    return value


def root(f, lo: float = 0.0, hi: float = 1.0) -> float:
    """The root of ``f`` on [lo, hi] (a sign change), by float64 bisection to 1e-12."""
    f_lo = f(lo)
    while hi - lo > 1e-12:
        mid = (lo + hi) / 2
        f_mid = f(mid)
        if (f_mid > 0) == (f_lo > 0):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return (lo + hi) / 2


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    return torch.log_softmax(logits, dim=-1)


async def test_fixed_alpha_mixing_matches_an_independent_reference(mixing, reference_model):
    client, tok = mixing["client"], mixing["tokenizer"]
    alpha, n = 0.3, 10
    rids = [f"fixed-{i}" for i in range(3)]
    outs = await asyncio.gather(*(ask(client, tok, rid, QUESTIONS[i], n, mixing_alpha="fixed", mixing_alpha_value=alpha,
                                      mixing_record=1) for i, rid in enumerate(rids)))
    worst = 0.0
    compared = 0
    for i, (rid, tokens) in enumerate(zip(rids, outs)):
        assert tokens, rid
        teacher, theta = teacher_ids(tok, QUESTIONS[i]), chat_ids(tok, QUESTIONS[i])
        for k, token in enumerate(tokens):
            ref_t = reference_logprobs(reference_model, teacher + tokens[:k])
            ref_theta = reference_logprobs(reference_model, theta + tokens[:k])
            ref_q = torch.log_softmax((1 - alpha) * ref_theta + alpha * ref_t, dim=-1)
            rec = recorded(mixing, rid, k)
            assert rec["alpha"] == pytest.approx(alpha)
            # Over the whole vocabulary (measured: 7.6e-5 at most, far tail included).
            worst = max(worst, float((torch.from_numpy(rec["log_q"]).double() - ref_q).abs().max()))
            top2 = torch.topk(ref_q, 2).values
            if float(top2[0] - top2[1]) > 1e-3:
                assert token == int(ref_q.argmax()), f"{rid} step {k}: chose {token}, reference {int(ref_q.argmax())}"
                compared += 1
        line = (await history_of(mixing, [rid]))[rid]
        assert line["steps"] == len(tokens) and all(a == pytest.approx(alpha) for a in line["alpha"])
    assert compared >= 20
    assert worst <= 2e-3, f"max |Δ log q| {worst:.2e}"


async def test_kl_symmetry_alpha_solves_the_kl_equation_on_recorded_rows(mixing):
    client, tok = mixing["client"], mixing["tokenizer"]
    rids = ["kl-0", "kl-1"]
    outs = await asyncio.gather(*(ask(client, tok, rid, QUESTIONS[i + 3], 8, mixing_alpha="kl_symmetry", mixing_record=1)
                                  for i, rid in enumerate(rids)))
    inside = 0
    for rid, tokens in zip(rids, outs):
        for k in range(len(tokens)):
            rec = recorded(mixing, rid, k)
            a, b = rec["log_theta"].astype(np.float64), rec["log_teacher"].astype(np.float64)

            def kl_gap(alpha: float) -> float:
                z = (1 - alpha) * a + alpha * b
                log_q = z - np.logaddexp.reduce(z)
                q = np.exp(log_q)
                return float(np.sum(q * (log_q - a)) - np.sum(q * (log_q - b)))  # KL(q‖π_θ) - KL(q‖π_t)

            if kl_gap(0.0) * kl_gap(1.0) > 0:  # identical rows: every α solves it
                continue
            solution = root(kl_gap)
            assert abs(float(rec["alpha"]) - solution) <= 1e-4, (rid, k, float(rec["alpha"]), solution)
            inside += 0.01 < solution < 0.99
        assert (await history_of(mixing, [rid]))[rid]["alpha_method"] == "kl_symmetry"
    assert inside >= 8  # the equation had real solutions to check, not the edges


async def test_each_request_scores_theta_with_its_own_prompt(mixing):
    """The seed's Bug 2: every request read the first problem's prompt from a shared list."""
    client, tok = mixing["client"], mixing["tokenizer"]
    rids = [f"own-{i}" for i in range(8)]
    await asyncio.gather(*(ask(client, tok, rid, QUESTIONS[i], 6) for i, rid in enumerate(rids)))
    lines = await history_of(mixing, rids)
    for i, rid in enumerate(rids):
        assert lines[rid]["theta_prompt_token_ids"] == chat_ids(tok, QUESTIONS[i]), rid


def replica_of(rid: str, replicas: int = 2) -> int:
    """The teacher's choice of theta replica for a request (a hash of its id)."""
    return replica_for(rid, replicas)


async def test_each_request_stays_on_one_theta_replica_with_its_own_prompt(mixing):
    client, tok = mixing["client"], mixing["tokenizer"]
    rids = [f"split-{i}" for i in range(4)]
    assert {replica_of(rid) for rid in rids} == {0, 1}  # these ids use both replicas
    first = {rid: asyncio.Event() for rid in rids}

    async def one(i: int, rid: str) -> None:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, extra_args={"theta_prompt": QUESTIONS[i]})
        async for _ in client.generate({"prompt_token_ids": teacher_ids(tok, QUESTIONS[i])}, params, rid):
            first[rid].set()

    tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(rids)]
    await asyncio.gather(*(e.wait() for e in first.values()))
    held = await client.stage_contexts[1].client.call_each_replica_async("theta_requests")
    await asyncio.gather(*tasks)
    for i, rid in enumerate(rids):
        holders = [r for r, sessions in held.items() if rid in sessions]
        assert holders == [replica_of(rid)], (rid, holders)
        prompt = chat_ids(tok, QUESTIONS[i])
        assert held[holders[0]][rid][:len(prompt)] == prompt  # its own prompt, then its tokens


async def test_theta_runs_each_step_of_a_batch_as_one_forward_pass(mixing):
    """A step's chunks reach theta's engine core one by one (one input task per session); an
    idle engine core would start on the first and run the rest as a second pass. Held until
    the whole batch is in, every step of 4 requests on one replica is one forward pass."""
    client, tok = mixing["client"], mixing["tokenizer"]
    rids = [rid for rid in (f"together-{i}" for i in range(64)) if replica_of(rid) == 0][:4]

    async def one(i: int, rid: str) -> None:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                extra_args={"theta_prompt": QUESTIONS[i]})
        async for _ in client.generate({"prompt_token_ids": teacher_ids(tok, QUESTIONS[i])}, params, rid):
            pass

    await asyncio.gather(*(one(i, rid) for i, rid in enumerate(rids)))
    lines = await history_of(mixing, rids)
    assert all(lines[rid]["steps"] == 12 for rid in rids), {rid: lines[rid]["steps"] for rid in rids}
    assert {rid: lines[rid]["theta_split_steps"] for rid in rids} == dict.fromkeys(rids, 0)


async def test_alpha_history_has_one_line_per_request_and_aborts_release_theta(mixing):
    client, tok = mixing["client"], mixing["tokenizer"]
    rng = random.Random(5)
    rids = [f"hist-{i}" for i in range(24)]
    aborted = set(rids[1::4])
    started = {rid: asyncio.Event() for rid in aborted}

    async def one(i: int, rid: str) -> None:
        await asyncio.sleep(rng.uniform(0, 0.6))
        params = SamplingParams(max_tokens=rng.randint(4, 24), temperature=0.0, ignore_eos=True,
                                extra_args={"theta_prompt": QUESTIONS[i % 8]})
        async for _ in client.generate({"prompt_token_ids": teacher_ids(tok, QUESTIONS[i % 8])}, params, rid):
            if rid in started:
                started[rid].set()

    tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(rids)]
    await asyncio.gather(*(e.wait() for e in started.values()))
    await client.abort(sorted(aborted))
    await asyncio.gather(*tasks)
    # A request's line is written when vLLM next updates the batch after its end (the
    # caller may see the end first): wait for the lines, bounded. The lines of the tests
    # before this one can land during it for the same reason, so they are told apart by id
    # rather than by their place in the file.
    async def new_lines() -> list[dict]:
        text = mixing["history"].read_text().splitlines() if mixing["history"].exists() else []
        return [line for line in map(json.loads, text) if line["request_id"].startswith("hist-")]

    async def theta_holds() -> dict:
        return await client.stage_contexts[1].client.call_each_replica_async("theta_requests")

    new = await settled(new_lines, lambda lines: len(lines) >= len(rids))
    assert sorted(line["request_id"] for line in new) == sorted(rids)  # 24 lines, one per request, none lost
    assert all(line["steps"] == len(line["alpha"]) > 0 for line in new)
    # Released on every way out, aborts included: theta holds no request's tokens.
    assert await settled(theta_holds, lambda held: not any(held.values())) == {0: {}, 1: {}}


async def test_a_keep_pause_freezes_mixing_requests_and_resume_finishes_them(mixing):
    """vLLM's ``pause_generation(mode="keep")`` (what ``POST /pause?mode=keep`` runs, cache cleared) on
    a mixing pipeline: the teachers stop between steps and theta, idle without them, is left alone
    (paused itself, it refused to clear a cache its sessions hold, and its scorer would resume it)."""
    client, tok = mixing["client"], mixing["tokenizer"]
    progress: dict[str, int] = {}
    first = {f"keep-{i}": asyncio.Event() for i in range(4)}

    async def one(i: int, rid: str) -> tuple[int, str]:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                extra_args={"theta_prompt": QUESTIONS[i]})
        async for out in client.generate({"prompt_token_ids": teacher_ids(tok, QUESTIONS[i])}, params, rid):
            progress[rid] = len(out.outputs[0].token_ids)
            first[rid].set()
        return progress[rid], out.outputs[0].finish_reason

    tasks = [asyncio.create_task(one(i, rid)) for i, rid in enumerate(first)]
    for _ in range(3):  # three pauses in one run: each lands on a different step
        await asyncio.gather(*(e.wait() for e in first.values()))
        await asyncio.wait_for(client.pause_generation(mode="keep"), 30)
        assert await client.is_paused()
        # The last step's outputs may still be on their way when the pause answers (they take
        # another path): one token at most, then nothing moves.
        paused = dict(progress)
        await asyncio.sleep(1.0)
        frozen = dict(progress)
        assert all(frozen[rid] - paused[rid] <= 1 for rid in first), (paused, frozen)
        await asyncio.sleep(0.5)
        assert progress == frozen and not any(t.done() for t in tasks)
        await client.resume_generation()
        for rid in first:
            first[rid].clear()
    assert await asyncio.wait_for(asyncio.gather(*tasks), 60) == [(40, "length")] * 4
    assert not await client.is_paused()


async def test_a_request_without_a_theta_prompt_is_refused_naming_it(mixing):
    client, tok = mixing["client"], mixing["tokenizer"]
    with pytest.raises(Exception, match="theta_prompt") as info:
        async for _ in client.generate({"prompt_token_ids": teacher_ids(tok, "Hi")}, SamplingParams(max_tokens=2),
                                       "no-theta"):
            pass
    assert "no-theta" in str(info.value) or "theta_prompt" in str(info.value)
    # The pipeline serves on.
    assert await ask(client, tok, "after-refusal", QUESTIONS[0], 3)


async def test_when_theta_dies_the_teacher_decodes_alone_and_says_so(mixing):
    """Last in the module: it kills a theta replica."""
    client, tok = mixing["client"], mixing["tokenizer"]
    victim = replica_of("theta-dies")
    later = next(f"after-theta-{i}" for i in range(100) if replica_of(f"after-theta-{i}") == victim)
    tokens: list[int] = []
    first = asyncio.Event()

    async def long_request() -> None:
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, extra_args={"theta_prompt": QUESTIONS[0]})
        async for out in client.generate({"prompt_token_ids": teacher_ids(tok, QUESTIONS[0])}, params, "theta-dies"):
            tokens[:] = out.outputs[0].token_ids
            first.set()

    task = asyncio.create_task(long_request())
    await first.wait()
    os.kill(client.stage_contexts[1].client.replicas[victim].process.pid, signal.SIGKILL)
    async with asyncio.timeout(120):
        await task
        # A request that starts after its replica is gone is not held up by it at all.
        assert len(await ask(client, tok, later, QUESTIONS[1], 5)) == 5
    assert len(tokens) == 30

    async def lines() -> dict:
        return history(mixing)

    done = await settled(lines, lambda h: "theta-dies" in h and later in h)
    died, after = done["theta-dies"], done[later]
    assert died["errors"] and f"theta replica {victim}" in died["errors"][0] and died["alpha"][-1] == 1.0
    assert all(a == 1.0 for a in after["alpha"]) and "not answering" in after["errors"][0]
    assert after["theta_wait_s"] < 5  # no timeout waited for a replica known to be gone
