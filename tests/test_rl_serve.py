"""The actor-learner loop against a real ``omni-engine serve``: split-and-retry rollouts, and the two-rank
example end to end (reduced) with weights pushed through the fence while slow rollouts are in flight.

Requests pass through a gateway (tests/rl_gateway.py) that logs each one's window at the server's
door, refuses batches above a size, or holds completions back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from omni_engine.rl.rollout_client import HTTPRolloutClient, RolloutError
from tests.rl_gateway import Gateway, sync_windows
from tests.test_serve_weights import push

pytestmark = pytest.mark.llm

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "rl" / "actor_learner.py"
DECODING = {"temperature": 0.01, "top_p": 0.95, "top_k": -1, "seed": 0, "max_tokens": 8}
# The example, reduced: 4 steps, 1 micro-step each, a push every 2 steps (2 pushes), small packs,
# a queue that never fills (so the prefetch is always mid-request when a sync comes).
REDUCED = {"train.steps": 4, "train.gradient_accumulation_steps": 1, "sync.every_steps": 2,
           "packing.packing_length": 160, "packing.packing_min_fill_ratio": 0.5, "data.heldout": "null",
           "stage2_ab.async.rollout_batch_size": 4, "stage2_ab.async.queue_limit": 16,
           "stage2_ab.async.version_window": 1, "rollout.max_tokens": 24}
SLOW_ROLLOUT_S = 4.0


@pytest.fixture(scope="module")
def gateway(text_server):
    with Gateway(text_server["url"]) as gw:
        yield gw


def prompts(chat_prompt, n: int) -> list[str]:
    return [chat_prompt(f"Which of these words are fruits: pear, axe, {i}? Answer with the words.") for i in range(n)]


def test_a_failing_batch_is_split_and_every_rollout_arrives_once(gateway, chat_prompt):
    gateway.reset(max_batch=2)
    client = HTTPRolloutClient(gateway.url, "smollm2-test", DECODING, max_split_depth=3)
    asked = prompts(chat_prompt, 7)
    rollouts = client.generate(asked, version=0)
    assert [r.index for r in rollouts] == list(range(7)) and all(r.text for r in rollouts)
    assert all(r.split for r in rollouts)  # each came from a split batch: its sampling may differ
    served = [p for w in gateway.windows if w.status == 200 for p in w.prompts]
    assert sorted(served) == sorted(asked)  # every prompt went through exactly once
    refused = [len(w.prompts) for w in gateway.windows if w.status == 503]
    assert refused and all(n > 2 for n in refused)
    assert client.stats.splits == len(refused) and client.stats.failures == len(refused)
    client.close()


def test_retries_are_bounded_and_a_refusal_is_not_retried(gateway, chat_prompt):
    gateway.reset(max_batch=0)
    client = HTTPRolloutClient(gateway.url, "smollm2-test", DECODING, max_split_depth=2)
    with pytest.raises(RolloutError, match=r"still failing after 2 split\(s\) at http://127\.0\.0\.1.*503"):
        client.generate(prompts(chat_prompt, 2), version=0)
    # The batch, its first half, that half once more: then the bound is reached and the batch given up.
    assert [len(w.prompts) for w in gateway.windows] == [2, 1, 1]
    gateway.reset()
    wrong = HTTPRolloutClient(gateway.url, "no-such-model", DECODING)
    with pytest.raises(RolloutError, match="HTTP 404.*no-such-model"):
        wrong.generate(prompts(chat_prompt, 1), version=0)
    assert len(gateway.windows) == 1
    client.close()
    wrong.close()


def probe(url: str) -> tuple[list, str]:
    """The served model's log-probabilities on a fixed prompt, and its weight version."""
    body = {"model": "smollm2-test", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.0,
            "logprobs": 3}
    data = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return data["choices"][0]["logprobs"]["top_logprobs"], data["weight_version"]


@pytest.fixture(scope="module")
def example_run(gateway, text_server, smollm2_path, tmp_path_factory):
    """The example through the gateway with slow rollouts; afterwards the server gets its original
    weights back (other modules share it)."""
    gateway.reset(delay_s=SLOW_ROLLOUT_S)
    log_dir = tmp_path_factory.mktemp("actor_learner")
    before = probe(text_server["url"])
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE),
            "--url", gateway.url, "--log-dir", str(log_dir), "--set", "rollout.model=smollm2-test"]
    for key, value in REDUCED.items():
        args += ["--set", f"{key}={value}"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = probe(text_server["url"])
    windows = list(gateway.windows)
    gateway.reset()
    version = after[1]
    if version.isdigit():  # back to the checkpoint, under the next version
        push({**text_server, "model": "smollm2-test"}, next(smollm2_path.glob("*.safetensors")),
             str(int(version) + 1))
    assert done.returncode == 0, done.stderr[-5000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    ranks = [[json.loads(line) for line in (log_dir / f"rank{r}.jsonl").read_text().splitlines()] for r in range(2)]
    return {"summary": summary, "ranks": ranks, "windows": windows, "before": before, "after": after}


def test_the_example_pushes_twice_and_the_served_model_changes(example_run):
    summary, (logprobs_before, version_before), (logprobs_after, version_after) = (
        example_run["summary"], example_run["before"], example_run["after"])
    assert len(summary["pushes"]) == 2 and summary["syncs"] == 2
    base = int(version_before) if version_before.isdigit() else 0
    assert [p["version"] for p in summary["pushes"]] == [base + 1, base + 2]
    assert version_after == str(base + 2)
    assert logprobs_after != logprobs_before  # trained weights answer differently
    # The counters the run reports, summed over both ranks.
    for key in ("executed_b_ratio", "b_step_skipped_due_to_queue", "stale_drops", "limit_drops", "queue_depth",
                "rollout_latency_s", "version_lag"):
        assert key in summary, key
    assert summary["b_steps"] + summary["b_step_skipped_due_to_queue"] == summary["b_wanted"]
    assert summary["channels_agree"]


def test_no_rollout_is_in_flight_during_a_sync_and_consumed_packs_are_fresh(example_run):
    windows, summary = example_run["windows"], example_run["summary"]
    completions = [w for w in windows if w.path == "/v1/completions" and w.status == 200]
    spans = sync_windows(windows)
    assert len(spans) == 2 and completions
    for start, end in spans:
        overlapping = [w for w in completions if w.start < end and start < w.end]
        assert not overlapping, (start, end, [(w.start, w.end) for w in overlapping])
    # The rollouts were slow enough that syncs had to wait for them: the fence really drained.
    drains = [r["sync"]["drain_s"] for rank in example_run["ranks"] for r in rank if "sync" in r]
    assert len(drains) == 4 and max(drains) > 0.5, drains
    # Every consumed pack was made within the window; every rollout by the version it was issued under.
    lags = [lag for rank in example_run["ranks"] for r in rank for lag in r["lags"]]
    assert all(0 <= lag <= REDUCED["stage2_ab.async.version_window"] for lag in lags), lags
    assert summary["version_mismatches"] == 0


def test_min_tokens_reaches_the_server_and_lengthens_the_rollouts(gateway, chat_prompt):
    """``rollout.min_tokens`` (vLLM's own knob) goes in the body: answers that stop on their own
    (EOS within 24 tokens) run to the limit instead."""
    gateway.reset()
    asked = prompts(chat_prompt, 3)
    plain = HTTPRolloutClient(gateway.url, "smollm2-test", {**DECODING, "max_tokens": 24})
    long = HTTPRolloutClient(gateway.url, "smollm2-test", {**DECODING, "max_tokens": 24, "min_tokens": 24})
    assert {r.finish_reason for r in plain.generate(asked, version=0)} == {"stop"}
    assert {r.finish_reason for r in long.generate(asked, version=0)} == {"length"}
    plain.close()
    long.close()
