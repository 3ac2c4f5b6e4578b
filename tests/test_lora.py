"""LoRA adapters through a pipeline: ``omni-engine serve`` with vLLM's ``--enable-lora`` and
``--lora-modules`` on the speech pipeline (SmolLM2 -> eSpeak NG), and an adapter on Qwen2.5-Omni's
thinker. A request naming the adapter gets the adapted model's answer, which transformers gives
with the adapter merged into the weights, and the speech stage speaks it; a request for the base
model at the same time gets the base answer. Seeded random adapters of the models' layouts stand
in for trained ones."""

from __future__ import annotations

import asyncio
import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from omni_engine.pipeline.lora import lora_requests_by_stage
from tests.serve_helpers import assert_nothing_in_flight, audio_chat, running_server

pytestmark = [pytest.mark.llm, pytest.mark.tts]

MODEL = "smollm2-lora"
ADAPTER = "tiny-lora"
QUESTION = "What is the capital of France?"
RANK, ALPHA, TOKENS = 8, 16, 16


def write_adapter(folder: Path, text: dict[str, Any], layers: str, seed: int, scale: float) -> Path:
    """A seeded peft-layout LoRA adapter (rank ``RANK`` on every layer's q and v projections) for a
    model whose text config is ``text`` and whose layers are named ``<layers>.<i>``."""
    from safetensors.torch import save_file

    hidden, heads = text["hidden_size"], text["num_attention_heads"]
    head_dim = text.get("head_dim") or hidden // heads
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(text["num_hidden_layers"]):
        for name, rows in (("q_proj", heads * head_dim), ("v_proj", text["num_key_value_heads"] * head_dim)):
            prefix = f"base_model.model.{layers}.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, hidden, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, RANK, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False}))
    return folder


@functools.cache
def transformers_answer(base: Path, adapter: Path | None) -> str:
    """transformers' greedy answer, with the adapter merged into the weights (``merged``); once
    per model and adapter (several tests compare with it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = merged(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), adapter)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, smollm2_path):
    config = json.loads((smollm2_path / "config.json").read_text())
    return write_adapter(tmp_path_factory.mktemp("lora") / ADAPTER, config, "model.layers", seed=0, scale=0.08)


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter):
    # vLLM's own LoRA flags, as `vllm serve` takes them; they set the pipeline's llm stage.
    with running_server("stage_configs/smollm2_speech.yaml", MODEL, tmp_path_factory.mktemp("serve-lora"),
                        extra_args=("--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2",
                                    "--lora-modules", f"{ADAPTER}={adapter}"),
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as srv:
        yield srv


def chat(server, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True}
    response = requests.post(f"{server['url']}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_the_adapter_is_listed_beside_the_base_model(server, adapter):
    cards = {card["id"]: card for card in requests.get(f"{server['url']}/v1/models", timeout=10).json()["data"]}
    assert set(cards) == {MODEL, ADAPTER}
    assert cards[ADAPTER]["parent"] == MODEL and cards[ADAPTER]["root"] == str(adapter)


async def test_requests_for_the_adapter_and_the_base_at_once_each_get_their_model_s_answer(
        server, adapter, smollm2_path):
    """Both in one batch of the llm stage (vLLM mixes adapters and none in a step)."""
    with_adapter, base = await asyncio.gather(*(asyncio.to_thread(chat, server, model) for model in (ADAPTER, MODEL)))
    want_adapter, want_base = transformers_answer(smollm2_path, adapter), transformers_answer(smollm2_path, None)
    assert want_adapter != want_base  # (else the test could not tell them apart)
    assert (with_adapter, base) == (want_adapter, want_base)


def test_speech_of_an_adapter_s_answer_is_spoken_by_the_speech_stage(server, adapter, smollm2_path):
    text, audio, pieces = audio_chat(server["url"], {
        "model": ADAPTER, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
        "max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True, "modalities": ["text", "audio"],
        "audio": {"voice": "en", "format": "pcm16"}})
    assert text == transformers_answer(smollm2_path, adapter)
    assert pieces >= 1 and len(audio) > 22050 * 0.3  # speech, not an empty stream
    assert_nothing_in_flight(server)


def test_an_adapter_that_cannot_load_is_refused_by_name_and_the_server_serves_on(server, tmp_path, smollm2_path):
    bad = tmp_path / "broken-lora"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{}")
    response = requests.post(f"{server['url']}/v1/load_lora_adapter",
                             json={"lora_name": "broken", "lora_path": str(bad)}, timeout=60)
    assert response.status_code >= 400 and "broken" in response.text, response.text
    unknown = requests.post(f"{server['url']}/v1/chat/completions", timeout=60, json={
        "model": "no-such-lora", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4})
    assert unknown.status_code == 404 and "no-such-lora" in unknown.text
    assert chat(server, MODEL) == transformers_answer(smollm2_path, None)


def test_a_request_s_adapters_by_stage_are_checked_by_name():
    from vllm.lora.request import LoRARequest

    lora = LoRARequest("mine", 1, "/adapters/mine")
    assert lora_requests_by_stage(lora, 0, [0], "r1") == {0: lora}
    assert lora_requests_by_stage({2: lora}, 0, [0, 2], "r1") == {2: lora}
    with pytest.raises(ValueError, match=r"request 'r1': LoRA adapter 'mine' for stage 1, which runs no adapters.*\[0\]"):
        lora_requests_by_stage({1: lora}, 0, [0], "r1")
    with pytest.raises(ValueError, match="none of its llm stages sets engine_args.enable_lora"):
        lora_requests_by_stage(lora, 0, [], "r1")
    with pytest.raises(ValueError, match="must be vLLM's LoRARequest, got str"):
        lora_requests_by_stage({0: "mine"}, 0, [0], "r1")


async def test_a_pipeline_without_adapter_stages_refuses_a_lora_request_by_name(text_pipeline):
    """The text pipeline's llm stage does not set enable_lora: vLLM's 400 (a validation error),
    before any stage sees the request, and nothing is left in flight."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.lora.request import LoRARequest

    with pytest.raises(VLLMValidationError, match="LoRA adapter 'mine' for stage 0, which runs no adapters.*"
                                                   "none of its llm stages sets engine_args.enable_lora"):
        async for _ in text_pipeline.generate("Hello", SamplingParams(max_tokens=2), "lora-refused",
                                              lora_request=LoRARequest("mine", 1, "/adapters/mine")):
            pass
    assert "lora-refused" not in text_pipeline.in_flight_request_ids()


@pytest.mark.tts
async def test_a_stage_that_runs_no_adapters_fails_a_request_that_brings_one_and_serves_on(tts_stage):
    """The stage's own check, behind the client's: one error naming the adapter, then the next request."""
    from vllm.lora.request import LoRARequest

    from omni_engine.errors import StageRequestError

    await tts_stage.submit_request("lora-at-tts", "Hello.", None, lora_request=LoRARequest("mine", 1, "/a/mine"))
    async with asyncio.timeout(30):
        mine: list = []
        while not mine:
            mine = [item for item in await tts_stage.get_outputs_async() if item.request_id == "lora-at-tts"]
    (error,) = mine
    assert isinstance(error, StageRequestError)
    assert re.search(r"lora_request 'mine': this stage's engine \(\w+\) runs no LoRA adapters", str(error)), error
    await tts_stage.submit_request("after-lora", "Hello.", None)
    async with asyncio.timeout(30):
        while True:
            done = [o for o in await tts_stage.get_outputs_async() if o.request_id == "after-lora" and o.finished]
            if done:
                assert len(done[0].multimodal_output["audio"]) > 1000
                break


def merged(model: torch.nn.Module, adapter: Path | None) -> torch.nn.Module:
    """``model`` with the adapter merged into its weights (W + alpha/r * B A), in place."""
    from safetensors.torch import load_file

    if adapter is not None:
        weights = load_file(adapter / "adapter_model.safetensors")
        with torch.no_grad():
            for name, module in model.named_modules():
                key = f"base_model.model.{name}"
                if f"{key}.lora_A.weight" in weights:
                    module.weight += ALPHA / RANK * weights[f"{key}.lora_B.weight"] @ weights[f"{key}.lora_A.weight"]
    return model


async def test_an_adapter_on_qwen2_5_omni_s_thinker_gives_transformers_adapted_tokens(omni_dir, tmp_path):
    """The same machinery on a multimodal thinker (vLLM's Qwen2.5-Omni thinker under our architecture):
    with the adapter and without, in one batch, each request's greedy ids are transformers' thinker's
    with the adapter merged and without."""
    from transformers import Qwen2_5OmniForConditionalGeneration
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from omni_engine.config import parse_pipeline_config, read_pipeline_yaml
    from omni_engine.models.qwen2_5_omni.processor import load_processor
    from tests.qwen_omni_reference import chat
    from tests.stress.checks import after_shutdown
    from tests.stress.pipeline import REPO, start_pipeline

    text = json.loads((omni_dir / "config.json").read_text())["thinker_config"]["text_config"]
    adapter = write_adapter(tmp_path / "omni-lora", text, "thinker.model.layers", seed=1, scale=0.3)
    data = read_pipeline_yaml(REPO / "stage_configs" / "qwen2_5_omni_thinker.yaml")
    data["stage_args"][0]["engine_args"].update(enable_lora=True, max_lora_rank=RANK, max_loras=2)
    prompt = chat("What is the capital of France?")
    client = await start_pipeline(parse_pipeline_config(data, "qwen2_5_omni_thinker_lora"))
    try:
        async def ids(request_id: str, lora: Any) -> list[int]:
            final = None
            async for output in client.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                                request_id, lora_request=lora):
                final = output
            return list(final.outputs[0].token_ids)

        got_adapter, got_base = await asyncio.gather(ids("omni-lora", LoRARequest("omni-style", 1, str(adapter))),
                                                     ids("omni-base", None))
    finally:
        await client.shutdown_async()
    assert not await after_shutdown(client)
    processor = load_processor(omni_dir)
    inputs = processor(text=prompt, return_tensors="pt")
    want = {}
    for name, with_adapter in (("base", None), ("adapter", adapter)):
        model = merged(Qwen2_5OmniForConditionalGeneration.from_pretrained(str(omni_dir), dtype=torch.float32).eval(),
                       with_adapter)
        with torch.no_grad():
            out = model.thinker.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        want[name] = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert want["adapter"] != want["base"]
    assert (got_adapter, got_base) == (want["adapter"], want["base"])
