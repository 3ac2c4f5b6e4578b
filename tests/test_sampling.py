"""Rollout sampling (``omni_engine.sampling``) with the real SmolLM2.

The three samplers give the same greedy answers for the same items (the OpenAI one
against a real ``omni-engine serve``, the Ray one with two local workers, each its own
vLLM); a multi-round run with early stop sends exactly the requests its rounds call for,
counted by vLLM in the stage; a run killed with ``kill -9`` mid-shard and resumed ends with
the lines of an uninterrupted run; bad configs, an unreachable endpoint and an unknown
verifier fail before sampling starts, naming what is wrong.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import pytest_asyncio
import yaml

from omni_engine.config import ConfigError
from omni_engine.sampling import SamplerConfig, SamplerInitError, make_sampler, parse_sample_config
from omni_engine.sampling.engine_sampler import EngineSampler
from omni_engine.sampling.pipeline import Pipeline, output_lines
from omni_engine.sampling.publish import PublishError
from omni_engine.sampling.shards import ResumeMismatch
from omni_engine.sampling.verifiers import load_verifier
from omni_engine.transfer_queue import TransferQueueClient
from tests.helpers import process_exists
from tests.tq_helpers import ServerProcess

pytestmark = pytest.mark.llm

REPO = Path(__file__).resolve().parent.parent
TEXT_PIPELINE = str(REPO / "stage_configs" / "smollm2_text.yaml")
CLI = [sys.executable, "-m", "omni_engine.entrypoints.cli.main"]
SERVED = "smollm2-test"  # conftest's text_server
MAX_TOKENS = 48
QUESTIONS = [
    ("What is 2+3?", "5"),
    ("What is the capital of France?", "Paris"),
    ("What is 10 minus 4?", "6"),
    ("What is 3 times 3?", "9"),
    ("Name a primary color.", "red"),
    ("How many legs does a cat have?", "4"),
]


def items(count: int = len(QUESTIONS)) -> list[dict]:
    return [{"id": f"q{i}", "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)][0]}],
             "metadata": {"answer": QUESTIONS[i % len(QUESTIONS)][1]}} for i in range(count)]


def write_items(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def greedy(kind: str, **fields) -> dict:
    return {"kind": kind, "temperature": 0.0, "max_tokens": MAX_TOKENS, **fields}


def sample_config(tmp: Path, sampler: dict, **sections) -> dict:
    """A sample.yaml mapping over ``items()`` in ``tmp``."""
    write_items(tmp / "items.jsonl", sections.pop("rows", None) or items())
    return {"sampler": sampler, "input": {"path": "items.jsonl"}, "output": {"dir": "out"}, **sections}


def answers(result) -> dict[str, tuple]:
    return {item_id: tuple((r.text, r.finish_reason, r.completion_tokens) for r in responses)
            for item_id, responses in result.items()}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine_sampler(text_pipeline):
    # conftest's session text pipeline (the same smollm2_text.yaml), which the sampler does not own.
    sampler = EngineSampler(SamplerConfig(**greedy("engine", pipeline=TEXT_PIPELINE, concurrency=8)),
                            client=text_pipeline)
    await sampler.initialize()
    yield sampler
    await sampler.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine_answers(engine_sampler):
    result = await engine_sampler.sample_batch(items(), 1)
    assert not result.errors
    return answers(result)


def openai_fields(server: dict) -> dict:
    return {"base_url": f"{server['url']}/v1", "model": SERVED, "max_retries": 2}


async def engine_requests(client) -> int:
    """Requests vLLM in the stage finished (its ``vllm:request_success_total``)."""
    snapshots = await client.engine_metrics()
    return int(sum(value for snapshot in snapshots.values() for _name, _type, _doc, samples in snapshot
                   for sample, _labels, value in samples if sample == "vllm:request_success_total"))


# ------------------------------------------------------------------ config and initialize


def test_bad_configs_fail_naming_the_field(tmp_path):
    base = sample_config(tmp_path, greedy("openai", base_url="http://127.0.0.1:1/v1", model="m"))
    cases = [
        ({"sampler": {**base["sampler"], "pipeline": TEXT_PIPELINE}},
         "sampler.pipeline: applies to sampler kind 'engine' only, not 'openai'"),
        ({"sampler": {"kind": "openai", "model": "m"}}, "sampler.base_url: required for sampler kind 'openai'"),
        ({"sampler": {**base["sampler"], "kind": "vllm"}}, "sampler.kind: unknown sampler kind 'vllm'"),
        ({"sampler": {**base["sampler"], "concurrency": 0}}, "sampler.concurrency"),
        ({"sampling": {"step_size": 2}}, "sampling.step_size: greedy sampling"),
        ({"sampling": {"early_stop": True}}, "sampling.early_stop: early stop needs at least one formatter"),
        ({"verifier": {"name": "no_such_verifier"}}, "verifier.name: unknown verifier 'no_such_verifier'"),
        ({"verifier": {"name": "tests.no_such_module:Verifier"}}, "verifier.name: verifier"),
        ({"formatters": [{"name": "min_correct", "args": {"k": 0}}], "sampling": {"early_stop": True}},
         "formatters[0].args: formatter 'min_correct'"),
        ({"input": {"path": "missing.jsonl"}}, "input.path: no such file"),
        ({"shard": {"size": 10, "count": 2}}, "shard.count: unknown field"),
        ({"transfer_queue": {}}, "transfer_queue: give url (HTTP) and/or rpc_address (ZMQ RPC)"),
        ({"transfer_queue": {"rpc_address": "tcp://127.0.0.1:1", "timeout": 0}}, "transfer_queue.timeout"),
    ]
    for change, expected in cases:
        with pytest.raises(ConfigError) as info:
            parse_sample_config({**base, **change}, "sample.yaml", tmp_path)
        assert expected in str(info.value), (change, str(info.value))
        assert "sample.yaml" in str(info.value)


def test_cli_refuses_a_bad_config_before_starting_anything(tmp_path):
    config = sample_config(tmp_path, greedy("engine", pipeline=TEXT_PIPELINE), verifier="no_such_verifier")
    (tmp_path / "sample.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([*CLI, "sample", "--config", str(tmp_path / "sample.yaml")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "verifier.name: unknown verifier 'no_such_verifier'" in proc.stderr
    assert "sampling with" not in proc.stderr and not (tmp_path / "out").exists()  # nothing started
    # A malformed item names its line and field.
    write_items(tmp_path / "items.jsonl", [*items(2), {"id": "q9", "messages": "hi"}])
    config["verifier"] = "boxed"
    (tmp_path / "sample.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([*CLI, "sample", "--config", str(tmp_path / "sample.yaml"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "items.jsonl:3 (id q9): messages: expected a non-empty list" in proc.stderr
    # --dry-run prints the plan and samples nothing.
    write_items(tmp_path / "items.jsonl", items(5))
    config["shard"] = {"size": 2}
    (tmp_path / "sample.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run([*CLI, "sample", "--config", str(tmp_path / "sample.yaml"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    plan = json.loads(proc.stdout)
    assert proc.returncode == 0 and (plan["items"], plan["shards"], plan["shards_done"]) == (5, 3, 0)
    assert plan["sampler"]["kind"] == "engine" and not (tmp_path / "out").exists()


async def test_initialize_fails_clearly(tmp_path, text_server):
    unreachable = make_sampler(SamplerConfig(**greedy("openai", base_url="http://127.0.0.1:9/v1", model="m")))
    with pytest.raises(SamplerInitError, match=r"sampler.base_url http://127.0.0.1:9/v1: not reachable"):
        async with unreachable:
            pass
    wrong_model = make_sampler(SamplerConfig(**greedy("openai", **{**openai_fields(text_server), "model": "gpt"})))
    with pytest.raises(SamplerInitError, match=rf"sampler.model: 'gpt' is not served .*it serves: {SERVED}"):
        async with wrong_model:
            pass
    # A config built in code is checked too.
    with pytest.raises(SamplerInitError, match="sampler.base_url: required for sampler kind 'openai'"):
        await make_sampler(SamplerConfig(kind="openai", model="m")).initialize()
    # A transfer queue that does not answer fails the run before the sampler is started.
    config = parse_sample_config({**sample_config(tmp_path, greedy("openai", base_url="http://127.0.0.1:9/v1",
                                                                   model="m")),
                                  "transfer_queue": {"url": "http://127.0.0.1:9"}}, "sample.yaml", tmp_path)
    with pytest.raises(PublishError, match=r"transfer_queue.url http://127.0.0.1:9: the transfer queue does not "
                                           r"answer"):
        await Pipeline(config, make_sampler(config.sampler)).run()
    bad_pipeline = tmp_path / "pipeline.yaml"
    bad_pipeline.write_text("stage_args: [{stage_id: 0, stage_type: llm, engine_args: {model: m}, typo: 1}]\n")
    with pytest.raises(SamplerInitError, match=r"sampler.pipeline: .*stage_args\[0\].typo: unknown field"):
        async with make_sampler(SamplerConfig(kind="engine", pipeline=str(bad_pipeline))):
            pass


# ------------------------------------------------------------------ the samplers agree


async def test_engine_and_openai_samplers_give_the_same_greedy_answers(engine_answers, text_server):
    assert all(texts[0][0] for texts in engine_answers.values())
    assert "Paris" in engine_answers["q1"][0][0]
    async with make_sampler(SamplerConfig(**greedy("openai", **openai_fields(text_server), concurrency=4))) as s:
        result = await s.sample_batch(items(), 1)
    assert not result.errors
    assert answers(result) == engine_answers
    assert result.texts() == {k: [t[0] for t in v] for k, v in engine_answers.items()}


async def test_ray_sampler_two_workers_same_answers_and_killed_at_shutdown(engine_answers):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, object_store_memory=80 << 20, include_dashboard=False, log_to_driver=False)
    try:
        sampler = make_sampler(SamplerConfig(**greedy("ray", pipeline=TEXT_PIPELINE, concurrency=2)))
        async with sampler:
            assert len(sampler.workers) == 2  # from the cluster: two CPUs, one per worker
            pids = [info["pid"] for info in sampler.worker_info]
            stages = [p.pid for pid in pids for p in psutil.Process(pid).children(recursive=True)]
            assert len(set(pids)) == 2 and stages
            result = await sampler.sample_batch(items(), 1)
            assert not result.errors
            assert answers(result) == engine_answers
            # A second round reuses the loaded workers (no new processes).
            again = await sampler.sample_batch(items()[:2], 1)
            assert answers(again) == {k: engine_answers[k] for k in ("q0", "q1")}
            assert [info["pid"] for info in sampler.worker_info] == pids
            # A worker that dies hands its items to the other.
            ray.kill(sampler.workers[1], no_restart=True)
            result = await sampler.sample_batch(items(), 1)
            assert not result.errors and answers(result) == engine_answers
            assert sampler.dead_workers == {1}
        deadline = time.monotonic() + 30
        while any(process_exists(pid) for pid in pids + stages) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not [pid for pid in pids + stages if process_exists(pid)]
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ the Pipeline


async def test_multi_round_early_stop_sends_exactly_the_expected_requests(tmp_path, engine_sampler, engine_answers):
    max_steps = 3
    verifier = load_verifier("boxed")
    # Greedy answers repeat: an item right in round 0 stops after one request; one that is wrong
    # (or truncated, so dropped) never satisfies min_correct and runs all max_steps rounds.
    metadata = {item["id"]: item["metadata"] for item in items()}
    right = {item_id for item_id, ((text, reason, _),) in engine_answers.items()
             if reason != "length" and verifier.verify(text, metadata[item_id]) >= 1}
    expected = sum(1 if item_id in right else max_steps for item_id in engine_answers)
    assert 0 < len(right) < len(engine_answers), "the items must include right and wrong answers"
    config = parse_sample_config(sample_config(
        tmp_path, greedy("engine", pipeline=TEXT_PIPELINE, concurrency=8),
        sampling={"step_size": 1, "max_rollouts": 10, "max_steps": max_steps, "early_stop": True},
        verifier="boxed", formatters=[{"name": "min_correct", "args": {"k": 1}}], shard={"size": 4}),
        "sample.yaml", tmp_path)
    before = await engine_requests(engine_sampler.client)
    summary = await Pipeline(config, engine_sampler, manage_sampler=False).run()
    assert await engine_requests(engine_sampler.client) - before == expected == summary.requests
    lines = {line["id"]: line for line in output_lines(tmp_path / "out")}
    assert sorted(lines) == sorted(engine_answers)
    for item_id, line in lines.items():
        assert line["rounds"] == (1 if item_id in right else max_steps)
        assert [r["round"] for r in line["rollouts"]] == list(range(len(line["rollouts"])))
        assert all(r["score"] == (1.0 if item_id in right else 0.0) for r in line["rollouts"])
        assert line["sampling"]["sampler"] == "engine" and line["sampling"]["params"]["temperature"] == 0.0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["manifest.json", "shard_00000.jsonl",
                                                                    "shard_00001.jsonl"]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["shards"]["1"]["items"] == 2
    # Run again: everything is done, nothing is sent.
    before = await engine_requests(engine_sampler.client)
    again = await Pipeline(config, engine_sampler, manage_sampler=False).run()
    assert again.requests == 0 and again.shards_skipped == 2
    assert await engine_requests(engine_sampler.client) == before
    # Other settings into the same directory are refused, naming what changed.
    other = parse_sample_config({**sample_config(tmp_path, greedy("engine", pipeline=TEXT_PIPELINE, max_tokens=8)),
                                 "shard": {"size": 4}}, "sample.yaml", tmp_path)
    with pytest.raises(ResumeMismatch, match=r"settings.sampler.max_tokens \(was 48, now 8\)"):
        await Pipeline(other, engine_sampler, manage_sampler=False).run()


async def test_a_failing_item_is_recorded_and_the_rest_complete(tmp_path, text_server):
    too_long = {"id": "long", "messages": [{"role": "user", "content": "hello " * 3000}], "metadata": {"answer": "1"}}
    config = parse_sample_config(sample_config(
        tmp_path, greedy("openai", **openai_fields(text_server)), rows=[*items(2), too_long]), "sample.yaml", tmp_path)
    summary = await Pipeline(config, make_sampler(config.sampler)).run()
    lines = {line["id"]: line for line in output_lines(tmp_path / "out")}
    assert summary.failed_requests == 1 and len(lines) == 3
    assert lines["long"]["rollouts"] == [] and "BadRequestError" in lines["long"]["errors"][0]["error"]
    assert all(lines[i]["rollouts"] and "errors" not in lines[i] for i in ("q0", "q1"))


class FlakyProxy:
    """An HTTP proxy in front of the real server that answers some chat requests itself with a
    status of its choosing (``fail(body) -> status | None``), as an overloaded gateway would."""

    def __init__(self, upstream: str, fail) -> None:
        import http.server
        import threading
        import urllib.error
        import urllib.request

        self.injected: list[int] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _forward(self, body: bytes | None) -> None:
                request = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=120) as response:
                        status, data = response.status, response.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                self._reply(status, data)

            def _reply(self, status: int, data: bytes, headers: dict | None = None) -> None:
                self.send_response(status)
                for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                                   **(headers or {})}.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = fail(json.loads(body)) if self.path.endswith("/chat/completions") else None
                if status is None:
                    return self._forward(body)
                proxy.injected.append(status)
                self._reply(status, json.dumps({"error": {"message": "injected", "code": status}}).encode(),
                            {"retry-after-ms": "10"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_openai_sampler_retries_rate_limits_and_5xx_then_records_what_still_fails(text_server, engine_answers):
    """429s and 5xx from a gateway in front of the real server: retried with backoff until the
    answer comes; an item refused past max_retries is recorded with its error, the rest answer."""
    seen: dict[str, int] = {}

    def fail(body: dict) -> int | None:
        question = body["messages"][0]["content"]
        seen[question] = seen.get(question, 0) + 1
        if question == QUESTIONS[5][0]:
            return 503  # always
        return {1: 429, 2: 502}.get(seen[question]) if question in (QUESTIONS[0][0], QUESTIONS[1][0]) else None

    proxy = FlakyProxy(text_server["url"], fail)
    try:
        config = SamplerConfig(**greedy("openai", base_url=proxy.url, model=SERVED, max_retries=2, concurrency=3))
        async with make_sampler(config) as sampler:
            result = await sampler.sample_batch(items(), 1)
    finally:
        proxy.close()
    assert set(result.errors) == {"q5"} and "InternalServerError" in result.errors["q5"]
    assert result["q5"] == []
    assert answers(result) == {**engine_answers, "q5": ()}
    assert sorted(proxy.injected) == [429, 429, 502, 502, 503, 503, 503]  # q0, q1 twice each; q5 1 + 2 retries


def run_cli(config_path: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([*CLI, "sample", "--config", str(config_path), "--no-progress"], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def test_kill9_mid_shard_then_resume_gives_the_lines_of_an_uninterrupted_run(tmp_path, text_server):
    """... and every kept answer reaches the transfer queue both runs write to exactly once."""
    queue = ServerProcess("--group-size", "2", "--group-timeout-seconds", "0.5", "--group-timeout-policy",
                          "deliver_partial", data_dir=tmp_path / "queue")
    try:
        _kill9_then_resume(tmp_path, text_server, queue)
    finally:
        queue.stop()


def _kill9_then_resume(tmp_path: Path, text_server: dict, queue: ServerProcess) -> None:
    config = sample_config(tmp_path, greedy("openai", **openai_fields(text_server), concurrency=2),
                           rows=items(12), sampling={"step_size": 1, "max_rollouts": 2, "max_steps": 2},
                           shard={"size": 4}, transfer_queue={"rpc_address": queue.rpc})
    for name in ("whole", "killed"):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**config, "output": {"dir": name}}))
    log = tmp_path / "cli.log"
    assert run_cli(tmp_path / "whole.yaml", log).wait(300) == 0, log.read_text()[-3000:]
    proc = run_cli(tmp_path / "killed.yaml", log)
    killed = tmp_path / "killed"
    deadline = time.monotonic() + 300
    # Mid-shard: shard 0 published, shard 1 journaled in part.
    while not ((killed / "shard_00000.jsonl").exists() and (killed / "shard_00001.journal").exists()
               and (killed / "shard_00001.journal").stat().st_size > 0):
        assert proc.poll() is None, f"the run ended before it could be killed mid-shard:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    assert not (killed / "shard_00001.jsonl").exists()
    assert run_cli(tmp_path / "killed.yaml", log).wait(300) == 0, log.read_text()[-3000:]
    summary = json.loads((killed / "manifest.json").read_text())["summary"]
    assert summary["shards_skipped"] == 1 and summary["requests_replayed"] >= 1
    whole = [json.dumps(line, sort_keys=True) for line in output_lines(tmp_path / "whole")]
    resumed = [json.dumps(line, sort_keys=True) for line in output_lines(killed)]
    assert len(whole) == 12 and len(set(whole)) == 12
    assert sorted(resumed) == sorted(whole)
    assert not list(killed.glob("*.journal")) and not list(killed.glob("*.tmp"))
    # The queue: each run's kept answers once (the killed run wrote some again after the resume:
    # the same uids, dropped), in slime's shape, an item's answers as its group.
    deadline = time.monotonic() + 30
    while queue_status(queue)["incomplete_groups"]:  # items that kept one answer: delivered partial after 0.5 s
        assert time.monotonic() < deadline
        time.sleep(0.1)
    with TransferQueueClient(rpc_address=queue.rpc) as tq:
        groups = tq.read().groups
    assert sum(len(g.trajectories) for g in groups) == queue_status(queue)["total_trajectories"]
    for name in ("whole", "killed"):
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        mine = [t for g in groups for t in g.trajectories if t.extra_info["run_id"] == manifest["run_id"]]
        assert len({t.uid for t in mine}) == len(mine)
        lines = output_lines(tmp_path / name)
        expected = sorted((line["id"], r["response"], r["score"], r["round"]) for line in lines
                          for r in line["rollouts"])
        got = sorted((t.instance_id, t.messages[-1]["content"], t.reward, t.extra_info["round"]) for t in mine)
        assert got == expected and len(expected) >= 12
        summary = manifest["summary"]
        if name == "whole":
            assert (summary["published"], summary["already_published"]) == (len(expected), 0)
        else:  # the resumed run wrote shards 1 and 2 (shard 0, its first 4 lines, was done): what it replayed, again
            again = [r for line in lines[4:] for r in line["rollouts"]]
            assert summary["published"] + summary["already_published"] == len(again)
        assert all(t.messages[:-1] == [{"role": "user", "content": QUESTIONS[int(t.instance_id[1:]) % 6][0]}]
                   for t in mine)


def queue_status(queue: ServerProcess) -> dict:
    with TransferQueueClient(url=queue.url) as tq:
        return msgspec.to_builtins(tq.status())


# ------------------------------------------------------------------ the learner's in-process rollouts


async def test_the_learners_rollouts_come_from_an_in_process_pipeline_and_a_timeout_aborts_them(engine_sampler,
                                                                                                chat_prompt):
    """omni_engine.rl's EngineRolloutClient: a prefetch thread's batch runs on the pipeline's own loop; one
    that outlives its timeout is cancelled, which aborts its requests on the stages (nothing left held)."""
    from omni_engine.rl.rollout_client import RolloutError
    from omni_engine.rl.rollout_engine import EngineRolloutClient

    engine, loop = engine_sampler.client, asyncio.get_running_loop()
    greedy_knobs = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": 0, "max_tokens": 8}
    client = EngineRolloutClient(engine, loop, greedy_knobs, timeout_s=120)
    asked = [chat_prompt("What is the capital of France?"), chat_prompt("Name a colour.")]
    rollouts = await asyncio.to_thread(client.generate, asked, 3)
    assert [r.index for r in rollouts] == [0, 1] and "Paris" in rollouts[0].text
    assert all(r.version == 3 and not r.split for r in rollouts)  # no numbered weights pushed: the gate's
    assert client.stats.requests == 1 and len(client.stats.latencies) == 1

    slow = EngineRolloutClient(engine, loop, {**greedy_knobs, "max_tokens": 512}, timeout_s=0.3, max_split_depth=1)
    with pytest.raises(RolloutError, match=r"after 1 split\(s\) at the in-process pipeline: no answer within 0.3 s"):
        await asyncio.to_thread(slow.generate, asked, 0)
    for _ in range(100):  # the cancelled requests' aborts reach the orchestrator within a few loop turns
        if engine.orchestrator.state_counts()["requests"] == 0:
            break
        await asyncio.sleep(0.05)
    assert engine.orchestrator.state_counts()["requests"] == 0
