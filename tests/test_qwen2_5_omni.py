"""Qwen2.5-Omni on the tiny seeded checkpoint: the recipe, and the thinker stage against transformers.

transformers' ``Qwen2_5OmniForConditionalGeneration`` loads the same directory in this process and
is the reference: the thinker stage (vLLM's own thinker model in a real stage process, fed text,
audio and an image through vLLM's multimodal processor) must give its greedy ids, with logprobs
within 1e-4.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
import pytest_asyncio
import torch

from omni_engine.engines.mm_prompt import audio_items, vllm_prompt
from omni_engine.errors import StageRequestError
from omni_engine.inputs import OmniTextPrompt
from omni_engine.models.prepare import MARKER_FILE, prepare_model
from omni_engine.models.qwen2_5_omni import checkpoint
from omni_engine.models.qwen2_5_omni.processor import VIDEO_UNSUPPORTED, load_processor
from tests.stress.checks import after_shutdown, wait_clean
from tests.stress.pipeline import REPO, speech_config, start_pipeline

THINKER_CONFIG = REPO / "stage_configs" / "qwen2_5_omni_thinker.yaml"
LOGPROB_TOLERANCE = 1e-4
# Below this top-2 gap the two implementations' float32 sums may order the tokens either way.
TIE_GAP = 1e-3
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def omni_dir():
    return prepare_model("qwen2.5-omni-tiny")


@pytest.fixture(scope="module")
def reference(omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(omni_dir), dtype=torch.float32).eval()
    return model, load_processor(omni_dir)


def _digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != MARKER_FILE}


def test_the_tiny_checkpoint_has_the_published_layout_and_rebuilds_to_the_same_bytes(omni_dir, tmp_path):
    assert {p.name for p in omni_dir.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
        "chat_template.json", "chat_template.jinja", "spk_dict.pt", "tokenizer.json", "tokenizer_config.json",
        MARKER_FILE}
    rebuilt = prepare_model("qwen2.5-omni-tiny", cache_dir=tmp_path)
    assert _digests(rebuilt) == _digests(omni_dir)
    config = json.loads((omni_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5OmniForConditionalGeneration"]
    assert set(config) >= {"thinker_config", "talker_config", "token2wav_config"}
    assert json.loads((omni_dir / "preprocessor_config.json").read_text())["processor_class"] == "Qwen2_5OmniProcessor"


def test_the_tokenizer_spells_qwen2_5_omni_s_special_tokens_at_the_config_s_ids(omni_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(omni_dir))
    thinker = json.loads((omni_dir / "config.json").read_text())["thinker_config"]
    for token, key in (("<|AUDIO|>", "audio_token_index"), ("<|IMAGE|>", "image_token_index"),
                       ("<|VIDEO|>", "video_token_index"), ("<|audio_bos|>", "audio_start_token_id"),
                       ("<|audio_eos|>", "audio_end_token_id"), ("<|vision_bos|>", "vision_start_token_id"),
                       ("<|vision_eos|>", "vision_end_token_id")):
        assert tokenizer.convert_tokens_to_ids(token) == thinker[key], token
        assert tokenizer.encode(token) == [thinker[key]], f"{token} is not one special token"
    assert tokenizer.encode("Hello world") == [9707, 1879]  # Qwen2's BPE
    assert (tokenizer.audio_token, tokenizer.image_token) == ("<|AUDIO|>", "<|IMAGE|>")


def test_transformers_speaks_with_the_tiny_checkpoint_in_every_speaker(reference):
    model, processor = reference
    assert set(model.speaker_map) == set(checkpoint.SPEAKERS)
    text = processor.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                         tokenize=False)
    inputs = processor(text=text, return_tensors="pt")
    torch.manual_seed(0)
    _, wav = model.generate(**inputs, speaker="Ethan", thinker_max_new_tokens=4, thinker_do_sample=False,
                            talker_max_new_tokens=20, talker_do_sample=False)
    # 20 codes -> 2 mel frames each -> 240 samples a frame (24 kHz)
    assert wav.shape == (20 * 2 * 240,)
    rms = float(wav.pow(2).mean().sqrt())
    assert 0.02 < rms < 0.5, f"the vocoder's RMS {rms}: silent or clamped"
    assert float((wav.abs() > 0.99).float().mean()) < 0.01, "samples on BigVGAN's clamp"


def test_the_processor_refuses_video_by_name_without_torchvision(reference):
    _, processor = reference
    with pytest.raises(ValueError, match="video input to Qwen2.5-Omni needs torchvision"):
        processor(text="<|vision_bos|><|VIDEO|><|vision_eos|>", videos=[np.zeros((4, 56, 56, 3), np.uint8)])


def test_the_torchvision_stand_in_has_only_smart_resize():
    code = (
        "import sys\n"
        "from omni_engine.models.qwen2_5_omni import torchvision_free as t\n"
        "assert t.install()\n"
        "from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize\n"
        "from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as pil\n"
        "assert smart_resize is pil\n"
        "try:\n"
        "    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Qwen2VLImageProcessor needs torchvision, which is not installed" in out.stdout


def test_audio_pairs_become_the_tuples_vllm_takes_after_the_wire():
    samples = np.zeros(4, np.float32)
    assert audio_items([samples, 16000]) == (samples, 16000)
    assert audio_items([[samples, 16000], samples]) == [(samples, 16000), samples]
    assert audio_items(samples) is samples
    assert audio_items([samples, samples]) == [samples, samples]  # two clips, not a pair
    prompt = vllm_prompt(OmniTextPrompt(prompt="x", multi_modal_data={"audio": [samples, 8000], "image": 1}))
    assert prompt == {"prompt": "x", "multi_modal_data": {"audio": (samples, 8000), "image": 1}}


# ---------------------------------------------------------------- the thinker stage

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"


def _chat(user: str) -> str:
    return f"{SYSTEM}{user}<|im_end|>\n<|im_start|>assistant\n"


def _tone(seconds: float = 2.0, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) * np.sin(2 * np.pi * 3 * t)).astype(np.float32)


def _image():
    from PIL import Image

    return Image.fromarray((np.random.default_rng(0).random((56, 84, 3)) * 255).astype(np.uint8))


PROMPTS = {
    "text": (_chat("What is the capital of France?"), {}),
    # (samples, rate): vLLM's form for audio with its rate, which the wire carries as a list
    "audio": (_chat("<|audio_bos|><|AUDIO|><|audio_eos|>What did you hear?"), {"audio": (_tone(), 16000)}),
    "image": (_chat("<|vision_bos|><|IMAGE|><|vision_eos|>Describe it."), {"image": _image()}),
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def thinker():
    client = await start_pipeline(speech_config(THINKER_CONFIG))
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


def _reference_run(reference, kind):
    """transformers' greedy ids and, per step, the chosen token's logprob and the top-2 gap."""
    model, processor = reference
    text, data = PROMPTS[kind]
    inputs = processor(text=text, audio=[data["audio"][0]] if "audio" in data else None,
                       images=[data["image"]] if "image" in data else None, return_tensors="pt")
    with torch.no_grad():
        out = model.thinker.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True,
                                     return_dict_in_generate=True)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    logprobs, gaps = [], []
    for token, logits in zip(ids, out.logits):
        lp = torch.log_softmax(logits[0].double(), dim=-1)
        top2 = torch.topk(lp, 2).values
        logprobs.append(float(lp[token]))
        gaps.append(float(top2[0] - top2[1]))
    return ids, logprobs, gaps


async def _stage_run(client, kind, request_id):
    from vllm import SamplingParams

    text, data = PROMPTS[kind]
    prompt = OmniTextPrompt(prompt=text, multi_modal_data=dict(data)) if data else text
    final = None
    async for output in client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0,
                                                               ignore_eos=True), request_id):
        final = output
    completion = final.outputs[0]
    return list(completion.token_ids), [step[token].logprob for token, step in
                                        zip(completion.token_ids, completion.logprobs)]


@pytest.mark.parametrize("kind", ["text", "audio", "image"])
async def test_the_thinker_stage_gives_transformers_greedy_tokens(thinker, reference, kind):
    want, want_logprobs, gaps = _reference_run(reference, kind)
    got, got_logprobs = await _stage_run(thinker, kind, f"thinker-{kind}")
    assert len(got) == MAX_TOKENS
    for step, (a, b, gap) in enumerate(zip(got, want, gaps)):
        if a != b:
            assert gap < TIE_GAP, f"step {step}: token {a} != transformers' {b} with a top-2 gap of {gap:.2e}"
            break  # a near tie went the other way: the two continuations differ from here on
        assert abs(got_logprobs[step] - want_logprobs[step]) <= LOGPROB_TOLERANCE, (
            f"step {step}: logprob {got_logprobs[step]} vs transformers' {want_logprobs[step]}")


async def test_a_video_is_refused_by_name_and_the_stage_serves_on(thinker):
    prompt = OmniTextPrompt(prompt=_chat("<|vision_bos|><|VIDEO|><|vision_eos|>Describe it."),
                            multi_modal_data={"video": np.zeros((4, 56, 56, 3), np.uint8)})
    with pytest.raises(StageRequestError) as caught:
        await _stage_run(thinker, "text", "warm-up")  # the stage answers before
        async for _ in thinker.generate(prompt, None, "thinker-video"):
            pass
    message = str(caught.value)
    assert "request 'thinker-video'" in message and "(parameter=video)" in message
    assert VIDEO_UNSUPPORTED in message
    assert not await wait_clean(thinker), "the refused request left state behind"
    got, _ = await _stage_run(thinker, "text", "after-video")
    assert len(got) == MAX_TOKENS
