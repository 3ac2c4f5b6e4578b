"""Qwen2.5-Omni on the tiny seeded checkpoint: the recipe, and the thinker stage against transformers.

transformers' ``Qwen2_5OmniForConditionalGeneration`` loads the same directory in this process and
is the reference: the thinker stage (vLLM's own thinker model in a real stage process, fed text,
audio and an image through vLLM's multimodal processor) must give its greedy ids, with logprobs
within 1e-4.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch

from omni_engine.config import (
    load_pipeline_config,
    parse_pipeline_config,
    read_pipeline_yaml,
)
from omni_engine.connectors.shm import SHM_DIR
from omni_engine.engines.hidden_states import configure_request_tap
from omni_engine.engines.mm_prompt import audio_items, vllm_prompt
from omni_engine.errors import StageRequestError
from omni_engine.inputs import OmniTextPrompt
from omni_engine.models.check import ModelError
from omni_engine.models.prepare import MARKER_FILE, prepare_model
from omni_engine.models.qwen2_5_omni import checkpoint
from omni_engine.models.qwen2_5_omni.code2wav_chunks import CodeStream
from omni_engine.models.qwen2_5_omni.processor import VIDEO_UNSUPPORTED
from omni_engine.pipeline.stage_specs import prepare_models
from omni_engine.stage_output import SPOKEN_SECONDS
from tests.helpers import kill_and_wait_restarted
from tests.qwen_omni_reference import (
    MAX_TOKENS,
    PROMPTS,
    TALKER_TOKENS,
    chat,
    reference_codes,
    reference_generate,
    reference_run,
    reference_wav,
)
from tests.stress.checks import after_shutdown, wait_clean
from tests.stress.pipeline import REPO, start_pipeline

OMNI_CONFIG = REPO / "stage_configs" / "qwen2_5_omni.yaml"
LOGPROB_TOLERANCE = 1e-4
# Below this top-2 gap the two implementations' float32 sums may order the tokens either way.
TIE_GAP = 1e-3


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
        "from omni_engine.models import torchvision_free as t\n"
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

@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def thinker():
    """stage_configs/qwen2_5_omni.yaml: the thinker (handing its states on) and the talker. A
    request ends at the thinker (the text stage) unless it asks for the talker."""
    client = await start_pipeline(load_pipeline_config(OMNI_CONFIG))
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


async def _stage_final(client, kind, request_id):
    from vllm import SamplingParams

    text, data = PROMPTS[kind]
    prompt = OmniTextPrompt(prompt=text, multi_modal_data=dict(data)) if data else text
    final = None
    async for output in client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0,
                                                               ignore_eos=True), request_id,
                                        final_stage_id=0):
        final = output
    return final


async def _stage_run(client, kind, request_id):
    completion = (await _stage_final(client, kind, request_id)).outputs[0]
    return list(completion.token_ids), [step[token].logprob for token, step in
                                        zip(completion.token_ids, completion.logprobs)]


@pytest.mark.parametrize("kind", ["text", "audio", "image"])
async def test_the_thinker_stage_gives_transformers_greedy_tokens(thinker, reference, kind):
    want, want_logprobs, gaps = reference_run(reference, kind)
    got, got_logprobs = await _stage_run(thinker, kind, f"thinker-{kind}")
    assert len(got) == MAX_TOKENS
    for step, (a, b, gap) in enumerate(zip(got, want, gaps)):
        if a != b:
            assert gap < TIE_GAP, f"step {step}: token {a} != transformers' {b} with a top-2 gap of {gap:.2e}"
            break  # a near tie went the other way: the two continuations differ from here on
        assert abs(got_logprobs[step] - want_logprobs[step]) <= LOGPROB_TOLERANCE, (
            f"step {step}: logprob {got_logprobs[step]} vs transformers' {want_logprobs[step]}")


@pytest.mark.parametrize("kind", ["text", "audio", "image"])
async def test_the_thinker_hands_on_transformers_embeddings_and_last_hidden_states(thinker, reference, kind):
    """What transformers' generate(return_audio=True) takes from the thinker for the talker:
    hidden_states[step][0] (input embeddings, audio features merged) and [-1] (last layer, after
    the norm), for every prompt position and each generated token but the last; and each one's
    rope position in its three channels, as the thinker's ``get_rope_index`` gives them (an image's
    tokens at their grid's T/H/W)."""
    inputs, out = reference_generate(reference, kind)
    final = await _stage_final(thinker, kind, f"states-{kind}")
    assert list(final.outputs[0].token_ids) == out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    want_embeds = torch.cat([step[0][0] for step in out.hidden_states])
    want_hidden = torch.cat([step[-1][0] for step in out.hidden_states])
    prompt_len = inputs["input_ids"].shape[1]
    assert want_embeds.shape == (prompt_len + MAX_TOKENS - 1, 64)
    got = final.multimodal_output
    assert got["input_embeds"].shape == want_embeds.shape and got["hidden_states"].shape == want_hidden.shape
    torch.testing.assert_close(got["input_embeds"], want_embeds, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["hidden_states"], want_hidden, rtol=1e-4, atol=1e-4)
    ids = inputs["input_ids"]
    audio_lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    positions, delta = reference[0].thinker.get_rope_index(ids, inputs.get("image_grid_thw"), None, torch.ones_like(ids),
                                                           audio_seqlens=audio_lengths)
    generated = (torch.arange(prompt_len, prompt_len + MAX_TOKENS - 1) + delta[0]).view(1, -1).expand(3, -1)
    want_positions = torch.cat([positions[:, 0], generated], dim=1).T.float()
    torch.testing.assert_close(got["positions"], want_positions, rtol=0, atol=0)


async def test_requests_batched_together_each_get_their_own_states(thinker):
    """Rows move and slots are reused as requests join and leave the batch: each request's states
    are still its own (as it gets them alone)."""
    alone = {kind: await _stage_final(thinker, kind, f"alone-{kind}") for kind in PROMPTS}
    together = await asyncio.gather(*(_stage_final(thinker, kind, f"together-{kind}-{i}")
                                      for i in range(2) for kind in PROMPTS))
    for i, final in enumerate(together):
        kind = list(PROMPTS)[i % len(PROMPTS)]
        want = alone[kind].multimodal_output
        assert list(final.outputs[0].token_ids) == list(alone[kind].outputs[0].token_ids), kind
        for key in ("input_embeds", "hidden_states"):
            got = final.multimodal_output[key]
            assert got.shape == want[key].shape, (kind, key)
            torch.testing.assert_close(got, want[key], rtol=1e-4, atol=1e-4, msg=f"{kind} {key}")


async def test_an_aborted_request_leaves_no_states_behind(thinker):
    from vllm import SamplingParams

    async def partial():
        async for _ in thinker.generate(chat("Tell me a story."), SamplingParams(max_tokens=400, ignore_eos=True),
                                        "states-aborted", final_stage_id=0):
            return

    await partial()
    assert not await wait_clean(thinker)
    left = [p.name for p in SHM_DIR.glob("omni_*_states*")]
    assert not left, f"state files left after an abort: {left}"


def test_the_request_tap_turns_prefix_caching_off_and_refuses_it_on():
    args = {"model": "m", "engine_output_type": "latent", "logits_processors": ["a.b:C"]}
    assert configure_request_tap(3, args) == (True, None)
    assert args == {"model": "m", "enable_prefix_caching": False,
                    "logits_processors": ["a.b:C", "omni_engine.models.request_tap:RequestTap"]}
    talker = {"request_adapter": "x.y:Z"}
    assert configure_request_tap(3, talker) == (False, "x.y:Z")
    assert talker == {"enable_prefix_caching": False, "logits_processors": ["omni_engine.models.request_tap:RequestTap"]}
    with pytest.raises(ValueError, match=r"stage 3: engine_args.enable_prefix_caching must be false"):
        configure_request_tap(3, {"engine_output_type": "latent", "enable_prefix_caching": True})
    with pytest.raises(ValueError, match=r"engine_output_type must be 'text' or 'latent', got 'audio'"):
        configure_request_tap(3, {"engine_output_type": "audio"})
    plain = {"model": "m"}
    assert configure_request_tap(3, plain) == (False, None) and plain == {"model": "m"}


async def test_a_video_is_refused_by_name_and_the_stage_serves_on(thinker):
    prompt = OmniTextPrompt(prompt=chat("<|vision_bos|><|VIDEO|><|vision_eos|>Describe it."),
                            multi_modal_data={"video": np.zeros((4, 56, 56, 3), np.uint8)})
    with pytest.raises(StageRequestError) as caught:
        await _stage_run(thinker, "text", "warm-up")  # the stage answers before
        async for _ in thinker.generate(prompt, None, "thinker-video", final_stage_id=0):
            pass
    message = str(caught.value)
    assert "request 'thinker-video'" in message and "(parameter=video)" in message
    assert VIDEO_UNSUPPORTED in message
    assert not await wait_clean(thinker), "the refused request left state behind"
    got, _ = await _stage_run(thinker, "text", "after-video")
    assert len(got) == MAX_TOKENS


# ---------------------------------------------------------------- the talker stage

def _talker_params(voice=None, logprobs=None, delta=False):
    """Greedy thinker and talker params; ``delta``: the talker streams deltas (as the family's
    config has it), else cumulative outputs (vLLM's default): code2wav's edge takes either."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE
    return {0: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            1: SamplingParams(temperature=0.0, max_tokens=TALKER_TOKENS, repetition_penalty=1.05,
                              stop_token_ids=[8292, 8294], detokenize=False, logprobs=logprobs,
                              extra_args={"voice": voice} if voice else None, output_kind=kind)}


async def _talker_codes(client, kind, request_id, voice=None):
    text, data = PROMPTS[kind]
    prompt = OmniTextPrompt(prompt=text, multi_modal_data=dict(data)) if data else text
    final = None
    async for output in client.generate(prompt, _talker_params(voice), request_id, final_stage_id=1):
        final = output
    codes = list(final.outputs[0].token_ids)
    return codes[:-1] if codes and codes[-1] in (8292, 8294) else codes


@pytest.mark.parametrize(("kind", "voice"), [("text", None), ("audio", "Ethan"), ("image", None)])
async def test_the_talker_stage_gives_transformers_codes(thinker, reference, kind, voice):
    want = reference_codes(reference, kind, voice or "Chelsie")
    got = await _talker_codes(thinker, kind, f"talker-{kind}", voice)
    assert len(want) > 5
    assert got == want


def test_the_talker_places_its_rows_as_transformers_talker_rope_does(reference):
    """The talker's three rope channels for a batch of an image request (prefill and a decode step)
    and a text request, from the thinker's positions (the talker adapter's ``rope_prompt``,
    ``rope_from``): transformers' talker ``get_rope_index`` positions for the same rows. (The tiny
    talker's greedy codes do not change with plain positions: this is what guards its rope.)"""
    from omni_engine.models.qwen2_5_omni.talker_requests import TalkerRequests
    from omni_engine.models.talker_rope import talker_rope_channels

    model = reference[0]
    adapter = TalkerRequests.__new__(TalkerRequests)
    adapter.stage_id = 1
    rows, segments, want = [], [], []
    for kind, decode_steps in (("image", 2), ("text", 1)):
        inputs, out = reference_generate(reference, kind)
        ids = inputs["input_ids"]
        thinker_positions, _ = model.thinker.get_rope_index(ids, inputs.get("image_grid_thw"), None, torch.ones_like(ids))
        rope = adapter.rope_positions({"thinker_positions": thinker_positions[:, 0].T.float()}, ids.shape[1], kind)
        bos = torch.tensor([[model.speaker_map["Chelsie"]["bos_token"]]])
        text_ids = torch.cat([ids, bos, out.sequences[:, ids.shape[1]:][:, :1]], dim=1)
        talker_positions, delta = model.talker.get_rope_index(text_ids, inputs.get("image_grid_thw"), None,
                                                              torch.ones_like(text_ids))
        length = text_ids.shape[1]  # L + 2 prompt rows, then decode rows at position + delta
        decode = torch.arange(length, length + decode_steps) + delta[0]
        want.append(torch.cat([talker_positions[:, 0], decode.view(1, -1).expand(3, -1)], dim=1))
        begin = sum(len(r) for r in rows)
        rows.append(torch.arange(length + decode_steps))
        segments.append((begin, begin + length + decode_steps, rope))
    if not (want[0][0] != want[0][1]).any():
        pytest.fail("the image prompt's positions are plain: the test would not see a wrong rope")
    got = talker_rope_channels(torch.cat(rows), [(b, e, r["rope_prompt"], int(r["rope_from"][0])) for b, e, r in segments])
    torch.testing.assert_close(got, torch.cat(want, dim=1), rtol=0, atol=0)


async def test_sampling_params_list_given_by_name_reaches_each_stage(thinker):
    """vLLM-Omni's ``generate(..., sampling_params_list=[...])`` keyword: each entry is its stage's
    params (it went with vLLM's unused extras before, and every stage ran its defaults); given
    beside ``sampling_params`` it is refused, naming both."""
    from vllm import SamplingParams

    final = None
    async for output in thinker.generate(PROMPTS["text"][0], None, "params-list-by-name", final_stage_id=1,
                                         sampling_params_list=[SamplingParams(temperature=0.0, max_tokens=3),
                                                               _talker_params()[1]]):
        final = output
    assert 0 < len(final.outputs[0].token_ids) <= TALKER_TOKENS
    async for output in thinker.generate(PROMPTS["text"][0], None, "params-list-thinker", final_stage_id=0,
                                         sampling_params_list=[SamplingParams(temperature=0.0, max_tokens=3)]):
        final = output
    assert len(final.outputs[0].token_ids) == 3  # (the stage's default: 128)
    with pytest.raises(TypeError, match="both sampling_params and sampling_params_list"):
        async for _ in thinker.generate(PROMPTS["text"][0], SamplingParams(max_tokens=3), "params-both",
                                        sampling_params_list=[None]):
            pass
    assert not await wait_clean(thinker)


async def test_an_unknown_voice_is_refused_by_name_and_nothing_is_left(thinker):
    with pytest.raises(StageRequestError, match=r"unknown voice 'Nobody'; this checkpoint's voices: Chelsie, Ethan"):
        await _talker_codes(thinker, "text", "talker-nobody", voice="Nobody")
    assert not await wait_clean(thinker)
    assert not list(SHM_DIR.glob("omni_*_talker*")), "a talker inputs file was left"


def test_model_stage_is_resolved_by_the_checkpoint_s_family_or_refused_by_field(omni_dir, tmp_path):
    config = prepare_models(load_pipeline_config(OMNI_CONFIG))
    talker = config.stage_args[1].engine_args
    assert "model_stage" not in talker and talker["request_adapter"].endswith("talker_requests:TalkerRequests")
    assert json.loads((Path(talker["hf_config_path"]) / "config.json").read_text())["architectures"] == [
        "OmniEngineQwen2_5OmniTalker"]
    assert config.stage_args[0].engine_args["hf_overrides"] == {"architectures": ["OmniEngineQwen2_5OmniThinker"]}
    alone = prepare_models(load_pipeline_config(REPO / "stage_configs" / "qwen2_5_omni_thinker.yaml"))
    assert alone.stage_args[0].engine_args["hf_overrides"] == {"architectures": ["OmniEngineQwen2_5OmniThinker"]}
    data = read_pipeline_yaml(OMNI_CONFIG)
    data["stage_args"][1]["engine_args"]["model_stage"] = "singer"
    with pytest.raises(ModelError, match=r"stage_args\[1\].engine_args.model_stage: unknown model_stage 'singer'"):
        prepare_models(parse_pipeline_config(data, "omni.yaml"))
    mute = tmp_path / "mute"
    mute.mkdir()
    for f in omni_dir.iterdir():
        if f.name != "spk_dict.pt":
            (mute / f.name).symlink_to(f)
    data = read_pipeline_yaml(OMNI_CONFIG)
    for stage in data["stage_args"]:
        stage["engine_args"]["model"] = str(mute)
    with pytest.raises(ModelError, match=r"stage_args\[1\].engine_args.model_stage: .*mute: no spk_dict.pt"):
        prepare_models(parse_pipeline_config(data, "omni.yaml"))
    # A config whose placeholder ids are not the tokenizer's: refused before anything starts.
    (mute / "config.json").unlink()
    config_json = json.loads((omni_dir / "config.json").read_text())
    config_json["thinker_config"]["audio_token_index"] = 151650
    (mute / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(ModelError, match=r"stage_args\[0\].engine_args.model_stage: .*thinker_config.audio_token_index "
                                         r"is 151650 but the tokenizer has <\|AUDIO\|> at 151646"):
        prepare_models(parse_pipeline_config(data, "omni.yaml"))


async def _talker_along(client, params, request_id, mode):
    """The talker's codes (its final output's, the stop code cut) and the order of the thinker's and
    the talker's outputs."""
    order, codes = [], None
    async for output in client.generate(PROMPTS["text"][0], params, request_id, final_stage_id=[0, 1],
                                        execution_mode=mode):
        order.append((output.stage_id, output.finished))
        if output.stage_id == 1 and output.finished:
            codes = np.asarray(output.multimodal_output["codes"])
    return codes, order


@pytest.mark.parametrize(("thinker_tokens", "talker_tokens"), [(64, 8), (6, 40)])
@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 7)])
async def test_the_talker_starts_on_the_thinker_s_first_states_and_makes_the_codes_it_makes_after_it(
        thinker, thinker_tokens, talker_tokens, temperature, seed):
    """async_chunk: the talker is fed the thinker's states as the thinker writes them, never running
    ahead of the text it speaks (code k needs reply token k), and makes every code it makes when it
    starts after the thinker (sequential), greedy and sampled with a seed: where it stops long before
    the thinker (its first codes come before the thinker's last token; the later states are dropped
    for it), and where it speaks on past the reply (the text eos row once the reply is whole)."""
    from vllm import SamplingParams

    params = {0: SamplingParams(temperature=0.0, max_tokens=thinker_tokens, ignore_eos=True),
              1: SamplingParams(temperature=temperature, seed=seed, max_tokens=talker_tokens, min_tokens=talker_tokens,
                                repetition_penalty=1.05, stop_token_ids=[8292, 8294], detokenize=False,
                                output_kind=_talker_params(delta=True)[1].output_kind)}
    case = f"{thinker_tokens}-{talker_tokens}-{temperature}"
    want, _ = await _talker_along(thinker, params, f"talker-after-{case}", "sequential")
    codes, order = await _talker_along(thinker, params, f"talker-along-{case}", "async_chunk")
    np.testing.assert_array_equal(codes, want)
    assert len(codes) == talker_tokens, len(codes)
    if thinker_tokens > talker_tokens:
        first_talker = next(i for i, (sid, _) in enumerate(order) if sid == 1)
        assert first_talker < order.index((0, True)), f"the talker began after the thinker had finished: {order}"
    assert not await wait_clean(thinker)


# ---------------------------------------------------------------- code2wav and the whole pipeline

async def _speech(client, kind, request_id, voice=None, execution_mode=None):
    """The pipeline's final outputs for a chat that asks for speech: the thinker's text, the audio
    (its pieces joined: one per window of codes where the talker -> code2wav edge streams)."""
    text, data = PROMPTS[kind]
    prompt = OmniTextPrompt(prompt=text, multi_modal_data=dict(data)) if data else text
    finals, pieces = {}, []
    params = _talker_params(voice, delta=execution_mode == "async_chunk")
    async for output in client.generate(prompt, params, request_id, final_stage_id=[0, 2],
                                        execution_mode=execution_mode):
        if output.stage_id == 2 and "audio" in output.multimodal_output:
            pieces.append(output.multimodal_output)
        if output.finished:
            finals[output.stage_id] = output
    assert 2 in finals and pieces, f"request {request_id}: no speech"
    audio = {"audio": np.concatenate([p["audio"] for p in pieces]), "sample_rate": pieces[0]["sample_rate"],
             "pieces": len(pieces)}
    return list(finals[0].outputs[0].token_ids), audio


@pytest.mark.parametrize(("kind", "voice", "mode"), [("audio", None, "async_chunk"), ("text", "Ethan", "sequential")])
async def test_speech_end_to_end_equals_transformers(thinker, reference, kind, voice, mode):
    """Thinker ids, talker codes and code2wav's waveform, each as transformers makes it: whole
    (``sequential``), or streamed in pieces whose joined audio is the whole's (``async_chunk``:
    on this checkpoint within float error, as its DiT's cross-frame attention is weak; on the
    published one the windows' borders differ as Qwen's own streaming token2wav does)."""
    want_text, _, _ = reference_run(reference, kind)
    codes = reference_codes(reference, kind, voice or "Chelsie")
    want = reference_wav(reference, codes, voice or "Chelsie")
    text, audio = await _speech(thinker, kind, f"speech-{kind}", voice, mode)
    assert text == want_text
    assert audio["sample_rate"] == 24000
    assert audio["audio"].shape == (len(codes) * 2 * 240,) == want.shape
    # streamed: the first piece is one DiT block (12 codes), sent once two are known; the next
    # would need 60 codes known (3 blocks and one of look-ahead), so the rest comes at the end
    assert 24 <= len(codes) < 60, len(codes)
    assert audio["pieces"] == (1 if mode == "sequential" else 2), audio["pieces"]
    assert float(np.abs(audio["audio"]).max()) > 0.05, "silent"
    np.testing.assert_allclose(audio["audio"], want, atol=1e-4, rtol=0)


def test_the_vocoder_reads_the_frames_its_measured_context_says_and_no_more(omni_dir):
    """BigVGAN on a piece's mel frames and ``vocoder_context`` either side gives the piece's samples
    of a pass over the whole mel; with a third of that context it does not."""
    from omni_engine.models.qwen2_5_omni.code2wav import Code2Wav

    model = Code2Wav(model=str(omni_dir))
    mel = torch.randn(1, 80, 120, generator=torch.Generator().manual_seed(4))
    hop = model.hop

    def piece(context):
        with torch.no_grad():
            audio = model.vocoder(mel[..., 50 - context:70 + context]).reshape(-1)
        return audio[context * hop:(context + 20) * hop].numpy()

    with torch.no_grad():
        whole = model.vocoder(mel).reshape(-1)[50 * hop:70 * hop].numpy()
    assert 1 <= model.vocoder_context < 48  # within a window's past (two DiT blocks of mel frames)
    # float error only: a shorter pass sums in another order (up to 1.3e-5 measured on an AVX2 EPYC,
    # under 1e-5 on AVX-512 machines); a piece short of context is off by over 1e-3
    np.testing.assert_allclose(piece(model.vocoder_context), whole, atol=5e-5, rtol=0)
    assert float(np.abs(piece(model.vocoder_context // 3) - whole).max()) > 1e-3


def test_the_vocoder_gives_transformers_bigvgan_waveform(omni_dir):
    """code2wav's BigVGAN (``code2wav_vocoder``: the anti-aliased activations as shifted sums, in a
    buffer with their padding) gives transformers' waveform for a batch of mels, within float error."""
    from omni_engine.models.qwen2_5_omni.code2wav import load_token2wav
    from omni_engine.models.qwen2_5_omni.code2wav_vocoder import Vocoder

    bigvgan = load_token2wav(str(omni_dir)).code2wav_bigvgan_model
    mel = torch.randn(3, 80, 40, generator=torch.Generator().manual_seed(5)) - 4
    with torch.no_grad():
        want = bigvgan(mel).reshape(3, -1)
    got = Vocoder(bigvgan)(mel)
    assert got.shape == want.shape == (3, 40 * 240)
    assert float(want.abs().max()) > 0.05, "silent"
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("length", [1, 2, 7, 300])
def test_an_anti_aliased_activation_equals_transformers_at_every_length(length):
    """One activation against transformers' module with SnakeBeta parameters away from their zero
    init: the phases' taps, the clamped reads at both ends (a signal of one sample included)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniAntiAliasedActivation1d,
        Qwen2_5OmniSnakeBeta,
    )

    from omni_engine.models.qwen2_5_omni.code2wav_vocoder import AntiAliasedSnake

    generator = torch.Generator().manual_seed(length)
    module = Qwen2_5OmniAntiAliasedActivation1d(activation=Qwen2_5OmniSnakeBeta(5))
    with torch.no_grad():
        module.act.alpha.copy_(torch.randn(5, generator=generator))
        module.act.beta.copy_(torch.randn(5, generator=generator))
        x = torch.randn(2, 5, length, generator=generator) * 3
        want = module(x)
    got = AntiAliasedSnake(module)(x)
    assert got.shape == want.shape == (2, 5, length)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


async def _render(client, prompt, request_id):
    """code2wav's audio for one prompt sent to its stage (stage 2) alone."""
    pieces = [o.multimodal_output["audio"] async for o in client.generate(
        prompt, None, request_id, entry_stage_id=2, final_stage_id=2) if "audio" in o.multimodal_output]
    return np.concatenate(pieces)


async def test_long_speech_streamed_in_windows_joins_into_the_whole(thinker, reference, omni_dir):
    """150 codes cut as the talker -> code2wav edge cuts them (fed a few at a time): windows that
    start past the first code (their noise is the whole's rows from there), interior windows of
    equal length (rendered together in the stage), the rest at the end. Joined, the pieces' audio
    is the whole's, which is transformers'."""
    config = json.loads((omni_dir / "config.json").read_text())
    rng = np.random.default_rng(5)
    codes = rng.integers(0, config["token2wav_config"]["dit_config"]["num_embeds"], 150).astype(np.int64)
    stream, pieces = CodeStream(), []
    for at in range(0, len(codes), 7):
        pieces += stream.add(codes[at:at + 7], at, "Ethan")
    pieces += stream.finish(codes, "Ethan")
    assert [(p["offset"], len(p["codes"]), p["emit"]) for p in pieces] == [
        (0, 24, [0, 12]), (0, 60, [12, 48]), (24, 72, [48, 84]), (60, 72, [84, 120]), (96, 54, [120, 150])]
    # Each piece states the seconds it speaks (50 codes a second), which the playback clock orders by.
    assert [p[SPOKEN_SECONDS] for p in pieces] == pytest.approx([0.24, 0.72, 0.72, 0.72, 0.6])
    whole, *parts = await asyncio.gather(_render(thinker, {"codes": codes, "voice": "Ethan"}, "whole"),
                                         *(_render(thinker, p, f"piece-{k}") for k, p in enumerate(pieces)))
    np.testing.assert_allclose(whole, reference_wav(reference, list(codes), "Ethan"), atol=1e-4, rtol=0)
    assert [len(p) for p in parts] == [(b - a) * 2 * 240 for a, b in (p["emit"] for p in pieces)]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-4, rtol=0)
    assert not await wait_clean(thinker)


async def test_a_talker_fed_in_parts_ends_on_its_last_code_so_the_rest_of_the_speech_is_one_piece(thinker):
    """The output on which a talker fed in parts ends is its final one, its last code in it: the
    edge knows then that no code follows and renders everything not yet spoken as one window (60
    codes: [0, 12) once 24 were known, then [12, 60)). A final output after the last code's partial
    left the edge cutting [12, 48) when the 60th came, then [48, 60) again from 36 codes."""
    from vllm import SamplingParams

    params = {0: SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16),
              1: SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60, stop_token_ids=[8292, 8294],
                                detokenize=False, output_kind=_talker_params(delta=True)[1].output_kind)}
    talker, pieces = [], []
    async for output in thinker.generate(PROMPTS["text"][0], params, "ends-on-its-last-code", final_stage_id=[1, 2],
                                         execution_mode="async_chunk"):
        if output.stage_id == 1:
            talker.append((len(output.outputs[0].token_ids), output.finished))
        elif "audio" in output.multimodal_output:
            pieces.append(len(output.multimodal_output["audio"]) // (2 * 240))
    assert talker[-1][1] and talker[-1][0] >= 1, f"the final output has no code of its own: {talker[-3:]}"
    assert sum(n for n, _ in talker) == 60
    assert pieces == [12, 48], pieces
    assert not await wait_clean(thinker)


async def test_a_window_that_does_not_fit_is_refused_by_field_and_the_stage_serves_on(thinker):
    codes = np.arange(30, dtype=np.int64)
    with pytest.raises(StageRequestError, match=r"request 'misfit'.*offset 6 and emit \[6, 30\) do not fit 30 codes"
                                                r".*multiple of the DiT block, 12 codes"):
        await _render(thinker, {"codes": codes, "offset": 6, "emit": [6, 30]}, "misfit")
    with pytest.raises(StageRequestError, match=r"request 'beyond'.*offset 0 and emit \[0, 31\) do not fit"):
        await _render(thinker, {"codes": codes, "emit": [0, 31]}, "beyond")
    assert len(await _render(thinker, {"codes": codes, "emit": [12, 24]}, "fits")) == 12 * 2 * 240


async def test_a_request_aborted_while_the_talker_speaks_frees_every_stage(thinker):
    from vllm import SamplingParams

    params = _talker_params()
    params[1] = SamplingParams(temperature=0.9, max_tokens=3000, ignore_eos=True, detokenize=False)
    text = PROMPTS["text"][0]
    in_talker, inputs_files = {}, []
    async with asyncio.timeout(60):
        async for output in thinker.generate(text, params, "speech-aborted", final_stage_id=[0, 2]):
            if output.stage_id == 0 and output.finished:
                await asyncio.sleep(0.5)
                talker = thinker.stage_contexts[1].client
                in_talker = await talker.call_each_replica_async("num_unfinished_requests", call_timeout=10)
                inputs_files = list(SHM_DIR.glob("omni_*_s1_talker*"))
                break  # closing the stream aborts the request where it is: in the talker
    assert sum(in_talker.values()) == 1, f"the talker was not speaking it: {in_talker}"
    # While it spoke, its inputs file (and its reply rows' files beside it, fed in parts) bore the
    # talker stage's segment prefix (a dead stage's are removed by it).
    assert len({p.name.split(".")[0] for p in inputs_files}) == 1, inputs_files
    assert not await wait_clean(thinker), "state left after an abort in the talker"
    left = [p.name for p in SHM_DIR.glob("omni_*_states*")] + [p.name for p in SHM_DIR.glob("omni_*_talker*")]
    assert not left, f"files left after an abort in the talker: {left}"


async def test_concurrent_speech_requests_each_give_what_they_give_alone(thinker):
    alone = {kind: await _speech(thinker, kind, f"alone-speech-{kind}") for kind in ("text", "audio")}
    together = await asyncio.gather(*(_speech(thinker, kind, f"together-speech-{kind}-{i}")
                                      for i in range(2) for kind in ("text", "audio")))
    for i, (text, audio) in enumerate(together):
        kind = ("text", "audio")[i % 2]
        assert text == alone[kind][0], kind
        np.testing.assert_allclose(audio["audio"], alone[kind][1]["audio"], atol=1e-4, rtol=0, err_msg=kind)
    assert not await wait_clean(thinker)


async def test_a_killed_talker_is_restarted_and_speaks_as_before(thinker):
    """The family's config restarts a stage that dies (``restart: on-failure``): the talker, killed
    while idle, comes back in a new process and gives the same speech for the same request."""
    before = await _speech(thinker, "text", "before-kill")
    await kill_and_wait_restarted(thinker, 1)
    after = await _speech(thinker, "text", "after-kill")
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1]["audio"], before[1]["audio"])
    assert not await wait_clean(thinker)
