"""Request-keyed logits processors without an engine: the slot table under vLLM's V1
batch updates, the same processor class driven through Model Runner V2's interface
(its loader, its params validator, its ``add_request`` / ``apply(logits, ctx)`` with rows
reordered every step and slots recycled without notice), and config-time checks of
``engine_args.logits_processors``. V2 cannot run on these CPUs (it needs Triton's CPU
backend), so its runner's slot and row bookkeeping is replayed here step by step."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns
from vllm.v1.sample.logits_processor.interface import BatchUpdate, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor import (
    LogitsContext,
    build_custom_logits_processors,
    build_custom_logits_processors_params_validator,
)
from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcessor as V2LogitsProcessor

from omni_engine.config import ConfigError, load_pipeline_config
from omni_engine.logits import REQUEST_ID_KEY, LiveRequest, SlotTable, tag_request
from tests.logits_processors import Fingerprint, fingerprint_token

FINGERPRINT = "tests.logits_processors:Fingerprint"
VOCAB = 64  # fingerprint tokens are in [1000, 21000): the V2 replay uses a big enough vocab below


def params(rid: str, mode: str | None = "request") -> SamplingParams:
    p = SamplingParams(max_tokens=8, extra_args={"fingerprint": mode} if mode else None)
    return tag_request(p, rid)


# ------------------------------------------------------------ the slot table (V1 updates)
def test_slot_table_applies_removed_added_moved_in_vllms_order():
    released: list[str] = []
    table = SlotTable(release=lambda r: released.append(r.request_id))

    def admit(row, p, prompt, output):
        return LiveRequest(p.extra_args[REQUEST_ID_KEY], p, prompt, output, state=True)

    def update(removed=(), added=(), moved=()):
        table.apply_batch_update(BatchUpdate(batch_size=0, removed=list(removed), moved=list(moved),
                                             added=[(i, params(rid), [1], []) for i, rid in added]), admit)

    def rows():
        return {row: r.request_id for row, r in table.items()}

    update(added=[(0, "a"), (1, "b"), (2, "c")])
    assert rows() == {0: "a", 1: "b", 2: "c"}
    # "a" finished and "d" took its row in the same step: vLLM reports row 0 only as added.
    update(added=[(0, "d")])
    assert rows() == {0: "d", 1: "b", 2: "c"} and released == ["a"]
    # "b" finished, nothing new: condense moves the last row (2) into the hole (1).
    update(removed=[1], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    assert rows() == {0: "d", 1: "c"} and released == ["a", "b"]
    # An attention backend's reorder swaps rows.
    update(moved=[(0, 1, MoveDirectionality.SWAP)])
    assert rows() == {0: "c", 1: "d"}
    # Removed then re-added in one update: the old holder is released once, the new one stays.
    update(removed=[0], added=[(0, "e")])
    assert rows() == {0: "e", 1: "d"} and released == ["a", "b", "c"]
    assert table.stats.as_dict() == dict(admitted=5, released=3, reused=2, moved=1, swapped=1)


def test_tag_request_copies_the_params_it_tags():
    shared = SamplingParams(max_tokens=4, extra_args={"theta_prompt": "x"})
    a, b = tag_request(shared, "a"), tag_request(shared, "b")
    assert (a.extra_args[REQUEST_ID_KEY], b.extra_args[REQUEST_ID_KEY]) == ("a", "b")
    assert shared.extra_args == {"theta_prompt": "x"} and a.extra_args["theta_prompt"] == "x"


# ------------------------------------------------------------ Model Runner V2, replayed
class V2SlotRowFingerprint(V2LogitsProcessor):
    """The seed's assumption on V2: the logits row of a request is its slot index."""

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        self.req_states, self.rids = req_states, {}

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        self.rids[req_idx] = sampling_params.extra_args[REQUEST_ID_KEY]
        return True

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        for slot, rid in self.rids.items():
            if slot < logits.shape[0]:
                n = int(self.req_states.total_len.np[slot] - self.req_states.prompt_len.np[slot])
                logits[slot] = float("-inf")
                logits[slot, fingerprint_token(rid, n)] = 0.0
        return logits


def replay_v2(processor_names: list[Any], seed: int, max_num_reqs: int = 4, n_requests: int = 24) -> dict[str, Any]:
    """Run a V2-shaped schedule: slots from a free list (no removal notice), rows in a new
    order every step, committed tokens in the runner's buffer. Returns mismatches and counts."""
    rng = random.Random(seed)
    vocab, max_len = 21000, 64
    states = SimpleNamespace(
        device=torch.device("cpu"), max_num_reqs=max_num_reqs, vocab_size=vocab,
        all_token_ids=SimpleNamespace(gpu=torch.zeros(max_num_reqs, max_len, dtype=torch.int32)),
        prompt_len=SimpleNamespace(np=np.zeros(max_num_reqs, dtype=np.int32)),
        prefill_len=SimpleNamespace(np=np.zeros(max_num_reqs, dtype=np.int32)),
        total_len=SimpleNamespace(np=np.zeros(max_num_reqs, dtype=np.int32)))
    procs = build_custom_logits_processors(SimpleNamespace(), states, False, processor_names)
    waiting = [(f"r{seed}-{i}", rng.randint(3, 6), rng.randint(1, 20)) for i in range(n_requests)]
    free, live = list(range(max_num_reqs)), {}  # slot -> [rid, max_tokens, generated]
    mismatches = steps = reused = 0
    used: set[int] = set()
    while waiting or live:
        while waiting and free and rng.random() < 0.7:
            rid, prompt_len, max_tokens = waiting.pop(0)
            slot = free.pop(rng.randrange(len(free)))
            reused += slot in used
            used.add(slot)
            states.all_token_ids.gpu[slot, :prompt_len] = torch.arange(prompt_len) + 1
            states.prompt_len.np[slot] = prompt_len
            states.total_len.np[slot] = prompt_len
            for p in procs:
                p.add_request(slot, tag_request(SamplingParams(max_tokens=max_tokens,
                                                               extra_args={"fingerprint": "request"}), rid))
            live[slot] = [rid, max_tokens, 0]
        if not live:
            continue
        for p in procs:
            p.apply_staged_writes()
        order = list(live)
        rng.shuffle(order)  # V2 lays rows out anew every step
        ctx = LogitsContext(
            expanded_idx_mapping=torch.tensor(order), idx_mapping=torch.tensor(order),
            idx_mapping_np=np.array(order), expanded_local_pos=torch.zeros(len(order), dtype=torch.int32),
            input_ids=torch.zeros(len(order), dtype=torch.int32), pos=torch.zeros(len(order), dtype=torch.int32),
            seq_lens_upper_bound_np=np.array([states.total_len.np[s] for s in order]))
        logits = torch.randn(len(order), vocab)
        for p in procs:
            logits = p.apply(logits, ctx)
        steps += 1
        for row, slot in enumerate(order):
            rid, max_tokens, n = live[slot]
            token = int(logits[row].argmax())
            mismatches += token != fingerprint_token(rid, n)
            states.all_token_ids.gpu[slot, states.total_len.np[slot]] = token
            states.total_len.np[slot] += 1
            live[slot][2] += 1
            if live[slot][2] == max_tokens:  # finished: the slot goes back, the processor is not told
                del live[slot]
                free.append(slot)
    return dict(mismatches=mismatches, steps=steps, reused=reused, processors=procs)


def test_the_same_class_runs_on_model_runner_v2_with_rows_reordered_and_slots_recycled():
    for seed in (1, 2, 3):
        run = replay_v2([FINGERPRINT], seed)
        assert run["reused"] >= 15 and run["steps"] > 30, run
        assert run["mismatches"] == 0, f"seed {seed}: {run['mismatches']} rows forced for another request"
        (proc,) = run["processors"]
        assert isinstance(proc, Fingerprint) and proc.runner == "v2"


def test_v2_tokens_are_read_from_the_runners_buffer():
    run = replay_v2([FINGERPRINT], 7, n_requests=3)
    (proc,) = run["processors"]
    # The last holder of each used slot is still held (V2 gives no removal notice).
    for slot, request in proc.table.items():
        generated = list(request.output_token_ids)
        assert generated == [fingerprint_token(request.request_id, k) for k in range(len(generated))]
        assert list(request.prompt_token_ids) == list(range(1, len(request.prompt_token_ids) + 1))


def test_on_v2_the_slot_index_as_row_lookup_forces_other_requests_tokens():
    assert replay_v2([V2SlotRowFingerprint], 1)["mismatches"] > 0


def test_both_runners_loaders_and_validators_accept_the_class():
    assert _load_logitsprocs_by_fqcns([FINGERPRINT]) == [Fingerprint]
    validate = build_custom_logits_processors_params_validator([FINGERPRINT])
    validate(SamplingParams(extra_args={"fingerprint": "request"}))
    with pytest.raises((VLLMValidationError, ValueError), match="vllm_xargs.fingerprint"):
        validate(SamplingParams(extra_args={"fingerprint": "bogus"}))


# ------------------------------------------------------------ config-time checks
def stage_with(tmp_path, processors: Any) -> list[str]:
    config = {"stage_args": [{"stage_id": 0, "stage_type": "llm", "final_output": True, "final_output_type": "text",
                              "engine_args": {"model": "/some/model", "logits_processors": processors}}]}
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    for err in info.value.errors:
        assert err.startswith(f"{path}: stage 0: stage_args[0].engine_args.logits_processors"), err
    return info.value.errors


@pytest.mark.parametrize("processors, needle", [
    (["no_such_pkg.mod:Thing"], "cannot import module 'no_such_pkg.mod'"),
    (["tests.logits_processors:NoSuchClass"], "has no 'NoSuchClass'"),
    (["tests.logits_processors:fingerprint_token"], "is not a vLLM logits processor class"),
    (["tests.logits_processors.Fingerprint"], "is not of the form 'pkg.module:Class'"),
    ("tests.logits_processors:Fingerprint", "expected a list"),
])
def test_a_bad_processor_name_is_refused_at_config_load(tmp_path, processors, needle):
    (error,) = stage_with(tmp_path, processors)
    assert needle in error


def test_good_processor_names_load(tmp_path):
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump({"stage_args": [{
        "stage_id": 0, "stage_type": "llm", "final_output": True, "final_output_type": "text",
        "engine_args": {"model": "/some/model", "logits_processors": [
            FINGERPRINT, "tests.logits_processors:SeedSlotFingerprint"]}}]}))
    assert load_pipeline_config(path).stage_args[0].engine_args["logits_processors"][0] == FINGERPRINT


# ------------------------------------------------------------ mixing config
def mixing_config(tmp_path, mixing: dict, theta: dict | None = None) -> list[str]:
    stages = [{"stage_id": 0, "stage_type": "llm", "final_output": True, "final_output_type": "text",
               "engine_args": {"model": "/some/model"}, "mixing": mixing},
              theta or {"stage_id": 1, "stage_type": "llm", "engine_args": {"model": "/some/model"}}]
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"stage_args": stages}))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    return info.value.errors


@pytest.mark.parametrize("mixing, theta, needle", [
    ({"theta_stage": 5, "alpha": "kl_symmetry"}, None, "stage_args[0].mixing.theta_stage: stage 5 does not exist"),
    ({"theta_stage": 0, "alpha": "kl_symmetry"}, None, "cannot mix in its own distribution"),
    ({"theta_stage": 1, "alpha": "kl_symmetry"},
     {"stage_id": 1, "stage_type": "generation", "engine_args": {"model_factory": "omni_engine.engines.tts:make_espeak_tts"}},
     "stage 1 is a 'generation' stage; theta must be an llm stage"),
    ({"theta_stage": 1, "alpha": "fixed", "alpha_value": 1.5}, None, "mixing.alpha_value: 1.5 is outside [0, 1]"),
    ({"theta_stage": 1, "alpha": "fixed"}, None, "alpha: fixed needs a value in [0, 1]"),
    ({"theta_stage": 1, "alpha": "median"}, None, "unknown alpha method 'median'"),
])
def test_a_bad_mixing_section_is_refused_at_config_load(tmp_path, mixing, theta, needle):
    errors = mixing_config(tmp_path, mixing, theta)
    assert len(errors) == 1 and needle in errors[0] and "stage 0" in errors[0], errors


def test_mixing_wires_teacher_and_theta():
    from omni_engine.logits.mixing_wiring import CAPTURE_PROCESSOR, MIXING_KEY, MIXING_PROCESSOR, THETA_KEY
    from omni_engine.pipeline.stage_specs import build_stage_specs

    config = load_pipeline_config("stage_configs/smollm2_mixing.yaml")
    specs = build_stage_specs(config)
    teacher, theta = specs[0][0].engine_args, specs[1][0].engine_args
    assert MIXING_PROCESSOR in teacher["logits_processors"]
    assert teacher["additional_config"][MIXING_KEY]["theta"] == [theta[THETA_KEY]["address"]]
    assert CAPTURE_PROCESSOR in theta["logits_processors"] and theta["enable_chunked_prefill"] is False


def test_mixing_stages_get_the_short_openmp_spin_unless_their_env_sets_it():
    from omni_engine.logits.mixing_wiring import MIXING_STAGE_ENV
    from omni_engine.pipeline.stage_specs import build_stage_specs

    config = load_pipeline_config("stage_configs/smollm2_mixing.yaml")
    specs = build_stage_specs(config)
    assert specs[0][0].env == specs[1][0].env == MIXING_STAGE_ENV
    theta = config.stage(1)
    own = config.replace(stage_args=[config.stage(0), theta.replace(env={"GOMP_SPINCOUNT": "7", "X": "1"})])
    specs = build_stage_specs(own)
    assert specs[1][0].env == {"GOMP_SPINCOUNT": "7", "X": "1"} and specs[0][0].env == MIXING_STAGE_ENV
    alone = config.replace(stage_args=[config.stage(0).replace(mixing=None)])
    assert "GOMP_SPINCOUNT" not in build_stage_specs(alone)[0][0].env


@pytest.mark.parametrize("xargs, needle", [
    ({}, "needs its theta prompt"),
    ({"theta_prompt": "q", "mixing_alpha": "median"}, "mixing_alpha must be one of"),
    ({"theta_prompt": "q", "mixing_alpha": "fixed"}, "needs vllm_xargs.mixing_alpha_value"),
    ({"theta_prompt": "q", "mixing_alpha_value": 2}, "must be a number in [0, 1]"),
    ({"theta_messages": "[not json"}, "theta_messages is not valid JSON"),
    ({"theta_messages": "[1, 2]"}, "must be a JSON list of chat messages"),
])
def test_mixing_requests_are_validated_in_the_frontend(xargs, needle):
    from omni_engine.logits.mixing_wiring import MIXING_PROCESSOR

    validate = build_custom_logits_processors_params_validator([MIXING_PROCESSOR])
    validate(SamplingParams(extra_args={"theta_prompt": "What is 2+2?"}))
    with pytest.raises((VLLMValidationError, ValueError)) as info:
        validate(SamplingParams(extra_args=xargs))
    assert needle in str(info.value)


def test_kl_symmetry_alpha_balances_the_two_kls():
    from omni_engine.logits.alpha import kl_symmetry_alpha, mix

    gen = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(5, 300, generator=gen, dtype=torch.float64) * 3, -1)
    b = torch.log_softmax(torch.randn(5, 300, generator=gen, dtype=torch.float64) * 3, -1)
    alpha = kl_symmetry_alpha(a, b)
    log_q = mix(a, b, alpha)
    q = log_q.exp()
    gap = (q * (log_q - a)).sum(-1) - (q * (log_q - b)).sum(-1)
    assert gap.abs().max() < 1e-6 and ((alpha > 0) & (alpha < 1)).all()


def _bisected_root(log_theta: torch.Tensor, log_teacher: torch.Tensor) -> torch.Tensor:
    """E_q[log π_t - log π_θ] = 0 by plain float64 bisection to 1e-12: the reference."""
    d = (log_teacher - log_theta).double()
    lo, hi = torch.zeros(len(d), dtype=torch.float64), torch.ones(len(d), dtype=torch.float64)
    for _ in range(45):
        mid = (lo + hi) / 2
        above = (torch.softmax(log_theta.double() + mid[:, None] * d, -1) * d).sum(-1) > 0
        lo, hi = torch.where(above, lo, mid), torch.where(above, mid, hi)
    return (lo + hi) / 2


def test_kl_symmetry_alpha_matches_a_bisected_root_on_hard_rows():
    """The Newton solver, in float32 on vocabulary-sized rows: peaked, flat, nearly equal, masked
    (floored) and identical rows all land within 1e-4 of the float64 root (identical rows: any α)."""
    from omni_engine.logits.alpha import LOGPROB_FLOOR, kl_symmetry_alpha, log_softmax

    gen = torch.Generator().manual_seed(1)
    base = torch.randn(8, 49152, generator=gen)
    theta = base * torch.tensor([3.0, 10.0, 0.3, 3.0, 3.0, 25.0, 3.0, 3.0])[:, None]
    teacher = torch.randn(8, 49152, generator=gen) * 3
    teacher[3] = theta[3] + torch.randn(49152, generator=gen) * 1e-3  # nearly the same model
    teacher[4, :40000] = float("-inf")  # a processor masked most of the vocabulary
    teacher[6] = theta[6]  # identical rows
    teacher[7] = theta[7] * 0.5  # the same ranking, flatter
    log_theta, log_teacher = log_softmax(theta), log_softmax(teacher)
    assert log_teacher[4].min() == LOGPROB_FLOOR
    alpha = kl_symmetry_alpha(log_theta, log_teacher)
    reference = _bisected_root(log_theta, log_teacher)
    solvable = torch.tensor([True] * 6 + [False, True])
    assert torch.isfinite(alpha).all() and ((alpha >= 0) & (alpha <= 1)).all()
    assert (alpha - reference).abs()[solvable].max() < 1e-4, (alpha, reference)


def test_theta_needs_a_session_for_every_request_the_teacher_decodes(tmp_path):
    stages = [{"stage_id": 0, "stage_type": "llm", "final_output": True, "final_output_type": "text",
               "runtime": {"max_batch_size": 8}, "engine_args": {"model": "/some/model"},
               "mixing": {"theta_stage": 1, "alpha": "kl_symmetry"}},
              {"stage_id": 1, "stage_type": "llm", "runtime": {"max_batch_size": 4}, "engine_args": {"model": "/m"}}]
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"stage_args": stages}))
    with pytest.raises(ConfigError, match="holds 4 sessions .* fewer than the 8 requests"):
        load_pipeline_config(path)
    stages[1]["runtime"]["num_replicas"] = 2
    path.write_text(yaml.safe_dump({"stage_args": stages}))
    assert load_pipeline_config(path).stage_args[0].mixing.theta_stage == 1


async def test_a_batch_hold_resumes_theta_once_every_chunk_is_sent_or_dropped():
    """The scorer resumes theta's scheduler when vLLM has asked each session's stream for the
    chunk after this batch's (so it has sent this one), or the session ended without it."""
    from omni_engine.logits.theta_scorer import _BatchHold, _Session

    resumed, live = [], set()
    hold = _BatchHold(lambda: resumed.append("resume"), 3, live)
    sent, failed, ended = (_Session(f"theta-{i}", []) for i in range(3))
    for session in (sent, failed, ended):
        session.inputs.put_nowait(("chunk", hold))
    sent_stream, failed_stream = sent.stream(), failed.stream()
    assert await sent_stream.__anext__() == "chunk" and await failed_stream.__anext__() == "chunk"
    sent.inputs.put_nowait(None)
    with pytest.raises(StopAsyncIteration):
        await sent_stream.__anext__()  # asked for more: its chunk went out
    ended.drop_inputs()  # its session ended before taking the chunk
    assert resumed == [] and live == {hold}  # one chunk is still out
    await failed_stream.aclose()  # vLLM closes the stream of a chunk it could not send
    assert resumed == ["resume"] and not live
    hold.release()
    assert resumed == ["resume"]  # once


async def test_a_batch_hold_whose_chunk_is_lost_resumes_after_its_limit(monkeypatch):
    import omni_engine.logits.theta_scorer as scorer

    monkeypatch.setattr(scorer, "HOLD_LIMIT_S", 0.01)
    resumed, live = [], set()
    scorer._BatchHold(lambda: resumed.append("resume"), 2, live).release()
    assert resumed == []
    await asyncio.sleep(0.2)
    assert resumed == ["resume"] and not live
    cancelled = scorer._BatchHold(lambda: resumed.append("late"), 2, live)
    cancelled.cancel()  # the scorer is closing
    await asyncio.sleep(0.05)
    assert resumed == ["resume"] and not live
