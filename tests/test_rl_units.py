"""The actor-learner loop's parts, one at a time: ready queue, schedule, request gate, packing, config.

No server here: the parts that talk to one are in test_rl_serve.py, the two-rank gate in
test_rl_ranks.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from omni_engine.config import ConfigError
from omni_engine.rl.config import parse_actor_learner_config
from omni_engine.rl.fence import GateStopped, RequestGate, WeightSyncFence
from omni_engine.rl.packing import IGNORE_INDEX, EncodedSample, Packer, encode_chat, make_pack
from omni_engine.rl.ready_queue import VersionedReadyQueue
from omni_engine.rl.schedule import BresenhamSchedule, Channel, FeasibilityGate


# ----------------------------------------------------------------------------- ready queue
def test_items_older_than_the_window_are_dropped_and_never_consumed():
    queue: VersionedReadyQueue[str] = VersionedReadyQueue(version_window=1, queue_limit=10)
    for ver in (0, 1, 2, 3, 1, 3):
        queue.put(f"v{ver}", ver)
    assert queue.ready(current_ver=3) == 3  # v2, v3, v3 (v0 and both v1 are older than 3 - 1)
    taken = [queue.pop(3) for _ in range(4)]
    assert [t.item if t else None for t in taken] == ["v2", "v3", "v3", None]
    assert queue.counters.stale_drops == 3 and queue.counters.lags == [1, 0, 0]


def test_a_window_of_zero_takes_only_the_current_version():
    queue: VersionedReadyQueue[int] = VersionedReadyQueue(version_window=0, queue_limit=4)
    queue.put(1, 4)
    queue.put(2, 5)
    assert queue.pop(5).item == 2 and queue.pop(5) is None
    assert queue.counters.stale_drops == 1


def test_queue_limit_drops_the_oldest():
    queue: VersionedReadyQueue[int] = VersionedReadyQueue(version_window=5, queue_limit=3)
    for i in range(5):
        queue.put(i, 0)
    assert len(queue) == 3 and queue.counters.limit_drops == 2
    assert [queue.pop(0).item for _ in range(3)] == [2, 3, 4]


def test_advance_drops_what_went_stale_and_wakes_a_waiting_producer():
    queue: VersionedReadyQueue[int] = VersionedReadyQueue(version_window=0, queue_limit=2)
    queue.put(1, 0)
    queue.put(2, 0)
    woke = threading.Event()
    producer = threading.Thread(target=lambda: queue.wait_for_room() and woke.set())
    producer.start()
    assert not woke.wait(0.2)  # full: the producer waits
    queue.advance(1)
    producer.join(5)
    assert woke.is_set() and len(queue) == 0 and queue.counters.stale_drops == 2


def test_a_producer_waits_for_room_for_as_many_packs_as_it_will_put():
    queue: VersionedReadyQueue[int] = VersionedReadyQueue(version_window=0, queue_limit=4)
    queue.put(1, 0)
    queue.put(2, 0)
    assert queue.wait_for_room(2, timeout=0.01)  # 2 + 2 fit
    queue.put(3, 0)
    assert not queue.wait_for_room(2, timeout=0.01)  # 3 + 2 would not
    assert queue.wait_for_room(9, timeout=0.01) is False  # more than the limit means the whole queue
    queue.pop(0)
    assert queue.wait_for_room(2, timeout=0.01)


def test_a_producer_and_a_consumer_thread_lose_and_duplicate_nothing():
    queue: VersionedReadyQueue[int] = VersionedReadyQueue(version_window=0, queue_limit=8)
    n, got = 2000, []

    def produce():
        for i in range(n):
            queue.wait_for_room()
            queue.put(i, 0)

    producer = threading.Thread(target=produce)
    producer.start()
    while len(got) < n:
        item = queue.pop(0)
        if item is not None:
            got.append(item.item)
    producer.join(5)
    assert got == list(range(n)) and queue.counters.limit_drops == 0


def test_a_closed_queue_takes_nothing_and_releases_its_producer():
    queue: VersionedReadyQueue[int] = VersionedReadyQueue(version_window=0, queue_limit=1)
    queue.put(1, 0)
    result = []
    producer = threading.Thread(target=lambda: result.append(queue.wait_for_room()))
    producer.start()
    queue.close()
    producer.join(5)
    queue.put(2, 0)
    assert result == [False] and len(queue) == 0


# -------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.3, 0.5, 2 / 3, 1.0])
def test_the_bresenham_schedule_wants_b_on_floor_of_steps_times_ratio_steps_spread_evenly(ratio):
    schedule = BresenhamSchedule(ratio)
    for steps in (1, 7, 10, 100):
        wanted = [s for s in range(steps) if schedule.wants_b(s)]
        assert len(wanted) == schedule.b_steps(steps) == int(steps * ratio + 1e-9)
    wanted = [s for s in range(100) if schedule.wants_b(s)]
    gaps = {b - a for a, b in zip(wanted, wanted[1:])}
    assert max(gaps, default=0) - min(gaps, default=0) <= 1  # as even as integers allow


def test_the_gate_alone_commits_to_b_only_with_enough_ready_packs():
    gate = FeasibilityGate(required=2)
    assert gate.decide(0, True, 2).channel is Channel.B
    skipped = gate.decide(1, True, 1)
    assert skipped.channel is Channel.A and skipped.skipped_due_to_queue
    assert gate.decide(2, False, 9).channel is Channel.A and not gate.decide(2, False, 9).skipped_due_to_queue


def test_out_of_range_schedule_and_queue_settings_are_refused():
    with pytest.raises(ValueError, match="b_ratio"):
        BresenhamSchedule(1.5)
    with pytest.raises(ValueError, match="queue_limit"):
        VersionedReadyQueue(0, 0)


# ---------------------------------------------------------------------------- request gate
def test_closing_the_gate_waits_for_the_request_in_flight_and_admits_none_until_reopened():
    gate = RequestGate(version=3)
    events: list[tuple[str, float]] = []
    inside = threading.Event()

    def slow_request():
        with gate.request() as version:
            assert version == 3
            inside.set()
            time.sleep(0.3)
            events.append(("first done", time.monotonic()))

    def late_request():
        with gate.request() as version:
            events.append((f"late at v{version}", time.monotonic()))

    first = threading.Thread(target=slow_request)
    first.start()
    inside.wait(5)
    closer = threading.Thread(target=lambda: events.append(("closed", time.monotonic() + gate.close() * 0)))
    closer.start()
    closer.join(5)
    late = threading.Thread(target=late_request)
    late.start()
    time.sleep(0.2)
    assert [e for e, _ in events] == ["first done", "closed"]  # close returned only after the request ended
    gate.open(4)
    late.join(5)
    assert [e for e, _ in events] == ["first done", "closed", "late at v4"]


def test_a_stopped_gate_refuses_requests():
    gate = RequestGate()
    gate.close()
    gate.stop()
    with pytest.raises(GateStopped):
        with gate.request():
            pass


def test_a_failed_push_reopens_the_gate_on_the_old_version_and_raises():
    gate = RequestGate(version=2)

    def push(version):
        raise RuntimeError("server said no")

    fence = WeightSyncFence(gate, push)
    with pytest.raises(RuntimeError, match="version 3 failed.*server said no"):
        fence.sync(3)
    with gate.request() as version:
        assert version == 2


# -------------------------------------------------------------------------------- packing
@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def test_only_the_assistant_answer_is_a_target(tokenizer):
    messages = [{"role": "user", "content": "Which of these are fruits: pear, axe?"}]
    sample = encode_chat(tokenizer, messages, "pear", ver=5)
    targets = [t for t in sample.labels if t != IGNORE_INDEX]
    assert tokenizer.decode(targets).startswith("pear") and sample.ver == 5
    assert sample.input_ids[-len(targets):] == targets  # the targets are the tail: the answer and end of turn
    assert all(t == IGNORE_INDEX for t in sample.labels[:-len(targets)])


def _sample(n: int, ver: int = 0) -> EncodedSample:
    return EncodedSample(list(range(1, n + 1)), list(range(1, n + 1)), ver)


def test_the_packer_lets_a_pack_out_once_full_enough_and_the_next_does_not_fit():
    packer = Packer(packing_length=100, min_fill_ratio=0.6)
    assert packer.add(_sample(40)) == []
    assert packer.add(_sample(30, ver=2)) == []  # 70 tokens: full enough, but the next may still fit
    packs = packer.add(_sample(50))  # does not fit: the 70-token pack goes
    assert [(p.tokens, p.samples, p.ver) for p in packs] == [(70, 2, 0)]
    assert packs[0].position_ids.tolist() == [list(range(40)) + list(range(30))]
    assert packer.pending == 1


def test_a_sample_longer_than_a_pack_is_truncated_and_an_ill_fitting_stream_still_yields_packs():
    packer = Packer(packing_length=100, min_fill_ratio=0.9)
    packs = [p for _ in range(20) for p in packer.add(_sample(55))]  # 55 never reaches 90 nor pairs up
    assert packs and all(p.tokens == 55 for p in packs) and packer.underfilled == len(packs)
    assert [p.tokens for p in Packer(100, 0.5).add(_sample(130))] == [100]


def test_a_pack_trains_like_its_samples_one_by_one(tokenizer, smollm2_path):
    """Restarting position ids keep the packed samples from attending to each other: the pack's loss is
    the token-weighted mean of the samples' own losses (and differs without the restart)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    a = encode_chat(tokenizer, [{"role": "user", "content": "Name a fruit."}], "pear")
    b = encode_chat(tokenizer, [{"role": "user", "content": "Name a colour: red, axe?"}], "red")
    with torch.no_grad():
        def loss_and_count(pack):
            n = int((pack.labels[:, 1:] != IGNORE_INDEX).sum())
            return float(model(**pack.model_inputs()).loss) * n, n

        (la, na), (lb, nb) = loss_and_count(make_pack([a])), loss_and_count(make_pack([b]))
        packed = make_pack([a, b])
        lp, n_packed = loss_and_count(packed)
        assert n_packed == na + nb
        assert lp / n_packed == pytest.approx((la + lb) / (na + nb), rel=1e-4)
        leaky = model(input_ids=packed.input_ids, labels=packed.labels, use_cache=False,
                      position_ids=torch.arange(packed.tokens)[None]).loss
        assert float(leaky) != pytest.approx(lp / n_packed, rel=1e-3)


# --------------------------------------------------------------------------------- config
def _config(tmp_path, **sections):
    data = tmp_path / "train.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}], "answer": "hello"}\n')
    return {"model": "smollm2", "data": {"train": str(data)}, **sections}


def test_the_example_config_is_valid_and_keeps_the_seeds_names():
    from omni_engine.rl.config import load_actor_learner_config

    config = load_actor_learner_config("examples/rl/actor_learner.yaml", {"train.steps": 3})
    assert config.train.steps == 3 and config.sync.mode == "full"
    assert config.stage2_ab.schedule.b_ratio == 0.5 and config.prefetch.version_window == 1


def test_every_config_error_names_its_field(tmp_path):
    # Field types and ranges are checked first, all at once...
    bad = _config(tmp_path, stage2_ab={"schedule": {"b_ratio": 1.5}, "async": {"windw": 1}},
                  train={"steps": 0})
    with pytest.raises(ConfigError) as info:
        parse_actor_learner_config(bad, "learner.yaml")
    for field in ("stage2_ab.schedule.b_ratio", "stage2_ab.async.windw", "train.steps"):
        assert f"learner.yaml: {field}:" in str(info.value), (field, str(info.value))
    # ...then what the values mean together, all at once.
    bad = _config(tmp_path, train={"gradient_accumulation_steps": 4}, stage2_ab={"async": {"queue_limit": 2}},
                  sync={"mode": "delta", "backend": "nccl"}, rollout={"top_k": 0, "min_tokens": 65})
    bad["data"]["heldout"] = str(tmp_path / "missing.jsonl")
    bad["model"] = str(tmp_path / "no-model")
    with pytest.raises(ConfigError) as info:
        parse_actor_learner_config(bad, "learner.yaml")
    text = str(info.value)
    for field in ("stage2_ab.async.queue_limit: 2 is below train.gradient_accumulation_steps", "sync.mode",
                  "sync.backend", "rollout.top_k", "rollout.min_tokens: 65 is above rollout.max_tokens (64)",
                  "data.heldout: no such file", "model: no such directory"):
        assert f"learner.yaml: {field}" in text, (field, text)
