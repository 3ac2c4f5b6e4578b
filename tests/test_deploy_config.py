"""vLLM-Omni's deploy YAML over a pipeline: every field honoured, named where it has nothing to act
on, or refused by name with the reason, before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from omni_engine.config import (
    ConfigError,
    load_pipeline_config,
    parse_pipeline_config,
    read_pipeline_yaml,
)
from omni_engine.config.deploy import apply_deploy_config
from omni_engine.entrypoints.async_omni import AsyncOmni
from tests.stress.pipeline import REPO

FAMILY = REPO / "stage_configs" / "qwen2_5_omni.yaml"
DEPLOY = """
async_chunk: false
dtype: float32
stages:
  - stage_id: 0
    max_num_seqs: 1
    gpu_memory_utilization: 0.8
    enforce_eager: true
    mm_processor_cache_gb: 0
    devices: "0"
    default_sampling_params: {temperature: 0.0, max_tokens: 2048, seed: 42, repetition_penalty: 1.1}
  - stage_id: 1
    max_num_seqs: 1
    default_sampling_params: {temperature: 0.9, top_p: 0.8, top_k: 40, max_tokens: 2048, seed: 42}
  - stage_id: 2
    max_num_seqs: 1
    enforce_eager: true
    enable_flashinfer_autotune: false
    default_sampling_params: {temperature: 0.0, top_k: -1, seed: 42}
platforms:
  cpu:
    stages:
      - {stage_id: 0, max_num_seqs: 2}
  npu:
    stages:
      - {stage_id: 2, devices: "2"}
"""


def _deploy(tmp_path, text=DEPLOY):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def test_every_field_is_honoured_or_named_where_it_has_nothing_to_act_on(tmp_path):
    data, notes = apply_deploy_config(read_pipeline_yaml(FAMILY), _deploy(tmp_path), platform="cpu")
    config = parse_pipeline_config(data, "<deployed>")
    thinker, talker, code2wav = config.stage_args
    # the cpu block over the top (max_num_seqs 2), both where vLLM reads it and where we batch
    assert thinker.engine_args["max_num_seqs"] == 2 and thinker.runtime.max_batch_size == 2
    assert {k: thinker.engine_args[k] for k in ("gpu_memory_utilization", "enforce_eager", "mm_processor_cache_gb",
                                                "dtype")} == {"gpu_memory_utilization": 0.8, "enforce_eager": True,
                                                              "mm_processor_cache_gb": 0, "dtype": "float32"}
    assert thinker.runtime.devices == "0"
    assert thinker.default_sampling_params["repetition_penalty"] == 1.1
    # merged over the family's own: the talker keeps its stop codes and its delta outputs
    assert talker.default_sampling_params == {"temperature": 0.9, "top_p": 0.8, "top_k": 40, "max_tokens": 2048,
                                              "seed": 42, "repetition_penalty": 1.05, "stop_token_ids": [8292, 8294],
                                              "detokenize": False, "output_kind": "delta"}
    assert talker.engine_args["dtype"] == "float32" and "dtype" not in code2wav.engine_args
    # code2wav runs no vLLM engine: its batch is honoured, its seed kept, the rest named
    assert code2wav.runtime.max_batch_size == 1 and code2wav.default_sampling_params == {"seed": 42}
    assert "enforce_eager" not in code2wav.engine_args and code2wav.runtime.devices is None  # npu block not ours
    assert len(notes) == 3 and all("stage 2" in n for n in notes), notes
    assert any("stages[2].enforce_eager" in n for n in notes) and any("temperature, top_k" in n for n in notes)
    assert config.runtime.execution_mode == "sequential"


def test_what_cannot_be_honoured_is_refused_by_name_all_at_once(tmp_path):
    bad = DEPLOY + "session_mode: duplex\nfoo: 1\n"
    bad = bad.replace("  - stage_id: 1\n", "  - stage_id: 1\n    subtalker_sampling_params: {}\n    no_such_arg: 3\n"
                      "    async_chunk: true\n").replace("stages:\n", "stages:\n  - stage_id: 7\n    max_num_seqs: 1\n", 1)
    with pytest.raises(ConfigError) as err:
        apply_deploy_config(read_pipeline_yaml(FAMILY), _deploy(tmp_path, bad), platform="cpu")
    message = str(err.value)
    for says in ("session_mode: not supported: duplex sessions", "foo: not a vLLM-Omni deploy field",
                 "stages[0]: stage_id 7 is not a stage of the pipeline (stages [0, 1, 2])",
                 "stages[2].subtalker_sampling_params: not supported",
                 "stages[2].no_such_arg: not a vLLM-Omni deploy field nor a vLLM engine argument",
                 "stages[2].async_chunk: not supported: set the edge's mode"):
        assert says in message, (says, message)


def test_async_omni_takes_a_deploy_config_over_its_model_s_family(tmp_path):
    ckpt = tmp_path / "omni"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"architectures": ["Qwen2_5OmniForConditionalGeneration"]}')
    omni = AsyncOmni(model=str(ckpt), deploy_config=_deploy(tmp_path))
    assert [s.runtime.max_batch_size for s in omni.config.stage_args] in ([2, 1, 1], [1, 1, 1])  # cpu, or a GPU here
    assert load_pipeline_config(FAMILY).stage_args[0].runtime.max_batch_size == 8  # the family's file is untouched


def test_serve_refuses_a_bad_deploy_config_before_starting_anything(tmp_path):
    out = subprocess.run([sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve", str(FAMILY),
                          "--deploy-config", str(_deploy(tmp_path, "stages:\n  - {stage_id: 1, bogus: 1}\n"))],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "stages[0].bogus: not a vLLM-Omni deploy field" in out.stderr and "starting" not in out.stderr


QWEN3 = REPO / "stage_configs" / "qwen3_omni_moe.yaml"
# vLLM-Omni 0.30's deploy/qwen3_omni_moe.yaml, as published (its per-platform blocks but cuda's cut)
QWEN3_DEPLOY = """
async_chunk: true
connectors:
  connector_of_shared_memory:
    name: SharedMemoryConnector
    extra:
      initial_codec_chunk_frames: 4
      codec_chunk_frames: 25
      codec_left_context_frames: 25
stages:
  - stage_id: 0
    max_num_batched_tokens: 32768
    max_num_seqs: 64
    gpu_memory_utilization: 0.9
    trust_remote_code: true
    enable_prefix_caching: false
    devices: "0"
    default_sampling_params: {temperature: 0.0, max_tokens: 2048}
  - stage_id: 1
    max_num_batched_tokens: 32768
    max_num_seqs: 64
    gpu_memory_utilization: 0.6
    trust_remote_code: true
    enable_prefix_caching: false
    devices: "1"
    input_connectors: {from_stage_0: connector_of_shared_memory}
    default_sampling_params: {seed: 42, temperature: 0.9, top_k: 50, max_tokens: 4096, repetition_penalty: 1.05}
  - stage_id: 2
    max_num_batched_tokens: 65536
    max_num_seqs: 64
    enforce_eager: false
    enable_chunked_prefill: false
    async_scheduling: false
    devices: "1"
    input_connectors: {from_stage_1: connector_of_shared_memory}
    default_sampling_params: {temperature: 0.0, top_p: 1.0, top_k: -1, max_tokens: 65536, repetition_penalty: 1.1}
platforms:
  cuda:
    stages:
      - stage_id: 0
        compilation_config: {custom_ops: ["+rotary_embedding"]}
"""


def test_vllm_omni_s_qwen3_omni_deploy_file_sets_the_codec_chunks_from_its_connector(tmp_path):
    chunked = QWEN3_DEPLOY.replace("codec_chunk_frames: 25", "codec_chunk_frames: 10")
    data, notes = apply_deploy_config(read_pipeline_yaml(QWEN3), _deploy(tmp_path, chunked), platform="cpu")
    config = parse_pipeline_config(data, "<deployed>")
    thinker, talker, code2wav = config.stage_args
    assert config.runtime.execution_mode == "async_chunk"
    # the family's own (ramp and pacing) kept beside the deploy file's sizes
    assert code2wav.custom_process_input_args == {"initial_codec_chunk_frames": 4, "codec_chunk_frames": 10,
                                                  "codec_left_context_frames": 25, "codec_chunk_ramp": True,
                                                  "codec_chunk_pacing": True}
    assert thinker.custom_process_input_args == {}
    assert talker.custom_process_input_args == {"starts_on_states": True}  # the family's, kept
    assert talker.default_sampling_params["seed"] == 42 and talker.default_sampling_params["stop_token_ids"] == [2150]
    assert thinker.engine_args["max_num_seqs"] == 64 and talker.runtime.max_batch_size == 64
    # the talker's input edge takes no codec sizes: named as having nothing to act on
    assert any("stages[1].input_connectors.from_stage_0" in n and "nothing to act on" in n for n in notes), notes
    # the edge the graph builds for the request takes them
    from omni_engine.pipeline.stage_graph import StageGraph

    edge = StageGraph.from_config(config).edge_processors[(1, 2)]([1], 2)
    assert (edge.chunks.initial, edge.chunks.size, edge.chunks.left_context) == (4, 10, 25)


def test_a_connector_that_spans_hosts_or_is_not_declared_is_refused_by_name(tmp_path):
    bad = QWEN3_DEPLOY.replace("name: SharedMemoryConnector", "name: MooncakeConnector").replace(
        "from_stage_1: connector_of_shared_memory", "from_stage_1: connector_of_nowhere")
    with pytest.raises(ConfigError) as err:
        apply_deploy_config(read_pipeline_yaml(QWEN3), _deploy(tmp_path, bad), platform="cpu")
    message = str(err.value)
    assert "connectors.connector_of_shared_memory.name: 'MooncakeConnector' is not supported" in message
    assert "stages[2].input_connectors.from_stage_1: connector 'connector_of_nowhere' is not in the deploy " \
           "file's connectors" in message
