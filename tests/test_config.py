"""Pipeline YAML configs: loading, the graph they describe, process specs, and one test per validation error.

Fast, no processes: every error must name the file, the stage and the field.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from omni_engine.config import (
    ConfigError,
    PipelineConfig,
    load_pipeline_config,
    parse_pipeline_config,
)
from omni_engine.connectors.settings import ConnectorSettings
from omni_engine.pipeline.stage_graph import StageGraph
from omni_engine.pipeline import stage_specs
from omni_engine.pipeline.stage_specs import (
    build_stage_specs,
    device_control_variable,
    prepare_models,
    stage_process_spec,
)
from omni_engine.utils import resolve_dotted

TTS_FACTORY = "omni_engine.engines.tts:make_espeak_tts"
PROCESSOR = "omni_engine.utils:resolve_dotted"  # any importable callable

TWO_STAGES = f"""\
runtime:
  execution_mode: async_chunk
  connectors: {{shm_threshold: 1048576, use_shm: true}}
  edges:
    - {{from: 0, to: 1, execution_mode: sequential, custom_process_input_func: "{PROCESSOR}"}}
stage_args:
  - stage_id: 0
    stage_type: llm
    runtime: {{process: true, devices: "0", max_batch_size: 16, transport: ipc}}
    engine_args: {{model: smollm2, max_model_len: 2048}}
    default_sampling_params: {{temperature: 0.0, max_tokens: 64}}
    env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
  - stage_id: 1
    stage_type: generation
    runtime: {{max_batch_size: 4, devices: [0, 1]}}
    engine_args: {{model_factory: "{TTS_FACTORY}"}}
    engine_input_source: [0]
    custom_process_input_func: "{PROCESSOR}"
    final_output: true
    final_output_type: audio
"""


def write(tmp_path: Path, text: str, name: str = "pipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def base() -> dict:
    return yaml.safe_load(TWO_STAGES)


@pytest.fixture(autouse=True)
def four_memory_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about how devices are written and shared out, not about this machine: on
    CPUs a device must be one of the machine's NUMA nodes (tests/test_stage_devices.py holds that
    against the real ones), so here the machine has four."""
    monkeypatch.setattr(stage_specs, "memory_nodes", lambda: ["0", "1", "2", "3"])


def errors_of(tmp_path: Path, data: dict) -> list[str]:
    """Write ``data`` as YAML, load it, return the errors (which must all name the file)."""
    path = write(tmp_path, yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    assert info.value.errors, "ConfigError without errors"
    for err in info.value.errors:
        assert err.startswith(f"{path}: "), err
    return info.value.errors


def one_error(tmp_path: Path, data: dict, *needles: str) -> str:
    errors = errors_of(tmp_path, data)
    assert len(errors) == 1, errors
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def chain(*stages: dict) -> dict:
    return {"stage_args": list(stages)}


def llm(sid: int, sources: list[int] | None = None, **kw) -> dict:
    stage = {"stage_id": sid, "stage_type": "llm", "engine_args": {"model": "/some/model"}}
    if sources is not None:
        stage["engine_input_source"] = sources
    stage.update(kw)
    return stage


def final(stage: dict, kind: str = "text") -> dict:
    return {**stage, "final_output": True, "final_output_type": kind}


# ---------------------------------------------------------------------------
# Valid configs
# ---------------------------------------------------------------------------


def test_two_stage_config_loads(tmp_path: Path) -> None:
    path = write(tmp_path, TWO_STAGES)
    cfg = load_pipeline_config(path)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.source_path == str(path)
    assert cfg.runtime.execution_mode == "async_chunk"
    assert cfg.runtime.connectors.shm_threshold == 1 << 20 and cfg.runtime.connectors.use_shm is True
    assert cfg.stage(1).runtime.devices == [0, 1] and cfg.stage(0).runtime.devices == "0"
    assert cfg.stage(1).runtime.device_ids() == ("0", "1") and cfg.stage(0).runtime.device_ids() == ("0",)
    assert cfg.stage(0).env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert cfg.stage(0).default_sampling_params == {"temperature": 0.0, "max_tokens": 64}
    assert cfg.stage_ids() == [0, 1]
    graph = StageGraph.from_config(cfg)
    assert graph.sources == {0: [], 1: [0]} and graph.consumers == {0: [1], 1: []}
    assert graph.final_stage_ids() == [1]
    assert graph.edge_mode(0, 1) == "sequential"  # the edge override wins over the pipeline's mode
    assert graph.edge_processors[(0, 1)] is resolve_dotted(PROCESSOR)
    with pytest.raises(KeyError):
        cfg.stage(5)


def test_defaults_and_edge_fallbacks() -> None:
    cfg = parse_pipeline_config(chain(llm(0), final(llm(1, [0], custom_process_input_func=PROCESSOR))))
    assert cfg.source_path is None
    assert cfg.runtime.execution_mode == "sequential" and cfg.runtime.edges == []
    assert cfg.runtime.connectors.shm_threshold is None  # environment default applies
    s0 = cfg.stage(0)
    assert (s0.runtime.process, s0.runtime.max_batch_size, s0.runtime.transport) == (True, None, "ipc")
    assert s0.final_output is False and s0.env == {} and s0.default_sampling_params == {}
    graph = StageGraph.from_config(cfg)
    assert graph.edge_mode(0, 1) == "sequential"
    assert graph.edge_mode(0, 1, "async_chunk") == "async_chunk"  # a request's own mode, no edge override
    assert graph.edge_processors[(0, 1)] is resolve_dotted(PROCESSOR)  # from the destination stage


def test_a_traced_pipeline_traces_its_llm_stages_with_vllms_own_spans_too() -> None:
    """``runtime.otlp_traces_endpoint``: every llm stage's vLLM exports its request spans there too,
    unless the stage names an endpoint of its own; other stages' engines get nothing."""
    url = "http://collector:4317"
    data = chain(llm(0), llm(1, [0], engine_args={"model": "m", "otlp_traces_endpoint": "http://own:4317"}),
                 final({"stage_id": 2, "stage_type": "generation", "engine_input_source": [1],
                        "engine_args": {"model_factory": TTS_FACTORY}}, "audio"))
    data["runtime"] = {"otlp_traces_endpoint": url}
    cfg = parse_pipeline_config(data)
    assert cfg.runtime.otlp_traces_endpoint == url
    assert cfg.stage(0).engine_args["otlp_traces_endpoint"] == url
    assert cfg.stage(1).engine_args["otlp_traces_endpoint"] == "http://own:4317"
    assert "otlp_traces_endpoint" not in cfg.stage(2).engine_args
    assert cfg.with_traces_endpoint(url) == cfg  # serve's flag on a traced config changes nothing
    untraced = parse_pipeline_config(chain(final(llm(0))))
    assert untraced.runtime.otlp_traces_endpoint is None
    assert "otlp_traces_endpoint" not in untraced.stage(0).engine_args


def test_null_optional_sections_mean_defaults() -> None:
    cfg = parse_pipeline_config({"runtime": None, "stage_args": [final(llm(0, None, runtime=None))]})
    assert cfg.stage(0).runtime.max_batch_size is None and StageGraph.from_config(cfg).sources == {0: []}


def test_fan_out_and_fan_in() -> None:
    from omni_engine.pipeline.input_processors import TextPassthrough

    data = chain(final(llm(3, [1, 2])), llm(2, [0]), llm(1, [0]), llm(0, []))
    data["runtime"] = {"execution_mode": "async_chunk",
                       "edges": [{"from": 2, "to": 3, "execution_mode": "sequential",
                                  "custom_process_input_func": PROCESSOR}]}
    graph = StageGraph.from_config(parse_pipeline_config(data))
    assert graph.consumers[0] == [2, 1]  # in file order
    assert sorted(graph.sources[3]) == [1, 2]
    assert graph.final_stage_ids() == [3]
    assert graph.stages_needed({3}) == [3, 2, 1, 0]
    assert graph.edge_mode(1, 3) == "async_chunk" and graph.edge_mode(2, 3) == "sequential"
    assert graph.edge_processors[(0, 1)] is TextPassthrough
    assert graph.edge_processors[(1, 3)] is TextPassthrough and graph.edge_processors[(2, 3)] is resolve_dotted(PROCESSOR)


def test_stage_process_spec_carries_every_setting(tmp_path: Path) -> None:
    cfg = load_pipeline_config(write(tmp_path, TWO_STAGES))
    connectors = ConnectorSettings(use_shm=False, shm_threshold=4096)
    spec = stage_process_spec(cfg.stage(1), connectors, "CUDA_VISIBLE_DEVICES")
    assert spec.stage_type == "generation" and spec.engine_args == {"model_factory": TTS_FACTORY}
    assert spec.max_batch_size == 4 and spec.final_output_type == "audio"
    assert spec.connectors is connectors
    assert spec.process_environment() == {"CUDA_VISIBLE_DEVICES": "0,1"}
    # An llm stage's max_batch_size is vLLM's max_num_seqs.
    spec0 = stage_process_spec(cfg.stage(0), connectors, "CUDA_VISIBLE_DEVICES")
    assert spec0.engine_args["max_num_seqs"] == 16 and spec0.engine_args["model"] == "smollm2"
    assert spec0.process_environment() == {"VLLM_CPU_KVCACHE_SPACE": "1", "CUDA_VISIBLE_DEVICES": "0"}


def test_build_stage_specs_takes_connectors_from_config_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNI_ENGINE_SHM_THRESHOLD", "123")
    monkeypatch.setenv("OMNI_ENGINE_USE_SHM", "0")
    data = chain(final(llm(0)))
    specs = build_stage_specs(parse_pipeline_config(data))
    assert (specs[0][0].connectors.shm_threshold, specs[0][0].connectors.use_shm) == (123, False)
    data["runtime"] = {"connectors": {"shm_threshold": 4096, "use_shm": True}}
    specs = build_stage_specs(parse_pipeline_config(data))
    assert (specs[0][0].connectors.shm_threshold, specs[0][0].connectors.use_shm) == (4096, True)


def test_devices_index_into_the_devices_this_process_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_pipeline_config(chain(final(llm(0, runtime={"devices": [1, 0]}))))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    spec = stage_process_spec(cfg.stage(0), ConnectorSettings(), "CUDA_VISIBLE_DEVICES")
    assert spec.process_environment() == {"CUDA_VISIBLE_DEVICES": "6,4"}
    cfg = parse_pipeline_config(chain(final(llm(0, runtime={"devices": 2}))), "pipe.yaml")
    with pytest.raises(ConfigError, match=r"pipe.yaml: stage 0: runtime.devices: device '2' is not one of the 2 "
                                          r"devices this process sees \(CUDA_VISIBLE_DEVICES=4,6\)"):
        stage_process_spec(cfg.stage(0), ConnectorSettings(), "CUDA_VISIBLE_DEVICES", "pipe.yaml")


def test_devices_and_the_same_variable_in_env_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = parse_pipeline_config(chain(final(llm(0, runtime={"devices": 0}, env={"CUDA_VISIBLE_DEVICES": "1"}))))
    with pytest.raises(ConfigError, match="stage 0: runtime.devices: the stage's env also sets CUDA_VISIBLE_DEVICES"):
        stage_process_spec(cfg.stage(0), ConnectorSettings(), "CUDA_VISIBLE_DEVICES")


def test_prepare_models_is_an_explicit_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_engine.models import prepare

    calls: list[str] = []

    def fake_prepare(name: str, *args, **kwargs) -> Path:
        calls.append(name)
        return tmp_path / "prepared" / name

    monkeypatch.setattr(prepare, "prepare_model", fake_prepare)
    monkeypatch.chdir(tmp_path)  # no ./smollm2 directory shadows the recipe name
    cfg = load_pipeline_config(write(tmp_path, TWO_STAGES))
    build_stage_specs(cfg)
    assert calls == []  # building configs and specs does no I/O
    prepared = prepare_models(cfg)
    assert calls == ["smollm2"]
    assert prepared.stage(0).engine_args["model"] == str(tmp_path / "prepared" / "smollm2")
    assert prepared.stage(0).engine_args["max_model_len"] == 2048
    assert prepared.source_path == cfg.source_path
    assert cfg.stage(0).engine_args["model"] == "smollm2"  # the config itself is untouched
    # A model directory (not a recipe name) is left as it is.
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model_dir / name).write_text("{}")
    own = parse_pipeline_config(chain(final(llm(0, engine_args={"model": str(model_dir), "load_format": "dummy"}))))
    assert prepare_models(own).stage(0).engine_args["model"] == str(model_dir) and calls == ["smollm2"]


# ---------------------------------------------------------------------------
# One test per error
# ---------------------------------------------------------------------------


def test_unknown_field_in_stage(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"]["max_batchsize"] = 3
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.max_batchsize", "unknown field", "max_batch_size")


def test_unknown_field_top_level_and_connectors(tmp_path: Path) -> None:
    data = base()
    data["source_path"] = "x"  # set by the loader only
    data["runtime"]["connectors"]["shm_size"] = 1
    errors = errors_of(tmp_path, data)
    assert len(errors) == 2, errors
    assert any("source_path: unknown field" in e for e in errors)
    assert any("runtime.connectors.shm_size: unknown field" in e for e in errors)


def test_wrong_type(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][0]["runtime"]["max_batch_size"] = "16"
    one_error(tmp_path, data, "stage 0", "stage_args[0].runtime.max_batch_size", "expected `int | null`", "got `str`")


def test_constraint_violation_names_value(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"]["max_batch_size"] = 0
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.max_batch_size", ">= 1", "value: 0")


def test_wrong_type_inside_list_and_env(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["engine_input_source"] = [0, "zero"]
    data["stage_args"][0]["env"] = {"VLLM_CPU_KVCACHE_SPACE": 1}
    errors = errors_of(tmp_path, data)
    assert len(errors) == 2, errors
    assert any("stage 1: stage_args[1].engine_input_source[1]: expected `int`" in e for e in errors)
    assert any("stage 0: stage_args[0].env.VLLM_CPU_KVCACHE_SPACE: expected `str`, got `int`" in e for e in errors)


def test_missing_stage_id_named_by_index(tmp_path: Path) -> None:
    data = base()
    del data["stage_args"][1]["stage_id"]
    err = one_error(tmp_path, data, "stage at index 1", "stage_args[1].stage_id", "missing required field")
    assert "does not exist" not in err


def test_duplicate_stage_id(tmp_path: Path) -> None:
    data = base()
    data["stage_args"].append(final(llm(1, [0])))
    one_error(tmp_path, data, "stage 1", "stage_args[2].stage_id", "duplicate stage_id 1", "stage_args[1]")


def test_missing_source_stage(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["engine_input_source"] = [7]
    data["runtime"]["edges"] = []
    err = one_error(tmp_path, data, "stage 1", "stage_args[1].engine_input_source[0]")
    assert "engine_input_source refers to stage 7, which does not exist" in err


def test_stage_lists_itself(tmp_path: Path) -> None:
    data = chain(llm(0), final(llm(1, [0, 1])))
    one_error(tmp_path, data, "stage 1", "stage_args[1].engine_input_source[1]", "lists itself")


def test_cycle(tmp_path: Path) -> None:
    data = chain(llm(0), llm(1, [0, 2]), final(llm(2, [1])))
    one_error(tmp_path, data, "stage 1", "stage_args[1].engine_input_source", "cycle 1 -> 2 -> 1")


def test_no_entry_stage(tmp_path: Path) -> None:
    data = chain(llm(0, [1]), final(llm(1, [0])))
    errors = errors_of(tmp_path, data)
    assert any("cycle 0 -> 1 -> 0" in e and "stage 0: stage_args[0].engine_input_source" in e for e in errors)
    assert any("no entry stage" in e and "engine_input_source" in e for e in errors), errors


def test_no_final_stage(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["final_output"] = False
    one_error(tmp_path, data, "stage_args[*].final_output", "no final stage")


def test_final_output_type_missing(tmp_path: Path) -> None:
    data = base()
    del data["stage_args"][1]["final_output_type"]
    one_error(tmp_path, data, "stage 1", "stage_args[1].final_output_type", "required when final_output is true",
              "audio")


def test_final_output_type_unknown(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["final_output_type"] = "video"
    one_error(tmp_path, data, "stage 1", "stage_args[1].final_output_type", "'video'", "'audio'")


def test_custom_process_input_func_not_importable(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["custom_process_input_func"] = "omni_engine.no_such_module:f"
    one_error(tmp_path, data, "stage 1", "stage_args[1].custom_process_input_func", "cannot import module",
              "omni_engine.no_such_module")


def test_custom_process_input_func_attribute_missing_on_edge(tmp_path: Path) -> None:
    data = base()
    data["runtime"]["edges"][0]["custom_process_input_func"] = "omni_engine.utils:nope"
    one_error(tmp_path, data, "runtime.edges[0].custom_process_input_func", "has no attribute 'nope'")


def test_model_factory_missing_and_bad(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["engine_args"] = {}
    one_error(tmp_path, data, "stage 1", "stage_args[1].engine_args.model_factory", "missing")
    data["stage_args"][1]["engine_args"] = {"model_factory": "omni_engine.engines.tts:no_factory"}
    one_error(tmp_path, data, "stage 1", "stage_args[1].engine_args.model_factory", "has no attribute")


def test_unknown_stage_type(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][0]["stage_type"] = "diffusion"
    one_error(tmp_path, data, "stage 0", "stage_args[0].stage_type", "'diffusion'", "'llm'", "'generation'")


def test_unknown_execution_mode(tmp_path: Path) -> None:
    data = base()
    data["runtime"]["execution_mode"] = "streaming"
    data["runtime"]["edges"][0]["execution_mode"] = "fast"
    errors = errors_of(tmp_path, data)
    assert len(errors) == 2, errors
    assert any("runtime.execution_mode: unknown execution_mode 'streaming'" in e and "async_chunk" in e
               for e in errors)
    assert any("runtime.edges[0].execution_mode: unknown execution_mode 'fast'" in e for e in errors)


def test_edge_not_in_graph(tmp_path: Path) -> None:
    data = base()
    data["runtime"]["edges"][0].update({"from": 1, "to": 0})
    one_error(tmp_path, data, "runtime.edges[0]", "1 -> 0 is not an edge")
    data["runtime"]["edges"][0].update({"from": 0, "to": 9})
    one_error(tmp_path, data, "runtime.edges[0].to", "stage 9 does not exist")


def test_unknown_transport(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][0]["runtime"]["transport"] = "udp"
    one_error(tmp_path, data, "stage 0", "stage_args[0].runtime.transport", "'udp'", "'ipc'")


def test_stage_io_is_checked_and_reaches_the_process_spec(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][0]["runtime"]["io"] = "epoll"
    one_error(tmp_path, data, "stage_args[0].runtime.io", "'epoll' is not one of ['loop', 'threads']")
    data["stage_args"][0]["runtime"]["io"] = "threads"
    cfg = load_pipeline_config(write(tmp_path, yaml.safe_dump(data, sort_keys=False)))
    specs = [stage_process_spec(cfg.stage(i), ConnectorSettings(), device_variable="CUDA_VISIBLE_DEVICES")
             for i in (0, 1)]
    assert [spec.io for spec in specs] == ["threads", "loop"]  # unset: on the stage's loop


def test_stage_io_threads_is_for_stage_processes(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"] = {"process": False, "io": "threads"}
    one_error(tmp_path, data, "stage_args[1].runtime.io", "applies to stage processes only")


def test_llm_without_model(tmp_path: Path) -> None:
    data = base()
    del data["stage_args"][0]["engine_args"]["model"]
    one_error(tmp_path, data, "stage 0", "stage_args[0].engine_args.model", "llm stage needs a model")


def test_stage_args_missing_or_not_a_list(tmp_path: Path) -> None:
    one_error(tmp_path, {"runtime": {}}, "stage_args: missing or empty")
    one_error(tmp_path, {"stage_args": {"stage_id": 0}}, "stage_args: expected a list")


def test_top_level_not_a_mapping(tmp_path: Path) -> None:
    for text in ("", "- 1\n- 2\n"):
        path = write(tmp_path, text)
        with pytest.raises(ConfigError, match="expected a mapping") as info:
            load_pipeline_config(path)
        assert str(path) in str(info.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "stage_args:\n  - stage_id: 0\n    engine_args: {model: x\n  - stage_id: 1\n")
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line ") and "YAML syntax error" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        load_pipeline_config(path)
    assert str(path) in str(info.value) and isinstance(info.value, ValueError)


def test_multiple_errors_reported_together(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][0]["stage_type"] = "diffusion"
    data["stage_args"][1]["runtime"]["max_batch_size"] = -1
    data["stage_args"][1]["engine_input_source"] = [0, 7]
    data["stage_args"][1]["bogus"] = True
    data["runtime"]["execution_mode"] = "streaming"
    path = write(tmp_path, yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ConfigError) as info:
        load_pipeline_config(path)
    errors = info.value.errors
    # Stage 1's structural errors stop its semantic checks (the bad reference shows up later).
    assert len(errors) == 4, errors
    joined = "\n".join(errors)
    for needle in ("stage 1: stage_args[1].runtime.max_batch_size", "stage 1: stage_args[1].bogus",
                   "stage 0: stage_args[0].stage_type", ": runtime.execution_mode"):
        assert needle in joined, (needle, joined)
    assert str(info.value).startswith(f"4 errors in pipeline config {path}:")
    del data["stage_args"][1]["bogus"]
    del data["stage_args"][1]["runtime"]["max_batch_size"]
    errors = errors_of(tmp_path, data)
    assert len(errors) == 3, errors
    assert any("stage 1: stage_args[1].engine_input_source[1]: engine_input_source refers to stage 7" in e
               for e in errors)


def test_in_process_stage_refuses_what_a_thread_cannot_have(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"] = {"process": False, "max_batch_size": 4}
    load_pipeline_config(write(tmp_path, yaml.safe_dump(data)))  # a generation stage alone: fine
    data["stage_args"][1]["runtime"].update(devices=[0], num_replicas=1, restart="on-failure")
    data["stage_args"][1]["env"] = {"X": "1"}
    errors = errors_of(tmp_path, data)
    assert len(errors) == 3, errors
    for needle in ("restart: on-failure", "devices", "env"):
        assert any(f"stage 1: stage_args[1].runtime.process: process: false cannot be combined with {needle}" in e
                   for e in errors), (needle, errors)
    data = base()
    data["stage_args"][0]["runtime"]["process"] = False
    del data["stage_args"][0]["runtime"]["devices"], data["stage_args"][0]["env"]
    one_error(tmp_path, data, "stage 0", "cannot be combined with stage_type 'llm'")
    data = base()
    data["stage_args"][1]["runtime"] = {"process": False}
    data["runtime"]["security"] = {"curve": True}
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.process", "CURVE (runtime.security.curve) does "
                                                                         "not apply to it")


@pytest.mark.parametrize("devices, problem", [
    ([0, 0], "device '0' is listed twice"),
    ("0,,1", "invalid device id ''"),
    ([-1], "invalid device id -1"),
    ("0, 1 2", "invalid device id"),
    ([], "empty"),
])
def test_bad_devices(tmp_path: Path, devices, problem) -> None:
    data = base()
    data["stage_args"][1]["runtime"]["devices"] = devices
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.devices", problem)


@pytest.mark.parametrize("cpus, problem", [
    ("3-1", "'3-1' is not a CPU core or a range of cores"),
    ([0, 0], "core 0 is listed twice"),
    ("0,x", "'x' is not a CPU core"),
    ([-1], "-1 is not a CPU core"),
])
def test_bad_cpus(tmp_path: Path, cpus, problem) -> None:
    data = base()
    data["stage_args"][1]["runtime"]["cpus"] = cpus
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.cpus", problem)


def test_cpus_are_shared_out_over_replicas_and_refused_in_process(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"].update(cpus="0-2", num_replicas=2)
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.cpus", "3 core(s) cannot be shared out equally")
    data["stage_args"][1]["runtime"].update(cpus="0-3")
    stage = load_pipeline_config(write(tmp_path, yaml.safe_dump(data, sort_keys=False))).stage(1)
    assert [stage.runtime.replica_cpus(r) for r in (0, 1)] == [(0, 1), (2, 3)]
    data["stage_args"][1]["runtime"] = {"process": False, "cpus": 1}
    one_error(tmp_path, data, "stage 1", "cpus (a thread runs where its process does)")


def test_omni_engine_settings_in_stage_env_are_refused(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["env"] = {"OMNI_ENGINE_SHM_THRESHOLD": "4096"}
    one_error(tmp_path, data, "stage 1", "stage_args[1].env.OMNI_ENGINE_SHM_THRESHOLD", "runtime.connectors")


def test_llm_max_batch_size_and_max_num_seqs_must_agree(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][0]["engine_args"]["max_num_seqs"] = 8
    one_error(tmp_path, data, "stage 0", "stage_args[0].runtime.max_batch_size", "differs from engine_args.max_num_seqs (8)")
    data["stage_args"][0]["engine_args"]["max_num_seqs"] = 16
    assert load_pipeline_config(write(tmp_path, yaml.safe_dump(data))).stage(0).engine_args_for_engine()["max_num_seqs"] == 16


def test_legacy_architecture_refuses_what_it_would_ignore(tmp_path: Path) -> None:
    from omni_engine.legacy.pipeline import check_legacy_config

    data = base()
    data["runtime"]["security"] = {"curve": True}
    data["stage_args"][1]["runtime"]["transport"] = "tcp"
    path = write(tmp_path, yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        check_legacy_config(load_pipeline_config(path))
    assert len(info.value.errors) == 3, info.value.errors
    for needle in (f"{path}: runtime.connectors is not supported by the legacy architecture",
                   f"{path}: runtime.security.curve is not supported by the legacy architecture",
                   f"{path}: stage 1: stage_args[1].runtime.transport is not supported by the legacy architecture"):
        assert any(e.startswith(needle) for e in info.value.errors), (needle, info.value.errors)
    del data["runtime"]["connectors"], data["runtime"]["security"]
    data["stage_args"][1]["runtime"]["transport"] = "ipc"
    check_legacy_config(load_pipeline_config(write(tmp_path, yaml.safe_dump(data))))


def test_settings_that_would_do_nothing_are_refused(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"]["max_restarts"] = 5  # restart is "no"
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.max_restarts", "only with restart: on-failure")
    data = base()
    data["runtime"]["connectors"] = {"use_shm": False, "shm_threshold": 4096}
    one_error(tmp_path, data, "runtime.connectors.shm_threshold", "has no effect with use_shm: false")
    data = base()
    data["stage_args"][1]["runtime"]["warm_spare"] = True  # restart is "no": nothing would take it
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.warm_spare", "only with restart: on-failure")


def test_a_warm_spare_is_for_a_local_stage_without_keys(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"].update(restart="on-failure", warm_spare=True, transport="tcp")
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.warm_spare", "applies to transport: ipc")
    data = base()
    data["stage_args"][1]["runtime"].update(restart="on-failure", warm_spare=True)
    data["runtime"]["security"] = {"curve": True}
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.warm_spare", "without CURVE")


def test_replica_settings_are_checked_and_devices_shared_out(tmp_path: Path) -> None:
    data = base()
    data["stage_args"][1]["runtime"].update(num_replicas=2, load_balance="fastest", affinity="sticky", retry="always")
    errors = errors_of(tmp_path, data)
    assert len(errors) == 3, errors
    for field, value in (("load_balance", "fastest"), ("affinity", "sticky"), ("retry", "always")):
        assert any(f"stage_args[1].runtime.{field}: unknown {field} {value!r}" in e for e in errors), errors
    # With one replica there is nothing to balance, keep together or retry on.
    data = base()
    data["stage_args"][1]["runtime"]["retry"] = "never"
    one_error(tmp_path, data, "stage 1", "stage_args[1].runtime.retry", "applies only with num_replicas > 1")
    # Devices go to replicas in equal consecutive shares ...
    data = chain(final(llm(0, runtime={"devices": [0, 1, 2, 3], "num_replicas": 2})))
    cfg = parse_pipeline_config(data)
    specs = build_stage_specs(cfg, ConnectorSettings())
    assert [spec.process_environment().get(device_control_variable()) for spec in specs[0]] == ["0,1", "2,3"]
    # ... or are refused when they cannot be.
    data["stage_args"][0]["runtime"]["num_replicas"] = 3
    one_error(tmp_path, data, "stage 0", "runtime.devices", "4 device(s) cannot be shared out equally over "
                                                            "num_replicas: 3")
    data["stage_args"][0]["runtime"]["num_replicas"] = 0
    assert "num_replicas" in one_error(tmp_path, data, "stage 0")


def test_legacy_architecture_refuses_replicas(tmp_path: Path) -> None:
    from omni_engine.legacy.pipeline import check_legacy_config

    data = base()
    data["stage_args"][1]["runtime"]["num_replicas"] = 2
    del data["runtime"]["connectors"]
    path = write(tmp_path, yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"stage 1: stage_args\[1\].runtime.num_replicas is not supported by the "
                                          "legacy architecture"):
        check_legacy_config(load_pipeline_config(path))


def ray_placed(*stages: dict, **runtime) -> dict:
    return {"runtime": {"placement": {"backend": "ray"}, **runtime}, "stage_args": list(stages)}


def test_ray_placement_fields_are_checked(tmp_path: Path) -> None:
    # Placed stages default to tcp; in-process stages stay as they are.
    cfg = parse_pipeline_config(ray_placed(
        final(llm(0, runtime={"resources": {"CPU": 1, "GPU": 1}, "num_replicas": 2, "strategy": "SPREAD"})),
        {"stage_id": 1, "stage_type": "generation", "engine_args": {"model_factory": TTS_FACTORY},
         "engine_input_source": [0], "runtime": {"process": False}, "final_output": True,
         "final_output_type": "audio"}))
    assert cfg.runtime.placement.backend == "ray" and cfg.runtime.placement.address is None
    assert cfg.stage(0).runtime.transport == "tcp" and cfg.stage(1).runtime.transport == "ipc"
    assert cfg.stage(0).runtime.resources == {"CPU": 1.0, "GPU": 1.0}
    # Without Ray, its fields do nothing: refused.
    data = chain(final(llm(0, runtime={"resources": {"CPU": 1}})))
    one_error(tmp_path, data, "stage 0", "runtime.resources", "applies only with runtime.placement.backend: ray")
    plain = chain(final(llm(0)))
    one_error(tmp_path, {**plain, "runtime": {"placement": {"address": "auto"}}}, "runtime.placement.address",
              "applies only with backend: ray")
    one_error(tmp_path, {**plain, "runtime": {"placement": {"backend": "k8s"}}}, "runtime.placement.backend",
              "unknown backend 'k8s'", "'ray'")
    # With Ray: what only makes sense on the client's host, or does nothing, is refused.
    for runtime, field, needle in (
        ({"strategy": "PACK"}, "strategy", "applies only with num_replicas > 1"),
        ({"num_replicas": 2, "strategy": "DENSE"}, "strategy", "unknown strategy 'DENSE'"),
        ({"resources": {"CPU": -1}}, "resources.CPU", "negative"),
        ({"resources": {"CPU": 0}}, "resources", "reserves nothing"),
        ({"devices": "0"}, "devices", "ask for them in runtime.resources"),
        ({"transport": "ipc"}, "transport", "reached over tcp"),
        ({"host": "127.0.0.1"}, "host", "loopback"),
    ):
        one_error(tmp_path, ray_placed(final(llm(0, runtime=runtime))), "stage 0", f"runtime.{field}", needle)
    errors = errors_of(tmp_path, ray_placed(final(llm(0)), security={"curve": True, "client_key": "k.key_secret"}))
    assert any("runtime.security.client_key: a stage placed through Ray generates its keypair on its own node" in e
               for e in errors), errors


def test_ray_is_imported_only_for_a_config_that_places_stages_through_it() -> None:
    """Ray is an optional extra: loading a config without placement and everything that serves
    or runs it leaves ``ray`` unimported, so a machine without it runs such pipelines. Nor does the
    engine import its clients' packages (rl, sampling, transfer_queue): they use it, not it them."""
    config = Path(__file__).resolve().parents[1] / "stage_configs" / "smollm2_speech.yaml"
    code = ("import sys; from omni_engine.config import load_pipeline_config;"
            "import omni_engine.entrypoints.cli.main, omni_engine.entrypoints.cli.serve,"
            " omni_engine.entrypoints.cli.generate, omni_engine.entrypoints.openai.app,"
            " omni_engine.entrypoints.multi_stage_engine_client;"
            f"cfg = load_pipeline_config({str(config)!r});"
            "print(cfg.runtime.placement.backend, 'ray' in sys.modules,"
            " [m for m in sys.modules if m.startswith(('omni_engine.rl', 'omni_engine.sampling',"
            " 'omni_engine.transfer_queue'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[-3:] == ["local", "False", "[]"], out


def test_legacy_architecture_refuses_ray_placement(tmp_path: Path) -> None:
    from omni_engine.legacy.pipeline import check_legacy_config

    with pytest.raises(ConfigError, match=r"runtime.placement is not supported by the legacy architecture"):
        check_legacy_config(parse_pipeline_config(ray_placed(final(llm(0)))))


# ---------------------------------------------------------------------------
# weights: which stages take weight updates, and how
# ---------------------------------------------------------------------------
def test_weight_updates_reach_every_llm_stage_by_default_and_set_their_engine_args():
    from omni_engine.pipeline.stage_specs import WORKER_EXTENSION

    data = base()  # stage 0 llm, stage 1 speech
    specs = build_stage_specs(parse_pipeline_config(data))
    assert specs[0][0].engine_args["weight_transfer_config"] == {"backend": "shm"}
    assert specs[0][0].engine_args["worker_extension_cls"] == WORKER_EXTENSION
    assert "weight_transfer_config" not in specs[1][0].engine_args
    data["weights"] = {"stages": []}
    assert "weight_transfer_config" not in build_stage_specs(parse_pipeline_config(data))[0][0].engine_args
    data["weights"] = {"backend": "zmq"}
    config = parse_pipeline_config(data)
    assert config.weight_stage_ids() == [0]
    assert build_stage_specs(config)[0][0].engine_args["weight_transfer_config"] == {"backend": "zmq"}


@pytest.mark.parametrize("weights, needles", [
    ({"backend": "gloo"}, ("weights.backend: unknown backend 'gloo'", "'shm', 'zmq', 'nccl', 'ipc'")),
    ({"stages": [1]}, ("weights.stages: stage 1 is a 'generation' stage", "llm stages (vLLM) only")),
    ({"stages": [7]}, ("weights.stages: no stage 7 in this pipeline",)),
    ({"idle_timeout_s": 0}, ("weights.idle_timeout_s",)),
])
def test_weights_section_errors_name_the_field(tmp_path, weights, needles):
    one_error(tmp_path, {**base(), "weights": weights}, *needles)


def test_a_stage_that_sets_what_weight_updates_set_is_refused(tmp_path):
    data = base()
    data["stage_args"][0]["engine_args"]["worker_extension_cls"] = "my.ext:Ext"
    one_error(tmp_path, data, "stage 0 sets engine_args.worker_extension_cls", "weights.stages")
    data["weights"] = {"stages": []}
    load_pipeline_config(write(tmp_path, yaml.safe_dump(data, sort_keys=False)))  # left out: its own extension
