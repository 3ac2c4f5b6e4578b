"""The parts of rollout sampling that need no model: answer checking, the lane scheduler,
the shard journal, item checks and seeds. (The samplers themselves: ``test_sampling.py``.)"""

from __future__ import annotations

import asyncio
import json

import pytest

from omni_engine.sampling.base import BaseSampler, LaneLost, SamplerUnavailable, WorkQueue
from omni_engine.sampling.config import SamplerConfig
from omni_engine.sampling.items import ItemError, ItemResult, Response, SampleTask, item_seed, read_items
from omni_engine.sampling.shards import ShardJournal
from omni_engine.sampling.verifiers import (
    MinCorrect,
    PluginError,
    PreferencePair,
    answers_match,
    final_answer,
    load_formatter,
    load_verifier,
)


def test_final_answer_takes_the_last_boxed_or_the_last_number():
    assert final_answer(r"so \boxed{\frac{1}{2}} or \boxed{12}") == "12"
    assert final_answer(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert final_answer("3 apples and 4 pears: 7 fruits.") == "7"
    assert final_answer("it costs $1,250.50 in total") == "1,250.50"
    assert final_answer("no numbers here") is None
    assert answers_match("1,000", 1000) and answers_match("2000/2", "1000.0") and answers_match("0.5", "1/2")
    assert answers_match(" Paris ", "Paris") and not answers_match("7", "8")
    verifier = load_verifier("boxed")
    assert verifier.verify(r"the answer is \boxed{42}.", {"answer": 42}) == 1.0
    assert verifier.verify("I think 41", {"answer": "42"}) == 0.0
    with pytest.raises(KeyError, match="no 'answer'"):
        verifier.verify("1", {})


def test_formatters_and_plugin_loading():
    rollouts = [{"score": 0.0}, {"score": 1.0}]
    assert MinCorrect(k=1).is_satisfied(rollouts) and not MinCorrect(k=2).is_satisfied(rollouts)
    assert PreferencePair().is_satisfied(rollouts) and not PreferencePair().is_satisfied(rollouts[1:])
    assert isinstance(load_formatter("omni_engine.sampling.verifiers:MinCorrect", {"k": 3}), MinCorrect)
    with pytest.raises(PluginError, match="unknown formatter 'nope'") as info:
        load_formatter("nope")
    assert info.value.field == "name"
    with pytest.raises(PluginError, match="bad_arg") as info:
        load_formatter("min_correct", {"bad_arg": 1})
    assert info.value.field == "args"
    with pytest.raises(PluginError, match="has no verify"):
        load_verifier("omni_engine.sampling.verifiers:MinCorrect")


def test_item_seeds_are_stable_and_distinct():
    assert item_seed(0, "a", 0) == item_seed(0, "a", 0)
    seeds = {item_seed(base, item, r) for base in (0, 1) for item in ("a", "b") for r in range(3)}
    assert len(seeds) == 12 and all(0 <= s < 2**31 for s in seeds)
    assert item_seed(None, "a", 0) is None


def test_read_items_checks_every_line(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"id": 1, "messages": [{"role": "user", "content": "hi"}]}\n\n'
                    '{"id": "2", "messages": [{"role": "user", "content": "yo"}], "metadata": {"answer": 3}}\n')
    assert [(i["id"], i["metadata"]) for i in read_items(path)] == [("1", {}), ("2", {"answer": 3})]
    for line, message in [('{"id": "1", "messages": []}', ":1 (id 1): messages: expected a non-empty list"),
                          ('{"messages": [{"role": "user", "content": "x"}]}', ":1: id: expected a non-empty"),
                          ('{"id": "1", "messages": [{"content": "x"}]}', "messages[0]: expected {role, content}"),
                          ("not json", ":1: not JSON")]:
        path.write_text(line + "\n")
        with pytest.raises(ItemError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            read_items(path)
    path.write_text('{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n' * 2)
    with pytest.raises(ItemError, match="id 'a' repeats line 1"):
        read_items(path)


def test_journal_replays_whole_lines_and_cuts_a_torn_tail(tmp_path):
    journal = ShardJournal(tmp_path / "shard_00000.journal")
    first = ItemResult("a", 0, [Response("hi", "stop", 3, 1)])
    journal.append(first)
    journal.append(ItemResult("b", 0, [], "TimeoutError: slow"))
    journal.close()
    with open(journal.path, "ab") as f:
        f.write(b'{"item_id": "c", "rou')  # a kill mid-write
    assert ShardJournal(journal.path).replay() == [first, ItemResult("b", 0, [], "TimeoutError: slow")]
    assert journal.path.read_bytes().endswith(b"}\n")  # the torn tail is gone; appends start clean
    journal.append(ItemResult("c", 0, []))
    assert [r.item_id for r in ShardJournal(journal.path).replay()] == ["a", "b", "c"]


class ScriptedSampler(BaseSampler):
    """Lanes with fixed delays; ``lost`` lanes die on their first task. The scheduler under test
    is ``BaseSampler.stream``; this backend only takes time."""

    kind = "test"

    def __init__(self, delays: list[float], lost: set[int] = frozenset()) -> None:
        super().__init__(SamplerConfig(kind="engine", pipeline="-", concurrency=len(delays)))
        self.delays, self.lost = delays, set(lost)
        self.taken: dict[int, list[str]] = {lane: [] for lane in range(len(delays))}

    def lanes(self):
        return range(len(self.delays))

    async def sample(self, task: SampleTask, lane: int) -> list[Response]:
        if lane in self.lost:
            raise LaneLost("gone")
        await asyncio.sleep(self.delays[lane])
        self.taken[lane].append(task.item_id)
        if task.item["metadata"].get("fail"):
            raise TimeoutError("no answer")
        return [Response(f"{task.item_id}/{task.round}")] * task.n


def task(i: int, **metadata) -> SampleTask:
    return SampleTask({"id": f"i{i}", "messages": [], "metadata": metadata}, 1)


async def test_lanes_take_work_as_they_free_up_and_lost_tasks_go_to_others():
    sampler = ScriptedSampler([0.0, 0.5])
    results = [r async for r in sampler.stream(WorkQueue([task(i) for i in range(20)], closed=True))]
    assert sorted(r.item_id for r in results) == sorted(f"i{i}" for i in range(20))
    assert len(sampler.taken[1]) == 1  # the slow lane held up no share: the fast one took the rest

    sampler = ScriptedSampler([0.001, 0.001, 0.001], lost={1})
    results = [r async for r in sampler.stream(WorkQueue([task(i) for i in range(9)], closed=True))]
    assert sorted(r.item_id for r in results) == sorted(f"i{i}" for i in range(9))
    assert not sampler.taken[1] and all(r.error is None for r in results)

    failing = [r async for r in ScriptedSampler([0.0]).stream(WorkQueue([task(0, fail=True)], closed=True))]
    assert failing == [ItemResult("i0", 0, [], "TimeoutError: no answer")]

    with pytest.raises(SamplerUnavailable, match="no worker left"):
        async for _ in ScriptedSampler([0.0, 0.0], lost={0, 1}).stream(WorkQueue([task(0)], closed=True)):
            pass
    with pytest.raises(SamplerUnavailable, match="no worker left"):  # none to begin with: no wait
        async for _ in ScriptedSampler([]).stream(WorkQueue([task(0)], closed=True)):
            pass


async def test_follow_up_tasks_keep_the_lanes_busy_until_closed():
    """The Pipeline's pattern: each result may queue the item's next round; close when none is pending."""
    sampler = ScriptedSampler([0.001, 0.001])
    work = WorkQueue([task(i) for i in range(3)])
    pending, seen = 3, []
    async for result in sampler.stream(work):
        seen.append((result.item_id, result.round))
        pending -= 1
        if result.round < 2:
            work.put(SampleTask({"id": result.item_id, "messages": [], "metadata": {}}, 1, result.round + 1))
            pending += 1
        elif pending == 0:
            work.close()
    assert sorted(seen) == sorted((f"i{i}", r) for i in range(3) for r in range(3))


async def test_pipeline_overlaps_shards_and_writes_each_when_its_last_item_finishes(tmp_path):
    from omni_engine.sampling.config import InputConfig, OutputConfig, RoundsConfig, SampleConfig, ShardConfig
    from omni_engine.sampling.pipeline import Pipeline, output_lines

    (tmp_path / "items.jsonl").write_text("".join(
        json.dumps({"id": f"i{i}", "messages": [{"role": "user", "content": "x"}], "metadata": {"answer": "1"}}) + "\n"
        for i in range(7)))
    config = SampleConfig(sampler=SamplerConfig(kind="engine", pipeline="-"), input=InputConfig("items.jsonl"),
                          output=OutputConfig("out"), sampling=RoundsConfig(max_steps=2, max_rollouts=4),
                          shard=ShardConfig(size=2), base_dir=str(tmp_path))
    sampler = ScriptedSampler([0.0, 0.0, 0.0])
    summary = await Pipeline(config, sampler, manage_sampler=False).run()
    first_wave = sorted(item for taken in sampler.taken.values() for item in taken[:1])
    assert first_wave == ["i0", "i1", "i2"]  # shard 1 started while shard 0 had work left
    assert summary.requests == 14 and summary.shards == 4
    lines = output_lines(tmp_path / "out")
    assert [line["id"] for line in lines] == [f"i{i}" for i in range(7)]
    assert all([r["response"] for r in line["rollouts"]] == [f"{line['id']}/0", f"{line['id']}/1"] for line in lines)


def test_missing_metadata_and_a_failed_start_are_reported_without_locking_the_directory(tmp_path):
    from omni_engine.sampling.config import InputConfig, OutputConfig, SampleConfig
    from omni_engine.sampling.items import check_metadata
    from omni_engine.sampling.shards import OutputDir

    rows = [{"id": f"i{i}", "messages": [{"role": "user", "content": "x"}], "metadata": {}} for i in range(7)]
    with pytest.raises(ItemError, match=r"items.jsonl: metadata.answer, which the verifier needs, is missing in "
                                        r"items i0, i1, i2, i3, i4 and 2 more"):
        check_metadata(rows, load_verifier("boxed").required_metadata, "items.jsonl")
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = SampleConfig(sampler=SamplerConfig(kind="engine", pipeline="-"), input=InputConfig("items.jsonl"),
                          output=OutputConfig("out"), base_dir=str(tmp_path))
    OutputDir(tmp_path / "out", config.run_settings(), tmp_path / "items.jsonl", 7).open()
    # Nothing sampled yet: other settings take the directory over.
    other = {**config.run_settings(), "shard": {"size": 3}}
    OutputDir(tmp_path / "out", other, tmp_path / "items.jsonl", 7).open()
    journal = ShardJournal(tmp_path / "out" / "shard_00000.journal")
    journal.append(ItemResult("i0", 0, []))
    journal.close()
    with pytest.raises(ValueError, match=r"other settings or input: settings.shard.size \(was 3, now 1000\)"):
        OutputDir(tmp_path / "out", config.run_settings(), tmp_path / "items.jsonl", 7).open()


def test_progress_bar_shows_items_accepted_and_tokens_per_second():
    import io

    from omni_engine.sampling.pipeline import RunSummary
    from omni_engine.sampling.progress import TerminalProgress, format_summary

    stream = io.StringIO()
    bar = TerminalProgress(stream, enabled=True)
    bar.start(total_items=10, done_items=4)
    bar._last = -1.0  # draw now, whatever the redraw interval
    bar.update(RunSummary(requests=3, completion_tokens=500), items_done=6, accepted=2)
    bar.close()
    drawn = stream.getvalue()
    assert "6/10" in drawn and "accepted=2" in drawn and "requests=3" in drawn and "tok_s=" in drawn
    assert not TerminalProgress(io.StringIO()).enabled  # not a terminal: no bar
    text = format_summary(RunSummary(items=10, shards=2, shards_skipped=1, requests=7, rollouts=5,
                                     completion_tokens=300, seconds=3.0), "out")
    assert "10 items in 3 shards (1 already done)" in text and "100.0 tokens/s" in text
