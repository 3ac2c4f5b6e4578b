"""Pipeline YAML configs: loading, graph helpers, and one test per validation error.

Fast, no processes: every error must name the file, the stage and the field.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from omni_engine.config import (
    ConfigError,
    OmniStage,
    PipelineConfig,
    StageConfig,
    load_pipeline_config,
    parse_pipeline_config,
)

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
    assert cfg.stage(0).env == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert cfg.stage(0).default_sampling_params == {"temperature": 0.0, "max_tokens": 64}
    assert cfg.stage_ids() == [0, 1]
    assert cfg.sources_of(1) == [0] and cfg.sources_of(0) == []
    assert cfg.consumers_of(0) == [1] and cfg.consumers_of(1) == []
    assert cfg.entry_stages() == [0] and cfg.final_stages() == [1]
    assert cfg.topological_order() == [0, 1]
    assert cfg.edge_mode(0, 1) == "sequential"  # the edge override wins
    assert cfg.edge_processor(0, 1) == PROCESSOR
    assert OmniStage is StageConfig
    with pytest.raises(KeyError):
        cfg.stage(5)
    with pytest.raises(KeyError):
        cfg.edge_mode(1, 0)


def test_defaults_and_edge_fallbacks() -> None:
    cfg = parse_pipeline_config(chain(llm(0), final(llm(1, [0], custom_process_input_func=PROCESSOR))))
    assert cfg.source_path is None
    assert cfg.runtime.execution_mode == "sequential" and cfg.runtime.edges == []
    assert cfg.runtime.connectors.shm_threshold is None  # environment default applies
    s0 = cfg.stage(0)
    assert (s0.runtime.process, s0.runtime.max_batch_size, s0.runtime.transport) == (True, 1, "ipc")
    assert s0.final_output is False and s0.env == {} and s0.default_sampling_params == {}
    assert cfg.edge_mode(0, 1) == "sequential"
    assert cfg.edge_processor(0, 1) == PROCESSOR  # from the destination stage


def test_null_optional_sections_mean_defaults() -> None:
    cfg = parse_pipeline_config({"runtime": None, "stage_args": [final(llm(0, None, runtime=None))]})
    assert cfg.stage(0).runtime.max_batch_size == 1 and cfg.entry_stages() == [0]


def test_fan_out_and_fan_in() -> None:
    data = chain(final(llm(3, [1, 2])), llm(2, [0]), llm(1, [0]), llm(0, []))
    data["runtime"] = {"execution_mode": "async_chunk",
                       "edges": [{"from": 2, "to": 3, "execution_mode": "sequential"}]}
    cfg = parse_pipeline_config(data)
    assert cfg.topological_order() == [0, 1, 2, 3]
    assert cfg.consumers_of(0) == [2, 1]  # in file order
    assert sorted(cfg.sources_of(3)) == [1, 2]
    assert cfg.entry_stages() == [0] and cfg.final_stages() == [3]
    assert cfg.edge_mode(1, 3) == "async_chunk" and cfg.edge_mode(2, 3) == "sequential"
    assert cfg.edge_processor(0, 1) is None


def test_process_spec_non_recipe_model_is_kept(tmp_path: Path) -> None:
    cfg = load_pipeline_config(write(tmp_path, TWO_STAGES))
    spec = cfg.stage(1).process_spec()
    assert spec.stage_type == "generation"
    assert spec.engine_args == {"model_factory": TTS_FACTORY}
    assert spec.runtime == {"max_batch_size": 4} and spec.final_output_type == "audio"
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    stage = parse_pipeline_config(chain(final(llm(0, env={"A": "b"}, engine_args={"model": str(model_dir)})))).stage(0)
    spec = stage.process_spec()
    assert spec.engine_args["model"] == str(model_dir) and spec.env == {"A": "b"}
    # A recipe name is left alone when resolution is off.
    assert cfg.stage(0).process_spec(resolve_models=False).engine_args["model"] == "smollm2"


def test_process_spec_resolves_recipe_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_engine.models import prepare

    calls: list[str] = []

    def fake_prepare(name: str, *args, **kwargs) -> Path:
        calls.append(name)
        return tmp_path / "prepared" / name

    monkeypatch.setattr(prepare, "prepare_model", fake_prepare)
    monkeypatch.chdir(tmp_path)  # no ./smollm2 directory shadows the recipe name
    cfg = parse_pipeline_config(yaml.safe_load(TWO_STAGES))
    spec = cfg.stage(0).process_spec()
    assert calls == ["smollm2"]
    assert spec.engine_args["model"] == str(tmp_path / "prepared" / "smollm2")
    assert spec.engine_args["max_model_len"] == 2048
    assert cfg.stage(0).engine_args["model"] == "smollm2"  # the config itself is untouched
    assert spec.runtime == {"max_batch_size": 16}


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
    one_error(tmp_path, data, "stage 0", "stage_args[0].runtime.max_batch_size", "expected `int`", "got `str`")


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
