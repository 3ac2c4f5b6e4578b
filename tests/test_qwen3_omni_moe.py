"""Qwen3-Omni-MoE on the tiny seeded checkpoint: the recipe, and the thinker stage against transformers.

transformers' ``Qwen3OmniMoeForConditionalGeneration`` loads the same directory in this process and
is the reference: the thinker stage (vLLM's own MoE thinker in a real stage process, fed text, audio
and an image through vLLM's multimodal processor) must give its greedy ids with logprobs within
1e-4, and hand on what transformers' ``generate`` hands Qwen3-Omni's talker: each position's input
embedding and its hidden state after ``talker_config.accept_hidden_layer`` layers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil

import numpy as np
import pytest
import pytest_asyncio
import torch

from omni_engine.config import load_pipeline_config
from omni_engine.connectors.shm import SHM_DIR
from omni_engine.errors import StageRequestError
from omni_engine.inputs import OmniTextPrompt
from omni_engine.models.families import resolve_model_stage
from omni_engine.models.prepare import MARKER_FILE, prepare_model
from omni_engine.models.qwen3_omni_moe import tiny_config as tc
from omni_engine.models.qwen3_omni_moe.processor import VIDEO_UNSUPPORTED
from tests.helpers import kill_and_wait_restarted
from tests.qwen3_omni_reference import PROMPTS, chat, load_reference, reference_speech
from tests.qwen_omni_reference import reference_generate, reference_run
from tests.stress.checks import after_shutdown, wait_clean
from tests.stress.pipeline import REPO, start_pipeline

OMNI_CONFIG = REPO / "stage_configs" / "qwen3_omni_moe.yaml"
MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
TIE_GAP = 1e-3  # below this top-2 gap the two implementations' float32 sums may order the tokens either way


@pytest.fixture(scope="module")
def qwen3_dir():
    return prepare_model("qwen3-omni-tiny")


@pytest.fixture(scope="module")
def qwen3_reference(qwen3_dir):
    return load_reference(qwen3_dir)


def _digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != MARKER_FILE}


def test_the_tiny_checkpoint_has_the_published_layout_and_rebuilds_to_the_same_bytes(qwen3_dir, tmp_path):
    assert {p.name for p in qwen3_dir.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "preprocessor_config.json",
        "chat_template.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json", MARKER_FILE}
    rebuilt = prepare_model("qwen3-omni-tiny", cache_dir=tmp_path)
    assert _digests(rebuilt) == _digests(qwen3_dir)
    config = json.loads((qwen3_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert set(config) >= {"thinker_config", "talker_config", "code2wav_config"}
    talker = config["talker_config"]
    # the published ids: a stage config written for the 30B checkpoint holds for the tiny one
    assert (talker["codec_eos_token_id"], talker["speaker_id"]) == (2150, {"chelsie": 2301, "ethan": 2302, "aiden": 2303})
    assert talker["num_code_groups"] == config["code2wav_config"]["num_quantizers"] == 4
    assert talker["accept_hidden_layer"] < config["thinker_config"]["text_config"]["num_hidden_layers"]
    preprocessor = json.loads((qwen3_dir / "preprocessor_config.json").read_text())
    assert preprocessor["processor_class"] == "Qwen3OmniMoeProcessor"


def test_the_tokenizer_spells_qwen3_omni_s_special_tokens_at_the_config_s_ids(qwen3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir))
    config = json.loads((qwen3_dir / "config.json").read_text())
    thinker = config["thinker_config"]
    for token, token_id in (("<|audio_pad|>", thinker["audio_token_id"]), ("<|image_pad|>", thinker["image_token_id"]),
                            ("<|video_pad|>", thinker["video_token_id"]),
                            ("<|audio_start|>", thinker["audio_start_token_id"]),
                            ("<|vision_start|>", thinker["vision_start_token_id"]),
                            ("<tts_pad>", config["tts_pad_token_id"]), ("<tts_text_bos>", config["tts_bos_token_id"]),
                            ("<tts_text_eod>", config["tts_eos_token_id"]), ("<|im_start|>", config["im_start_token_id"])):
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
        assert tokenizer.encode(token) == [token_id], f"{token} is not one special token"
    assert thinker["audio_token_id"] == 151675  # Qwen3's, not transformers' default (Qwen2.5's 151646)
    assert tokenizer.encode("Hello world") == [9707, 1879]  # Qwen2's BPE
    assert (tokenizer.audio_token, tokenizer.image_token) == ("<|audio_pad|>", "<|image_pad|>")


def test_the_chat_template_renders_parts_and_tools_as_qwen3_does(qwen3_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_dir))
    parts = [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}, {"type": "image", "image": "b.png"},
                                           {"type": "text", "text": "Hi"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False, add_generation_prompt=True) == chat(
        "<|audio_start|><|audio_pad|><|audio_end|><|vision_start|><|image_pad|><|vision_end|>Hi")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "sunny"}]
    text = tokenizer.apply_chat_template(turns, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text
    assert text.count("Be brief.") == 1


def test_transformers_speaks_with_the_tiny_checkpoint(qwen3_reference):
    model, processor = qwen3_reference
    inputs = processor(text=PROMPTS["text"][0], return_tensors="pt")
    with torch.no_grad():
        _, wav = model.generate(**inputs, speaker="ethan", thinker_max_new_tokens=4, thinker_do_sample=False,
                                talker_max_new_tokens=12, talker_do_sample=False)
    samples = wav.reshape(-1)
    frame = int(np.prod(model.config.code2wav_config.upsample_rates + model.config.code2wav_config.upsampling_ratios))
    assert frame == 1920  # 12.5 frames a second at 24 kHz, as published
    assert samples.numel() > 2 * frame
    rms = float(samples.pow(2).mean().sqrt())
    assert 0.02 < rms < 0.6, f"code2wav's RMS {rms}: silent or clamped"
    assert float((samples.abs() > 0.99).float().mean()) < 0.01, "samples on code2wav's clamp"


def test_a_checkpoint_whose_tokenizer_moves_a_placeholder_is_refused_by_name(qwen3_dir, tmp_path):
    broken = tmp_path / "moved"
    shutil.copytree(qwen3_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["thinker_config"]["audio_token_id"] = 151646  # transformers' default: Qwen2.5-Omni's id
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"thinker_config.audio_token_id is 151646 but the tokenizer has "
                                         r"<\|audio_pad\|> at 151675"):
        resolve_model_stage({"model": str(broken), "model_stage": "thinker"})
    with pytest.raises(ValueError, match=r"unknown model_stage 'speaker' for Qwen3-Omni-MoE; expected one of"):
        resolve_model_stage({"model": str(qwen3_dir), "model_stage": "speaker"})


# ---------------------------------------------------------------- the thinker stage

@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def omni():
    """stage_configs/qwen3_omni_moe.yaml: thinker, talker, code2wav; a request ends at the stage it
    asks for (``final_stage_id``), and in the execution mode it asks for (async_chunk by default).
    Its codec pieces keep to the plan (no pacing): these tests compare pieces' borders and audio
    across runs, and a paced piece's border depends on how fast the machine ran."""
    config = load_pipeline_config(OMNI_CONFIG)
    config.stage(2).custom_process_input_args["codec_chunk_pacing"] = False
    client = await start_pipeline(config)
    yield client
    await client.shutdown_async()
    assert not await after_shutdown(client)


@pytest.fixture
def thinker(omni):
    return omni


@pytest.fixture
def talker(omni):
    return omni


def _prompt(kind):
    text, data = PROMPTS[kind]
    return OmniTextPrompt(prompt=text, multi_modal_data=dict(data)) if data else text


async def _stage_final(client, kind, request_id):
    from vllm import SamplingParams

    final = None
    async for output in client.generate(_prompt(kind), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                        logprobs=0, ignore_eos=True),
                                        request_id, final_stage_id=0):
        final = output
    return final


@pytest.mark.parametrize("kind", ["text", "audio", "image"])
async def test_the_thinker_stage_gives_transformers_greedy_tokens(thinker, qwen3_reference, kind):
    want, want_logprobs, gaps = reference_run(qwen3_reference, kind, PROMPTS)
    completion = (await _stage_final(thinker, kind, f"thinker-{kind}")).outputs[0]
    got = list(completion.token_ids)
    got_logprobs = [step[token].logprob for token, step in zip(got, completion.logprobs)]
    assert len(got) == MAX_TOKENS
    for step, (a, b, gap) in enumerate(zip(got, want, gaps)):
        if a != b:
            assert gap < TIE_GAP, f"step {step}: token {a} != transformers' {b} with a top-2 gap of {gap:.2e}"
            break  # a near tie went the other way: the two continuations differ from here on
        assert abs(got_logprobs[step] - want_logprobs[step]) <= LOGPROB_TOLERANCE, (
            f"step {step}: logprob {got_logprobs[step]} vs transformers' {want_logprobs[step]}")


@pytest.mark.parametrize("kind", ["text", "audio", "image"])
async def test_the_thinker_hands_on_transformers_embeddings_and_accepted_hidden_states(thinker, qwen3_reference, kind):
    """What transformers' generate(return_audio=True) takes from the thinker for Qwen3's talker:
    hidden_states[step][0] (input embeddings, audio and image features merged) and
    [accept_hidden_layer] (that layer's output; not the last layer's), for every prompt position
    and each generated token but the last."""
    inputs, out = reference_generate(qwen3_reference, kind, PROMPTS)
    final = await _stage_final(thinker, kind, f"states-{kind}")
    assert list(final.outputs[0].token_ids) == out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    layer = qwen3_reference[0].config.talker_config.accept_hidden_layer
    want_embeds = torch.cat([step[0][0] for step in out.hidden_states])
    want_hidden = torch.cat([step[layer][0] for step in out.hidden_states])
    last_hidden = torch.cat([step[-1][0] for step in out.hidden_states])
    assert want_embeds.shape == (inputs["input_ids"].shape[1] + MAX_TOKENS - 1, tc.HIDDEN)
    got = final.multimodal_output
    torch.testing.assert_close(got["input_embeds"], want_embeds, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["hidden_states"], want_hidden, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got["hidden_states"], last_hidden, atol=1e-2), "the last layer's, not the accepted one"
    # the prompt rows' rope positions (an image's tokens at their grid's T/H/W), as transformers'
    ids = inputs["input_ids"]
    audio_lengths = inputs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in inputs else None
    positions, _ = qwen3_reference[0].thinker.get_rope_index(ids, inputs.get("image_grid_thw"), None,
                                                             torch.ones_like(ids), audio_seqlens=audio_lengths)
    torch.testing.assert_close(got["positions"][:ids.shape[1]], positions[:, 0].T.float(), rtol=0, atol=0)


async def test_a_video_is_refused_by_name_and_the_stage_serves_on(thinker):
    prompt = OmniTextPrompt(prompt=chat("<|vision_start|><|video_pad|><|vision_end|>Describe it."),
                            multi_modal_data={"video": np.zeros((4, 64, 64, 3), np.uint8)})
    await _stage_final(thinker, "text", "warm-up")  # the stage answers before
    with pytest.raises(StageRequestError) as caught:
        async for _ in thinker.generate(prompt, None, "thinker-video", final_stage_id=0):
            pass
    message = str(caught.value)
    assert "request 'thinker-video'" in message and "(parameter=video)" in message
    assert VIDEO_UNSUPPORTED in message
    assert not await wait_clean(thinker), "the refused request left state behind"
    assert len((await _stage_final(thinker, "text", "after-video")).outputs[0].token_ids) == MAX_TOKENS


# ---------------------------------------------------------------- the talker stage

TALKER_TOKENS = 16


def _talker_params(voice=None, temperature=0.0, seed=None, delta=False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return {0: SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            1: SamplingParams(temperature=temperature, top_k=50 if temperature else 0, seed=seed,
                              max_tokens=TALKER_TOKENS, repetition_penalty=1.05, stop_token_ids=[2150],
                              detokenize=False, extra_args={"voice": voice} if voice else None,
                              output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.CUMULATIVE)}


async def _talker_outputs(client, kind, request_id, **params):
    return [output async for output in client.generate(_prompt(kind), _talker_params(**params), request_id,
                                                       final_stage_id=1)]


@pytest.mark.parametrize(("kind", "voice"), [("text", "Ethan"), ("audio", "chelsie"), ("image", "ethan")])
async def test_the_talker_stage_gives_every_code_group_of_every_frame_as_transformers(talker, qwen3_reference,
                                                                                      kind, voice):
    """(The image's rows sit at its grid's T/H/W in the talker's interleaved multimodal rope.)"""
    want, _ = reference_speech(qwen3_reference, kind, voice.lower(), MAX_TOKENS, TALKER_TOKENS)
    outputs = await _talker_outputs(talker, kind, f"talker-{kind}", voice=voice)
    got = outputs[-1].multimodal_output["codes"]
    assert want.shape[0] == tc.CODE_GROUPS and want.shape[1] >= 4
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


async def test_streamed_frames_join_to_the_final_codes_and_each_voice_speaks_its_own(talker):
    outputs = await _talker_outputs(talker, "audio", "talker-stream", voice="chelsie", delta=True)
    final = outputs[-1].multimodal_output["codes"]
    pieces = [(o.multimodal_output["codes_offset"], o.multimodal_output["codes"]) for o in outputs[:-1]]
    joined = np.concatenate([codes for _, codes in pieces], axis=1) if pieces else np.zeros((tc.CODE_GROUPS, 0))
    assert [offset for offset, _ in pieces] == [sum(c.shape[1] for _, c in pieces[:i]) for i in range(len(pieces))]
    np.testing.assert_array_equal(joined, final[:, :joined.shape[1]])
    assert joined.shape[1] >= final.shape[1] - 1, "the partial outputs lag the frames by more than one step"
    other = (await _talker_outputs(talker, "audio", "talker-stream-ethan", voice="ethan"))[-1]
    # (in the tiny random talker, ethan's and aiden's rows happen to steer greedy decoding alike; chelsie's does not)
    assert not np.array_equal(other.multimodal_output["codes"][:, :4], final[:, :4]), "the voice changed nothing"


async def test_requests_batched_together_each_get_their_own_codes_and_a_seed_repeats_a_sampled_talker(talker):
    import asyncio

    alone = {kind: (await _talker_outputs(talker, kind, f"alone-{kind}"))[-1].multimodal_output["codes"]
             for kind in ("text", "audio")}
    together = await asyncio.gather(*(_talker_outputs(talker, kind, f"together-{kind}-{i}")
                                      for i in range(2) for kind in ("text", "audio")))
    for i, outputs in enumerate(together):
        np.testing.assert_array_equal(outputs[-1].multimodal_output["codes"], alone[("text", "audio")[i % 2]])
    sampled = [(await _talker_outputs(talker, "text", f"seeded-{i}", temperature=0.9, seed=42))[-1]
               for i in range(2)]
    first, second = (o.multimodal_output["codes"] for o in sampled)
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, alone["text"][:, :first.shape[1]]), "sampling changed nothing"


async def test_an_unknown_voice_is_refused_by_name_and_the_talker_serves_on(talker):
    with pytest.raises(StageRequestError, match=r"request 'talker-nobody'.*unknown voice 'Nobody'; "
                                                r"the voices are aiden, chelsie, ethan"):
        await _talker_outputs(talker, "text", "talker-nobody", voice="Nobody")
    assert not await wait_clean(talker), "a refused request left state behind"
    left = [p.name for p in SHM_DIR.glob("omni_*talker*")]
    assert not left, f"talker files left: {left}"
    assert (await _talker_outputs(talker, "text", "talker-after"))[-1].multimodal_output["codes"].shape[1] > 0


# ---------------------------------------------------------------- speech end to end

async def _speech(client, kind, request_id, mode, voice="ethan"):
    """The thinker's final output, the talker's codes, and the audio pieces code2wav sent."""
    finals, pieces = {}, []
    async for output in client.generate(_prompt(kind), _talker_params(voice, delta=True), request_id,
                                        final_stage_id=[0, 1, 2], execution_mode=mode):
        if output.stage_id == 2 and "audio" in output.multimodal_output:
            pieces.append(output.multimodal_output)
        if output.finished:
            finals[output.stage_id] = output
    assert 2 in finals and pieces, f"request {request_id}: no speech"
    return finals, pieces


def test_a_piece_s_convolutions_read_only_the_frames_they_need_and_give_the_whole_pass_s_samples(qwen3_dir):
    """code2wav decodes a piece's transformer over all its left context but its convolutions from
    ``decoder_context`` frames before the piece's own: the samples kept are those transformers'
    forward over every frame of the piece gives; with a third of that context they are not (the
    convolutions do read back that far; the measured context is the structural receptive field, of
    which the tiny checkpoint's ConvNeXt branches, scaled by 1e-6, make the last frames negligible)."""
    from omni_engine.models.qwen3_omni_moe.code2wav import Code2Wav

    model = Code2Wav(model=str(qwen3_dir))
    codes = torch.randint(0, tc.CODEBOOK_SIZE, (tc.CODE_GROUPS, 60), generator=torch.Generator().manual_seed(3))

    def whole_pass(piece, context):  # transformers' forward on the piece, its kept samples
        with torch.no_grad():
            wav = model.code2wav(piece[None])[0, 0]
        return wav[max(context * model.frame - model.tail, 0):piece.shape[1] * model.frame - model.tail].numpy()

    assert 1 <= model.decoder_context < 25
    for context, new in [(0, 4), (4, 4), (16, 16), (25, 25), (model.decoder_context + 2, 7)]:
        piece = codes[:, 30 - context:30 + new]
        with torch.no_grad():
            got = model.render([(piece, context), (piece.flip(1), context)])  # one pass for both
        np.testing.assert_allclose(got[0], whole_pass(piece, context), atol=1e-4, rtol=0, err_msg=f"context {context}")
        np.testing.assert_allclose(got[1], whole_pass(piece.flip(1), context), atol=1e-4, rtol=0)
    model.decoder_context //= 3
    with torch.no_grad():
        (short,) = model.render([(codes[:, 5:45], 25)])
    assert float(np.abs(short - whole_pass(codes[:, 5:45], 25)).max()) > 1e-2


def test_code2wav_is_handed_only_the_pieces_of_one_pass(qwen3_dir):
    """Pieces of one length and left context share a pass; the stage's batcher (``batch_key``) hands
    code2wav the earliest piece with only those, so a first piece never waits for other lengths'
    passes (``test_generation_engine``'s keyed batching). A prompt without codes goes alone."""
    from omni_engine.engines.generation_model import GenerationRequest
    from omni_engine.models.qwen3_omni_moe.code2wav import Code2Wav

    model = Code2Wav(model=str(qwen3_dir))

    def key(frames, context=None, as_tensor=False):
        codes = torch.zeros(tc.CODE_GROUPS, frames, dtype=torch.long)
        prompt = {"codes": codes if as_tensor else codes.numpy()}
        if context is not None:
            prompt["left_context"] = context
        return model.batch_key(GenerationRequest("r", prompt))

    assert key(4) == key(4, 0, as_tensor=True) == (4, 0)
    assert key(20, 10) == key(20, 10, as_tensor=True) != key(20, 9)
    assert len({key(4), key(8, 4), key(16, 12), key(20, 10)}) == 4
    # A piece whose convolutions see more than half a pass's frames goes alone (its request id keys it).
    assert key(41, 25) == (41, 25, "r") and key(28) == (28, 0, "r") and key(24) == (24, 0)
    with pytest.raises(KeyError):
        model.batch_key(GenerationRequest("r", {}))


def test_code2wav_passes_run_only_the_shapes_warmed_at_start(qwen3_dir):
    """oneDNN builds a convolution's kernels on the first pass of each input shape (~2x a later
    pass), so code2wav pads a piece to a multiple of ``LENGTH_STEP`` frames, passes 1, 2, 4 or 8
    pieces at a time, and makes those shapes at start: every piece of the default plan (ramped
    pieces, a last piece of any length, early pieces for a listener), 1 to 8 of them at once, then
    runs in shapes already made; a pass never holds more than ``pass_frames`` frames."""
    from omni_engine.models.qwen3_omni_moe.code2wav import Code2Wav, pass_sizes
    from omni_engine.models.qwen3_omni_moe.code2wav_chunks import CodecStream

    assert pass_sizes(7, 12) == [4, 2, 1] and pass_sizes(8, 3) == [2, 2, 2, 2] and pass_sizes(3, 0) == [1, 1, 1]
    assert pass_sizes(16, 100) == [8, 8] and pass_sizes(0, 4) == []
    model = Code2Wav(model=str(qwen3_dir))
    warmed = set(model.shapes)
    assert {(1, 4), (8, 4), (1, 36)} <= warmed
    codes = np.zeros((tc.CODE_GROUPS, 120), dtype=np.int64)
    pieces = CodecStream().finish(codes[:, :83])  # 4, 4, 8, 16, 25, 25, then the last 1
    stream = CodecStream()
    for end in (3, 9, 14, 40, 58):  # frames as a paced talker hands them, and early pieces of them
        pieces += stream.add(codes[:, :end], 0) + [stream.piece(end)]
    assert len({(p["codes"].shape[1], p["left_context"]) for p in pieces}) >= 10
    for piece in pieces:
        for count in range(1, 9):
            model.render([(torch.as_tensor(piece["codes"]), piece["left_context"])] * count)
    assert model.shapes == warmed, f"shapes made after start: {sorted(model.shapes - warmed)}"
    assert all(count * frames <= model.pass_frames or count == 1 for count, frames in model.shapes)
    assert not Code2Wav(model=str(qwen3_dir), warm_up=False).shapes


async def test_speech_end_to_end_equals_transformers_generate(omni, qwen3_reference):
    """Sequential: thinker ids, every code of every frame, and code2wav's waveform (one pass over
    all the frames), each as transformers' ``generate`` makes it."""
    want_codes, want_wav = reference_speech(qwen3_reference, "audio", "ethan", MAX_TOKENS, TALKER_TOKENS)
    finals, pieces = await _speech(omni, "audio", "speech-sequential", "sequential")
    np.testing.assert_array_equal(finals[1].multimodal_output["codes"], want_codes)
    assert len(pieces) == 1 and pieces[0]["sample_rate"] == 24000
    audio = pieces[0]["audio"]
    assert audio.shape == want_wav.shape == (want_codes.shape[1] * 1920 - 555,)
    assert float(np.abs(audio).max()) > 0.05, "silent"
    np.testing.assert_allclose(audio, want_wav, atol=1e-4, rtol=0)


async def test_async_chunk_streams_the_same_codes_in_pieces_from_the_first_four_frames(omni):
    """async_chunk: code2wav gets the first 4 frames as soon as the talker has made them, then pieces
    ramped up to 25 frames (4, 8, 16, then 25s) with 25 frames of left context; the codes are the
    sequential run's, the joined audio has its length, equals it exactly over the first piece (no
    context is cut there) and within 0.15 elsewhere (the pieces' decoder sees 25 frames back where the whole's transformer sees 72)."""
    sequential_finals, (whole,) = await _speech(omni, "audio", "speech-whole", "sequential")
    finals, pieces = await _speech(omni, "audio", "speech-chunked", "async_chunk")
    codes = finals[1].multimodal_output["codes"]
    np.testing.assert_array_equal(codes, sequential_finals[1].multimodal_output["codes"])
    frames = codes.shape[1]
    ends = [4]
    while ends[-1] < frames:
        ends.append(min(frames, ends[-1] + min(25, ends[-1])))
    assert frames > 4 and len(pieces) == len(ends)
    assert [p["audio"].shape[0] for p in pieces[1:-1]] == [(e - s) * 1920 for s, e in zip(ends, ends[1:-1])]
    assert pieces[0]["audio"].shape == (4 * 1920 - 555,)
    joined = np.concatenate([p["audio"] for p in pieces])
    assert joined.shape == whole["audio"].shape
    np.testing.assert_allclose(joined[:4 * 1920 - 555], whole["audio"][:4 * 1920 - 555], atol=1e-4, rtol=0)
    assert float(np.abs(joined - whole["audio"]).max()) < 0.15


async def _talker_codes(client, params, request_id, mode):
    """The talker's codes, and the order in which the thinker's and the talker's outputs came."""
    order, codes = [], None
    async for output in client.generate(_prompt("text"), params, request_id, final_stage_id=[0, 1],
                                        execution_mode=mode):
        order.append((output.stage_id, output.finished))
        made = output.multimodal_output
        if output.stage_id == 1 and "codes" in made and "codes_offset" not in made:  # the talker's final output
            codes = made["codes"]
    return codes, order


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 7)])
async def test_the_talker_starts_on_the_thinker_s_first_states_and_makes_the_codes_it_makes_after_it(
        omni, temperature, seed):
    """async_chunk: the talker is fed the thinker's states as the thinker writes them (never running
    ahead of the text it speaks): its first frames come before the thinker's last token, and every
    code of every frame is what it makes when it starts after the thinker (sequential), greedy and
    sampled with a seed (the sampler's draws go on across the parts). The talker here stops long
    before the thinker does: the thinker's later states are dropped for it; nothing is left."""
    from vllm import SamplingParams

    params = _talker_params(temperature=temperature, seed=seed, delta=True)
    params[0] = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    params[1].max_tokens = 8
    want, _ = await _talker_codes(omni, params, f"talker-after-{temperature}", "sequential")
    codes, order = await _talker_codes(omni, params, f"talker-along-{temperature}", "async_chunk")
    np.testing.assert_array_equal(codes, want)
    assert 0 < codes.shape[1] <= 7  # at most 8 codes: the last makes no frame
    first_talker = next(i for i, (sid, _) in enumerate(order) if sid == 1)
    assert first_talker < order.index((0, True)), f"the talker began after the thinker had finished: {order}"
    assert not await wait_clean(omni)


async def test_a_request_aborted_while_its_speech_streams_stops_the_talker_and_code2wav(omni):
    """A turn cut off once its first audio has come (a barge-in's abort, as realtime makes it): the
    talker, which had thousands of frames left, ends the request counted as aborted; code2wav is
    handed no piece after it; no stage keeps state or files."""
    from vllm import SamplingParams

    params = _talker_params()
    params[1] = SamplingParams(temperature=0.9, max_tokens=3000, ignore_eos=True, detokenize=False)
    metrics = omni.metrics
    aborted_before = {sid: metrics.stage(sid).aborted for sid in (1, 2)}
    in_talker = {}
    async with asyncio.timeout(60):
        async for output in omni.generate(_prompt("text"), params, "speech-cut-off", final_stage_id=[0, 2]):
            if output.stage_id == 2 and "audio" in output.multimodal_output:
                in_talker = await omni.stage_contexts[1].client.call_each_replica_async(
                    "num_unfinished_requests", call_timeout=10)
                break  # closing the stream aborts the request where it is
    assert sum(in_talker.values()) == 1, f"the talker was not speaking it: {in_talker}"
    pieces = metrics.stage(2).requests
    assert not await wait_clean(omni), "state left after an abort while speaking"
    assert metrics.stage(1).aborted == aborted_before[1] + 1
    await asyncio.sleep(0.5)
    assert metrics.stage(2).requests == pieces, "code2wav was handed pieces of an aborted request"
    assert metrics.stage(2).aborted >= aborted_before[2]
    left = [p.name for p in SHM_DIR.glob("omni_*_states*")] + [p.name for p in SHM_DIR.glob("omni_*talker*")]
    assert not left, f"files left after the abort: {left}"


async def test_concurrent_speech_requests_each_give_what_they_give_alone(omni):
    """Requests batched in every stage (the thinker's, the talker's and code2wav's batches) get
    each the codes and the audio it gets alone."""
    kinds = ("text", "audio", "text", "audio")
    alone = {kind: await _speech(omni, kind, f"alone-{kind}", "async_chunk") for kind in ("text", "audio")}
    together = await asyncio.gather(*(_speech(omni, kind, f"together-{i}", "async_chunk")
                                      for i, kind in enumerate(kinds)))
    for kind, (finals, pieces) in zip(kinds, together):
        want_finals, want_pieces = alone[kind]
        assert finals[0].outputs[0].token_ids == want_finals[0].outputs[0].token_ids, kind
        np.testing.assert_array_equal(finals[1].multimodal_output["codes"], want_finals[1].multimodal_output["codes"])
        np.testing.assert_allclose(np.concatenate([p["audio"] for p in pieces]),
                                   np.concatenate([p["audio"] for p in want_pieces]), atol=1e-4, rtol=0, err_msg=kind)
    assert not await wait_clean(omni)


async def test_a_killed_talker_is_restarted_and_speaks_as_before(omni):
    """The family's config restarts a stage that dies (``restart: on-failure``): the talker, killed
    while idle, comes back in a new process and gives the same codes and audio for the same request."""
    before, before_pieces = await _speech(omni, "text", "before-kill", "async_chunk")
    await kill_and_wait_restarted(omni, 1)
    after, after_pieces = await _speech(omni, "text", "after-kill", "async_chunk")
    np.testing.assert_array_equal(after[1].multimodal_output["codes"], before[1].multimodal_output["codes"])
    np.testing.assert_array_equal(np.concatenate([p["audio"] for p in after_pieces]),
                                  np.concatenate([p["audio"] for p in before_pieces]))
    assert not await wait_clean(omni)


async def test_completions_are_refused_with_the_reason_for_the_talker_s_pipeline(omni):
    """``POST /v1/completions`` on the route family the server registers, over this pipeline: 400
    with vLLM-Omni's reason (the talker takes its rows by chat turn), before anything is generated."""
    import httpx
    from fastapi import FastAPI

    from omni_engine.entrypoints.openai import completions

    app = FastAPI()
    app.include_router(completions.router)
    app.state.engine_client = omni
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        response = await http.post("/v1/completions", json={"model": "qwen3-omni", "prompt": "Hello", "max_tokens": 4})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["message"] == ("Qwen3-Omni requires chat template structure for thinker-talker handoff. "
                                "Use /v1/chat/completions instead.")
    assert completions.endpoint_refusal(omni, "/v1/chat/completions") is None


def test_the_talker_places_an_image_prompt_s_rows_as_transformers_talker_rope_does(qwen3_reference):
    """The talker's three rope channels for an image prompt with a system turn (dropped from the
    talker's rows, so its positions shift) from the thinker's positions: transformers' talker
    ``get_rope_index`` over its own rows (the user turn's ids, then 9 tts pad ids). (The tiny
    talker's greedy codes barely move with its rope: this is what guards it.)"""
    from omni_engine.models.qwen3_omni_moe.talker_requests import ASSISTANT_ROWS, talker_rope

    model, processor = qwen3_reference
    text = chat("<|vision_start|><|image_pad|><|vision_end|>Describe it.", system="Be brief.")
    inputs = processor(text=text, images=[PROMPTS["image"][1]["image"]], return_tensors="pt")
    ids, grid = inputs["input_ids"], inputs["image_grid_thw"]
    thinker_positions, _ = model.thinker.get_rope_index(ids, grid, None, torch.ones_like(ids))
    starts = (ids[0] == tc.IM_START_TOKEN_ID).nonzero().flatten().tolist()
    user = torch.arange(starts[1], starts[2])  # the user turn, up to the assistant's <|im_start|>
    got = talker_rope(thinker_positions[:, 0].T.float(), user)
    talker_ids = torch.cat([ids[0, user], torch.full((ASSISTANT_ROWS,), tc.TTS_PAD_TOKEN_ID)]).unsqueeze(0)
    want, _ = model.talker.get_rope_index(talker_ids, grid, None, torch.ones_like(talker_ids))
    assert bool((want[:, 0, :] != want[0, 0, :]).any()), "the image took no grid positions"
    torch.testing.assert_close(got["rope_prompt"], want[:, 0, :].to(torch.int64), rtol=0, atol=0)
    assert int(got["rope_from"][0]) == int(want.max()) + 1
