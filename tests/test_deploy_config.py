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
