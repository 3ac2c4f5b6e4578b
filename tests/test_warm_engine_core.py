"""The warm EngineCore start (``engines/warm_engine_core.py``): what a forked process must get right.

The llm stage's own test (``test_stage_llm``) checks the forkserver in a real stage; here, in a
fresh interpreter with a real forkserver, the one thing fork loses that spawn kept: the
environment the parent set after the forkserver started.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from omni_engine.engines.warm_engine_core import WarmEngineCoreContext, use_warm_engine_core


def write_variable(path: str, name: str) -> None:
    """In the child: write what ``name`` is in its environment (``<unset>`` if missing)."""
    with open(path, "w") as f:
        f.write(os.environ.get(name, "<unset>"))


_SCRIPT = textwrap.dedent("""
    import multiprocessing, multiprocessing.forkserver, os, sys
    from omni_engine.engines.warm_engine_core import WarmEngineCoreContext
    from tests.test_warm_engine_core import write_variable

    multiprocessing.forkserver.ensure_running()
    os.environ["SET_LATE"] = "after the forkserver started"
    os.environ.pop("GONE_LATE")
    os.environ["CHANGED_LATE"] = "changed after the forkserver started"
    for context, path in ((WarmEngineCoreContext(), sys.argv[1]),
                          (multiprocessing.get_context("forkserver"), sys.argv[2])):
        for name in ("SET_LATE", "GONE_LATE", "CHANGED_LATE"):
            child = context.Process(target=write_variable, args=(path + name, name))
            child.start()
            child.join(60)
            assert child.exitcode == 0, child.exitcode
""")


def test_a_forked_engine_core_runs_with_the_environment_of_its_creation(tmp_path):
    warm, plain = str(tmp_path / "warm-"), str(tmp_path / "plain-")
    env = {**os.environ, "GONE_LATE": "set before the forkserver started",
           "CHANGED_LATE": "set before the forkserver started"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, warm, plain], env=env, capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    read = lambda path: open(path).read()  # noqa: E731
    # Carried: the parent's environment when the process was made: what it added, removed and changed.
    assert read(warm + "SET_LATE") == "after the forkserver started"
    assert read(warm + "GONE_LATE") == "<unset>"
    assert read(warm + "CHANGED_LATE") == "changed after the forkserver started", "a changed value stayed stale"
    # The control: a plain forkserver process has the forkserver's (stale) environment.
    assert read(plain + "SET_LATE") == "<unset>"
    assert read(plain + "GONE_LATE") == "set before the forkserver started"
    assert read(plain + "CHANGED_LATE") == "set before the forkserver started"


def write_cores(path: str) -> None:
    """In the child: write the CPU cores it may run on."""
    with open(path, "w") as f:
        f.write(",".join(map(str, sorted(os.sched_getaffinity(0)))))


_CORES_SCRIPT = textwrap.dedent("""
    import multiprocessing, multiprocessing.forkserver, os, sys
    from omni_engine.engines.warm_engine_core import WarmEngineCoreContext
    from tests.test_warm_engine_core import write_cores

    multiprocessing.forkserver.ensure_running()  # on all cores, as a warm spare's before it is taken
    os.sched_setaffinity(0, {1})  # the spare taken for a replica on core 1 (stage_entry.pin_to_cpus)
    plain = multiprocessing.get_context("forkserver")
    for context, path in ((WarmEngineCoreContext(), sys.argv[1]), (plain, sys.argv[2])):
        child = context.Process(target=write_cores, args=(path,))
        child.start()
        child.join(60)
        assert child.exitcode == 0, child.exitcode
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or 1 not in os.sched_getaffinity(0), reason="needs cores 0 and 1")
def test_a_forked_engine_core_runs_on_the_cores_of_its_creation(tmp_path):
    """vLLM's EngineCore of a warm spare taken for a replica on other cores runs on the replica's."""
    warm, plain = str(tmp_path / "warm"), str(tmp_path / "plain")
    done = subprocess.run([sys.executable, "-c", _CORES_SCRIPT, warm, plain], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert open(warm).read() == "1"
    # The control: a plain forkserver process keeps the forkserver's cores.
    assert open(plain).read() == ",".join(map(str, sorted(os.sched_getaffinity(0))))


def test_without_a_warm_forkserver_vllm_keeps_its_own_process_start():
    import vllm.v1.engine.utils as engine_utils

    before = engine_utils.get_mp_context
    use_warm_engine_core()  # this process started no forkserver: nothing changes
    assert engine_utils.get_mp_context is before
    assert WarmEngineCoreContext()._name == "forkserver"


@pytest.mark.parametrize("raw, method", [(None, "fork"), ("1", "fork"), ("forkserver", "forkserver"),
                                         ("fork", "fork"), ("FORK", "fork"), ("0", "spawn"), ("off", "spawn"),
                                         ("spawn", "spawn")])
def test_the_engine_core_start_is_read_from_the_environment(monkeypatch, raw, method):
    from omni_engine import envs

    if raw is None:
        monkeypatch.delenv("OMNI_ENGINE_WARM_ENGINE_CORE", raising=False)
    else:
        monkeypatch.setenv("OMNI_ENGINE_WARM_ENGINE_CORE", raw)
    assert envs.engine_core_start() == method


def test_an_unknown_engine_core_start_is_refused_naming_the_variable(monkeypatch):
    from omni_engine import envs

    monkeypatch.setenv("OMNI_ENGINE_WARM_ENGINE_CORE", "vfork")
    with pytest.raises(ValueError, match=r"OMNI_ENGINE_WARM_ENGINE_CORE='vfork': use one of \['forkserver', 'fork'"):
        envs.engine_core_start()


def test_only_an_llm_stage_that_forks_its_engine_core_is_started_with_vllms_cpu_libraries():
    """Its exec environment preloads them (a forked EngineCore has what its stage loaded), after what
    the stage's env or the client's environment already preloads; nothing else changes."""
    from omni_engine.stage_engine.stage_spec import StageProcessSpec
    from omni_engine.utils import cpu_preload_libraries, installed_vllm_is_cpu_build

    if not installed_vllm_is_cpu_build():
        pytest.skip("vLLM's CPU build is what preloads libraries")
    libraries, base = cpu_preload_libraries(), {"PATH": "/bin"}
    fork = StageProcessSpec("llm", {}, engine_core_start="fork", env={"A": "1"})
    assert fork.exec_environment(base) == {"PATH": "/bin", "A": "1", "LD_PRELOAD": ":".join(libraries)}
    assert fork.process_environment() == {"A": "1"}  # what the stage applies to itself: unchanged
    mine = StageProcessSpec("llm", {}, engine_core_start="fork", env={"LD_PRELOAD": "/opt/mine.so"})
    assert mine.exec_environment(base)["LD_PRELOAD"] == ":".join(["/opt/mine.so", *libraries])
    theirs = {**base, "LD_PRELOAD": libraries[0]}  # already preloaded by the client: not twice
    assert fork.exec_environment(theirs)["LD_PRELOAD"] == ":".join(libraries)
    assert StageProcessSpec("llm", {}).exec_environment(base)["LD_PRELOAD"] == ":".join(libraries)  # the default
    for other in (StageProcessSpec("llm", {}, engine_core_start="forkserver"),
                  StageProcessSpec("llm", {}, engine_core_start="spawn"),
                  StageProcessSpec("generation", {}, engine_core_start="fork")):
        assert other.exec_environment(base) == base
