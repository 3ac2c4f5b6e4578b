"""How a program ends with a pipeline, as vLLM's ``AsyncLLM`` allows: ``shutdown()`` is synchronous,
bounded and idempotent from any context, and a program that never calls it still exits promptly --
on both architectures, leaving no process, socket file or shared-memory segment behind and no
"Task was destroyed but it is pending!"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from omni_engine.connectors.shm import list_segments
from tests.leak_helpers import leftover_semaphores, semaphore_names
from tests.helpers import process_exists

REPO = Path(__file__).resolve().parents[1]
SHUTDOWN_BOUND_S = 15.0


def run_child(mode: str, pipeline: str, legacy: bool, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run the program to its end; returns it and the wall-clock time (``time.time()``) it ended."""
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE="1")
    result = subprocess.run([sys.executable, "-m", "tests.lifecycle_child", mode, pipeline,
                             *(["--legacy"] if legacy else [])],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return result, time.time()


def reports(result: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def assert_nothing_left(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Task was destroyed but it is pending" not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    left = reports(result)[0]
    deadline = time.monotonic() + 5  # a SIGKILLed group is reaped asynchronously
    while (alive := [p for p in left["pids"] if process_exists(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, f"stage processes left: {alive}"
    assert not [d for d in left["runtime_dirs"] if Path(d).exists()]
    assert not [p for p in left["shm_prefixes"] if list_segments(p)]


# (mode, pipeline, legacy): every way to end, on both architectures where their code differs.
# From another thread the work runs on the loop as shutdown_async, and a signal handler runs on
# the loop's thread as on-loop, whatever the stages are: those two are run once, with the stage on
# the client's loop below (each case is a program that imports vLLM: ~40 s of CPU).
SHUTDOWNS = [("on-loop", "tensor", False), ("after-close", "tensor", False), ("after-stop", "tensor", False),
             ("on-loop", "tensor", True), ("after-close", "tensor", True)]
# A stage on the client's loop is a task of that loop: every context differs for it.
SHUTDOWNS += [(mode, "speech-on-loop", False)
              for mode in ("on-loop", "from-thread", "after-stop", "after-close", "from-signal")]
# Without shutdown: the legacy architecture hung here (multiprocessing's exit join); vLLM's own
# processes must go too, so the LLM pipeline runs on both.
EXITS = [("exit", "tensor", True), ("exit", "text", False), ("exit", "text", True),
         ("exit", "speech-on-loop", False)]


@pytest.fixture(scope="module")
def semaphores_before() -> set[str]:
    return semaphore_names()


@pytest.fixture(scope="module")
def children(smollm2_path, semaphores_before):
    """Every scenario's program, run a few at a time (each spends most of its time importing vLLM)."""
    with ThreadPoolExecutor(3) as pool:
        futures = {case: pool.submit(run_child, *case, timeout=300) for case in SHUTDOWNS + EXITS}
        yield futures


def case_id(case: tuple) -> str:
    mode, pipeline, legacy = case
    return f"{mode}-{pipeline}-{'legacy' if legacy else 'new'}"


@pytest.mark.parametrize("case", SHUTDOWNS, ids=case_id)
def test_shutdown_is_synchronous_and_bounded_from_any_context(children, case):
    result, _ = children[case].result()
    assert_nothing_left(result)
    took = [r["shutdown_s"] for r in reports(result) if "shutdown_s" in r]
    assert len(took) == 1 and took[0] < SHUTDOWN_BOUND_S, (took, result.stderr[-2000:])
    mode, pipeline, _ = case
    if pipeline == "speech-on-loop" and mode != "after-close":
        # The engine's teardown ran on the loop (its synthesis thread is gone): after the loop
        # closed nothing can run it, and that thread is left to the interpreter's exit.
        threads = next(r["threads"] for r in reports(result) if "threads" in r)
        assert not [t for t in threads if "espeak" in t], threads


@pytest.mark.parametrize("case", EXITS, ids=case_id)
def test_a_program_that_never_shuts_down_exits_promptly_and_leaves_nothing(children, case):
    """Generate once, return from main without shutdown (the client still referenced): the
    interpreter exits within the bound and the stages go with it."""
    result, ended_at = children[case].result()
    assert_nothing_left(result)
    returned_at = next(r["returned_at"] for r in reports(result) if "returned_at" in r)
    assert ended_at - returned_at < SHUTDOWN_BOUND_S, result.stderr[-2000:]


def test_no_way_of_ending_leaves_a_semaphore(children, semaphores_before):
    """Of every program above (its stages shut down or killed with it, on both architectures), no
    named semaphore (/dev/shm/sem.mp-*) is left once the trackers have done their work."""
    for future in children.values():
        future.result()
    assert not leftover_semaphores(semaphores_before)
