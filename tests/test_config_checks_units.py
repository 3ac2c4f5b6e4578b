"""Config checks at the branches tests/test_config.py does not reach: each bad field is refused
at its own path, and the settings that are fine stay accepted (the mutation run's selection for
``omni_engine/config/stage_checks.py`` and ``pipeline_checks.py``; docs/mutation.md)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq.auth

from omni_engine.config import ConfigError, load_pipeline_config
from omni_engine.config.pipeline_checks import find_cycles

TTS_FACTORY = "omni_engine.engines.tts:make_espeak_tts"
PROCESSOR = "omni_engine.utils:resolve_dotted"

BASE: dict[str, Any] = {
    "stage_args": [
        {"stage_id": 0, "stage_type": "llm", "engine_args": {"model": "smollm2"}},
        {"stage_id": 1, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
         "engine_input_source": [0], "final_output": True, "final_output_type": "audio"},
    ],
}


def config(**changes: Any) -> dict[str, Any]:
    """BASE with ``changes``: ``s0``/``s1`` update a stage's fields, ``runtime`` the pipeline's."""
    data = copy.deepcopy(BASE)
    for key, value in changes.items():
        if key in ("s0", "s1"):
            data["stage_args"][int(key[1])].update(value)
        else:
            data[key] = value
    return data


def load(tmp_path: Path, data: dict[str, Any]):
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_pipeline_config(path)


def errors(tmp_path: Path, data: dict[str, Any]) -> list[str]:
    """The problems, without the file name each starts with."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data)
    prefix = f"{tmp_path / 'pipe.yaml'}: "
    assert all(e.startswith(prefix) for e in info.value.errors), info.value.errors
    return [e.removeprefix(prefix) for e in info.value.errors]


def one(tmp_path: Path, data: dict[str, Any], start: str, *needles: str) -> str:
    """The one error, which starts with ``start`` (stage and field) and contains ``needles``."""
    found = errors(tmp_path, data)
    assert len(found) == 1, found
    assert found[0].startswith(start), found
    for needle in needles:
        assert needle in found[0], found
    return found[0]


def test_the_base_config_loads(tmp_path):
    assert [s.stage_id for s in load(tmp_path, config()).stage_args] == [0, 1]


# ------------------------------------------------------------------ stage_checks
def test_an_unknown_restart_policy_is_named_with_the_choices(tmp_path):
    one(tmp_path, config(s1={"runtime": {"restart": "sometimes"}}), "stage 1: stage_args[1].runtime.restart: ",
        "unknown restart policy 'sometimes'; expected one of ['")


def test_max_restarts_is_fine_with_restart_on_failure(tmp_path):
    load(tmp_path, config(s1={"runtime": {"restart": "on-failure", "max_restarts": 3}}))


@pytest.mark.parametrize("runtime, start, needle", [
    ({"event_loop": "elsewhere"}, "stage 1: stage_args[1].runtime.event_loop: ", "'elsewhere' is not one of ['"),
    ({"event_loop": "own"}, "stage 1: stage_args[1].runtime.event_loop: ",
     "applies to in-process stages only (process: false); a stage process runs its own loop"),
    ({"io": "elsewhere"}, "stage 1: stage_args[1].runtime.io: ", "'elsewhere' is not one of ['"),
    ({"process": False, "io": "threads"}, "stage 1: stage_args[1].runtime.io: ",
     "applies to stage processes only; an in-process stage (process: false) does its I/O on its event loop"),
])
def test_event_loop_and_io_are_checked_at_their_fields(tmp_path, runtime, start, needle):
    one(tmp_path, config(s1={"runtime": runtime}), start, needle)


def test_an_in_process_stage_may_do_its_io_on_its_loop(tmp_path):
    load(tmp_path, config(s1={"runtime": {"process": False, "io": "loop"}}))


def test_a_host_needs_tcp_and_must_be_an_address_to_bind(tmp_path):
    one(tmp_path, config(s1={"runtime": {"host": "127.0.0.1"}}), "stage 1: stage_args[1].runtime.host: ",
        "host '127.0.0.1' applies only to transport: tcp (this stage uses 'ipc')")
    one(tmp_path, config(s1={"runtime": {"transport": "tcp", "host": "not a host!"}}),
        "stage 1: stage_args[1].runtime.host: ", "; expected the address to bind, e.g. 127.0.0.1 (the default)")


def test_omni_engine_settings_in_a_stages_env_are_refused(tmp_path):
    one(tmp_path, config(s1={"env": {"OMNI_ENGINE_ALLOW_PICKLE": "1"}}),
        "stage 1: stage_args[1].env.OMNI_ENGINE_ALLOW_PICKLE: ",
        "omni_engine's settings are not read in stage processes; set tensor transfer in runtime.connectors, "
        "others in the client's environment")


def test_an_llm_stage_needs_a_non_empty_model_name(tmp_path):
    one(tmp_path, config(s0={"engine_args": {"model": ""}}), "stage 0: stage_args[0].engine_args.model: ",
        "missing or not a string (got '')")


def test_logits_processors_are_checked_on_llm_stages_at_their_field(tmp_path):
    one(tmp_path, config(s0={"engine_args": {"model": "smollm2", "logits_processors": ["no_such.module:Thing"]}}),
        "stage 0: stage_args[0].engine_args.logits_processors")


def test_a_generation_stage_needs_a_model_factory_that_resolves(tmp_path):
    one(tmp_path, config(s1={"engine_args": {}}), "stage 1: stage_args[1].engine_args.model_factory: ",
        "missing; a generation stage needs a dotted path 'pkg.module:factory' to build its model")
    one(tmp_path, config(s1={"engine_args": {"model_factory": "no_such_module:make"}}),
        "stage 1: stage_args[1].engine_args.model_factory: ", "model_factory")


def test_an_input_listed_twice_is_refused_at_its_index(tmp_path):
    data = config(s1={"engine_input_source": [0, 0]})
    one(tmp_path, data, "stage 1: stage_args[1].engine_input_source[1]: ", "stage 0 is listed twice")


def test_a_bad_input_processor_is_named(tmp_path):
    one(tmp_path, config(s1={"custom_process_input_func": "no_such_module:f"}),
        "stage 1: stage_args[1].custom_process_input_func: ", "custom_process_input_func")


def test_an_in_process_stage_refuses_what_a_thread_cannot_have(tmp_path):
    found = errors(tmp_path, config(s0={"runtime": {"process": False}}))
    assert any("stage_type 'llm' (only generation stages run in-process; an llm stage's vLLM needs a process of "
               "its own)" in e for e in found), found
    found = errors(tmp_path, config(s1={"runtime": {"process": False, "num_replicas": 2, "cpus": "0,1",
                                                    "transport": "tcp"}}))
    joined = "\n".join(found)
    assert "process: false cannot be combined with num_replicas: 2" in joined
    assert "process: false cannot be combined with cpus (a thread runs where its process does)" in joined
    assert "process: false cannot be combined with transport/host (an in-process stage is reached over inproc://)" in joined
    assert all(e.startswith("stage 1: stage_args[1].runtime") for e in found), found


def test_replica_policies_need_replicas(tmp_path):
    one(tmp_path, config(s1={"runtime": {"load_balance": "round-robin"}}),
        "stage 1: stage_args[1].runtime.load_balance: ",
        "applies only with num_replicas > 1 (this stage has one replica)")


def test_devices_are_shared_out_over_two_replicas(tmp_path):
    one(tmp_path, config(s1={"runtime": {"num_replicas": 2, "devices": "0,1,2"}}),
        "stage 1: stage_args[1].runtime.devices: ", "3 device(s) cannot be shared out equally over num_replicas: 2")


@pytest.mark.parametrize("devices, needle", [
    (["0,1"], "invalid device id '0,1'; expected non-negative integers or device names, as \"0,1\", 0 or [0, 1]"),
    ([], "empty; list the device ids, or leave the field out"),
])
def test_device_lists_hold_single_ids(tmp_path, devices, needle):
    one(tmp_path, config(s1={"runtime": {"devices": devices}}), "stage 1: stage_args[1].runtime.devices: ", needle)


# ------------------------------------------------------------------ pipeline_checks
def test_an_edge_to_a_missing_stage_names_its_end(tmp_path):
    one(tmp_path, config(runtime={"edges": [{"from": 0, "to": 5}]}), "runtime.edges[0].to: ",
        "edge 0 -> 5: stage 5 does not exist (stage ids: [0, 1])")
    one(tmp_path, config(runtime={"edges": [{"from": 7, "to": 1}]}), "runtime.edges[0].from: ",
        "edge 7 -> 1: stage 7 does not exist")


def test_an_edge_overridden_twice_is_refused(tmp_path):
    edge = {"from": 0, "to": 1, "execution_mode": "sequential"}
    one(tmp_path, config(runtime={"edges": [edge, edge]}), "runtime.edges[1]: ",
        "edge 0 -> 1 is overridden more than once")


def test_an_edges_input_processor_is_named(tmp_path):
    one(tmp_path, config(runtime={"edges": [{"from": 0, "to": 1, "custom_process_input_func": "no_such:f"}]}),
        "runtime.edges[0].custom_process_input_func: ", "custom_process_input_func")


@pytest.fixture
def key_dir(tmp_path):
    zmq.auth.create_certificates(str(tmp_path), "server")
    zmq.auth.create_certificates(str(tmp_path), "client")
    return tmp_path


def test_key_files_without_curve_are_refused_each(key_dir):
    found = errors(key_dir, config(runtime={"security": {"server_key": "server.key_secret",
                                                         "client_key": "client.key_secret"}}))
    assert found == [f"runtime.security.{name}: a key file is set but curve is false; set runtime.security.curve: true"
                     for name in ("server_key", "client_key")]


def test_relative_key_files_are_read_beside_the_config_and_stored_absolute(key_dir, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    cfg = load(key_dir, config(runtime={"security": {"curve": True, "server_key": "server.key_secret",
                                                     "client_key": str(key_dir / "client.key_secret")}}))
    assert cfg.runtime.security.server_key == str(key_dir / "server.key_secret")
    assert cfg.runtime.security.client_key == str(key_dir / "client.key_secret")


def test_an_unreadable_key_file_is_named(key_dir):
    one(key_dir, config(runtime={"security": {"curve": True, "server_key": "missing.key_secret"}}),
        "runtime.security.server_key: ", "missing.key_secret")


@pytest.mark.parametrize("sources, cycles", [
    ({0: [], 1: [0], 2: [1]}, []),
    ({0: [2], 1: [0], 2: [1]}, [[0, 1, 2, 0]]),
    ({0: [1], 1: [0], 2: [0, 1]}, [[0, 1, 0]]),
    ({0: [], 1: [0], 2: [0], 3: [1, 2]}, []),  # a diamond is no cycle
    ({0: [0]}, []),  # a self-loop is reported elsewhere
])
def test_find_cycles_reports_each_cycle_once(sources, cycles):
    assert find_cycles(sources) == cycles


def test_each_cycle_is_reported_once_where_stages_all_feed_each_other():
    # 0, 1 and 2 each feed the other two: every back edge of the search is a cycle, none twice.
    assert find_cycles({0: [1, 2], 1: [0, 2], 2: [0, 1]}) == [[0, 1, 0], [0, 1, 2, 0], [1, 2, 1]]


def test_the_graph_errors_are_at_their_fields(tmp_path):
    found = errors(tmp_path, config(s0={"engine_input_source": [1]}, s1={"engine_input_source": [0]}))
    assert found[0].startswith("stage 0: stage_args[0].engine_input_source: the stage graph has a cycle 0 -> 1 -> 0"), found
    assert [e.split(": ", 1)[0] for e in found[1:]] == ["stage_args[*].engine_input_source"], found
    found = errors(tmp_path, config(s1={"final_output": False, "final_output_type": None}))
    assert [e.split(": ", 1)[0] for e in found] == ["stage_args[*].final_output"], found


def test_a_threshold_without_shared_memory_is_refused_at_its_field(tmp_path):
    one(tmp_path, config(runtime={"connectors": {"use_shm": False, "shm_threshold": 4096}}),
        "runtime.connectors.shm_threshold: ", "use_shm: false")


def test_a_client_key_alone_without_curve_is_refused(key_dir):
    one(key_dir, config(runtime={"security": {"client_key": "client.key_secret"}}),
        "runtime.security.client_key: ", "curve is false")


def test_curve_asked_of_a_libzmq_without_it_is_refused_at_its_field(tmp_path, monkeypatch):
    from omni_engine.stage_engine import security

    monkeypatch.setattr(security, "curve_available", lambda: False)
    one(tmp_path, config(runtime={"security": {"curve": True}}), "runtime.security.curve: ", "CURVE")


def test_placement_errors_are_at_their_fields(tmp_path):
    one(tmp_path, config(runtime={"placement": {"backend": "k8s"}}), "runtime.placement.backend: ", "'k8s'")
    one(tmp_path, config(runtime={"placement": {"address": "auto"}}), "runtime.placement.address: ", "ray")


RAY = {"placement": {"backend": "ray"}}


def test_resources_of_an_in_process_stage_under_ray_say_why(tmp_path):
    text = one(tmp_path, config(runtime=RAY, s1={"runtime": {"process": False, "resources": {"CPU": 1}}}),
               "stage 1: stage_args[1].runtime.resources: ", "in-process")
    assert "applies only with runtime.placement.backend" not in text


def test_a_placed_stage_may_name_a_reachable_host(tmp_path):
    cfg = load(tmp_path, config(runtime=RAY, s0={"runtime": {"host": "10.1.2.3"}}))
    assert cfg.stage(0).runtime.host == "10.1.2.3"


def test_weight_updates_may_name_an_llm_stage(tmp_path):
    assert load(tmp_path, config(weights={"stages": [0]})).weight_stage_ids() == [0]


def test_a_stage_that_sets_what_weight_updates_set_is_refused_at_weights(tmp_path):
    one(tmp_path, config(s0={"engine_args": {"model": "smollm2", "worker_extension_cls": "my.ext:Ext"}}),
        "weights: ", "stage 0 sets engine_args.worker_extension_cls")
