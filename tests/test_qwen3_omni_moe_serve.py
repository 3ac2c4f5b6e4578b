"""``omni-engine serve`` of a Qwen3-Omni-MoE checkpoint directory, called as OpenAI clients call it.

The server finds the family's pipeline (thinker -> talker -> code2wav, async_chunk) by the
checkpoint's architecture, with vLLM-Omni's own deploy file for the model over it (its codec chunk
sizes from its ``connectors:`` block). Chat with ``modalities: ["text", "audio"]`` must answer with
transformers' text and the waveform transformers' greedy talker and code2wav make; completions are
refused with the reason; realtime hears a spoken turn and answers in that speech.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from omni_engine.audio import decode_audio, encode_audio
from tests.qwen3_omni_reference import chat, load_reference, reference_speech
from tests.qwen_omni_reference import reference_run, tone
from tests.serve_helpers import audio_chat, running_server
from tests.test_deploy_config import QWEN3_DEPLOY

SERVED = "qwen3-omni-tiny"
MAX_TOKENS = 10
TALKER_TOKENS = 64
# The tiny random talker's greedy stop token comes after ~5 frames; the served talker holds it back
# this long by default (transformers' talker_min_new_tokens in the reference), so an answer speaks
# for seconds, as a real one does, and a barge-in finds the talker at work.
TALKER_MIN_TOKENS = 40
PCM16_STEP = 1 / 32768
QUESTION = "What is the capital of France?"
# vLLM-Omni's deploy file for the model, its codec pieces smaller (so a short answer streams in
# several) and their left context the whole answer (so the pieces join to transformers' one decode),
# the talker greedy by default (so a chat gets transformers' codes), vLLM's sizes for this machine's
# memory, every stage on its one CPU group (the file puts the talker on GPU 1).
DEPLOY = (QWEN3_DEPLOY.replace("codec_chunk_frames: 25", "codec_chunk_frames: 5").replace('devices: "1"', 'devices: "0"')
          .replace("codec_left_context_frames: 25", f"codec_left_context_frames: {TALKER_TOKENS}")
          .replace("default_sampling_params: {seed: 42, temperature: 0.9, top_k: 50, max_tokens: 4096",
                   f"default_sampling_params: {{seed: 42, temperature: 0.0, top_k: 50, max_tokens: {TALKER_TOKENS}, "
                   f"min_tokens: {TALKER_MIN_TOKENS}")
          .replace("max_num_seqs: 64", "max_num_seqs: 4").replace("max_num_batched_tokens: 32768",
                                                                  "max_num_batched_tokens: 4096")
          .replace("gpu_memory_utilization: 0.9", "gpu_memory_utilization: 0.3")
          .replace("gpu_memory_utilization: 0.6", "gpu_memory_utilization: 0.3"))


@pytest.fixture(scope="module")
def qwen3_dir():
    from omni_engine.models.prepare import prepare_model

    return prepare_model("qwen3-omni-tiny")


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    return load_reference(qwen3_dir)


@pytest.fixture(scope="module")
def server(qwen3_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("qwen3_serve")
    deploy = work / "qwen3_omni_moe.yaml"
    deploy.write_text(DEPLOY)
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes_json")  # Qwen3's <tool_call> tags
    with running_server(str(qwen3_dir), SERVED, work, extra_args=("--deploy-config", str(deploy), *tools)) as srv:
        yield srv


def _post(server, path, body, timeout=120):
    return httpx.post(f"{server['url']}{path}", json={"model": SERVED, **body}, timeout=timeout)


def _messages(kind):
    """The chat for a prompt kind, and the prompt transformers is given for it."""
    if kind == "text":
        return [{"role": "user", "content": QUESTION}], (chat(QUESTION), {})
    wav = encode_audio(tone(), 16000, "wav")
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode("ascii"), "format": "wav"}}
    return ([{"role": "user", "content": [part, {"type": "text", "text": "What did you hear?"}]}],
            (chat("<|audio_start|><|audio_pad|><|audio_end|>What did you hear?"),
             {"audio": (decode_audio(wav, 16000), 16000)}))


def _audio_chat(server, messages, voice=None, stream=False):
    """The text, the waveform (float32, 24 kHz) and the piece count of a chat with audio."""
    audio = {"format": "pcm16", **({"voice": voice} if voice else {})}
    return audio_chat(server["url"], {"model": SERVED, "messages": messages, "modalities": ["text", "audio"],
                                      "audio": audio, "temperature": 0.0, "max_tokens": MAX_TOKENS, "stream": stream})


@pytest.mark.parametrize(("kind", "voice", "stream"), [("text", "Ethan", False), ("audio", "chelsie", True)])
def test_a_chat_with_audio_answers_transformers_text_and_speech(server, reference, kind, voice, stream):
    """Through the server: the thinker's greedy text, then the audio of the talker's greedy frames in
    the voice asked for, as transformers makes both (pcm16: within a step of it); streamed, in the
    deploy file's codec pieces (4 frames, then 5), which join to the whole (their decoder sees every
    frame before them in an answer this short)."""
    messages, prompt = _messages(kind)
    want_ids, _, _ = reference_run(reference, prompt)
    want_ids = want_ids[:MAX_TOKENS]
    want_text = reference[1].tokenizer.decode(want_ids, skip_special_tokens=True)
    codes, want = reference_speech(reference, prompt, voice.lower(), MAX_TOKENS, TALKER_TOKENS, TALKER_MIN_TOKENS)
    text, audio, pieces = _audio_chat(server, messages, voice=voice, stream=stream)
    assert text == want_text
    assert audio.shape == want.shape == (codes.shape[1] * 1920 - 555,)
    assert float(np.abs(audio).max()) > 0.05, "silent"
    np.testing.assert_allclose(audio, np.clip(want, -1, 1), atol=1e-4 + PCM16_STEP, rtol=0)
    if stream:
        assert pieces >= 1 + -(-(codes.shape[1] - 4) // 5), "the answer's speech did not stream in codec pieces"


def test_completions_are_refused_with_the_reason_and_the_server_serves_on(server):
    response = _post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] == ("Qwen3-Omni requires chat template structure for thinker-talker handoff. "
                                "Use /v1/chat/completions instead.")
    again = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert again.status_code == 200, again.text


def test_the_voices_are_the_talker_s_speakers_and_an_unknown_one_is_refused_by_field(server):
    listing = httpx.get(f"{server['url']}/v1/audio/voices", timeout=30).json()
    assert [v["id"] for v in listing["data"]] == ["aiden", "chelsie", "ethan"]
    assert listing["default"] == "ethan"  # transformers' default speaker
    response = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"}, "max_tokens": 2})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "audio.voice"


@pytest.mark.asyncio(loop_scope="module")
async def test_realtime_the_thinker_hears_the_turn_and_answers_in_transformers_speech(server, reference):
    """``/v1/realtime``: a committed turn of audio goes to the thinker itself; the answer is
    transformers' text for that audio and the speech of transformers' greedy talker."""
    import base64 as b64

    from omni_engine.realtime.audio_io import StreamResampler
    from tests.realtime_helpers import aclient, answer_audio, events_until, of_type

    resampled = StreamResampler(16000, 24000).feed(tone())
    pcm = (np.clip(resampled, -1, 1) * 32767).astype("<i2")
    heard16k = StreamResampler(24000, 16000).feed(pcm.astype(np.float32) / 32768.0)  # as the session hears it
    prompt = (chat("<|audio_start|><|audio_pad|><|audio_end|>"), {"audio": (heard16k, 16000)})
    want_ids, _, _ = reference_run(reference, prompt)
    want_text = reference[1].tokenizer.decode(want_ids[:MAX_TOKENS], skip_special_tokens=True)
    voice = None
    async with aclient(server).realtime.connect(model=SERVED) as conn:
        created = await conn.recv()
        voice = created.session.audio.output.voice
        await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS,
                                           "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated")
        await conn.input_audio_buffer.append(audio=b64.b64encode(pcm.tobytes()).decode())
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await events_until(conn, "response.done")
        transcript = "".join(ev.delta for ev in of_type(events, "response.output_audio_transcript.delta"))
        audio = answer_audio(events)
    assert transcript == want_text
    _, want = reference_speech(reference, prompt, voice.lower(), MAX_TOKENS, TALKER_TOKENS, TALKER_MIN_TOKENS)
    assert audio.shape == want.shape
    np.testing.assert_allclose(audio, np.clip(want, -1, 1), atol=1e-4 + 2 * PCM16_STEP, rtol=0)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.mark.asyncio(loop_scope="module")
async def test_realtime_a_tool_s_output_is_answered_in_transformers_speech(server, reference):
    """A tool call's round trip on ``/v1/realtime``: the client's function call and its output go into
    the thinker's prompt as Qwen3's chat template writes them (the tools in the system turn, the
    output in a user turn of ``<tool_response>``), and the answer is transformers' text and speech for
    that prompt: the talker takes the tool response's rows as a user turn's, as transformers' does."""
    from omni_engine.realtime.tools import chat_tools
    from tests.realtime_helpers import aclient, answer_audio, events_until, of_type

    output = '{"city": "Paris", "sky": "sunny"}'
    call = {"type": "function_call", "call_id": "call_weather", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}
    async with aclient(server).realtime.connect(model=SERVED) as conn:
        voice = (await conn.recv()).session.audio.output.voice
        await conn.session.update(session={"type": "realtime", "max_output_tokens": MAX_TOKENS, "tools": [WEATHER],
                                           "audio": {"input": {"turn_detection": None}}})
        await events_until(conn, "session.updated")
        for item in ({"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                     call, {"type": "function_call_output", "call_id": "call_weather", "output": output}):
            await conn.conversation.item.create(item=item)
            await events_until(conn, "conversation.item.created")
        await conn.response.create()
        events = await events_until(conn, "response.done")
    done = of_type(events, "response.done")[-1].response
    assert done.status in ("completed", "incomplete"), done  # (incomplete: max_output_tokens reached)
    transcript = "".join(ev.delta for ev in of_type(events, "response.output_audio_transcript.delta"))
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_weather", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_weather", "content": output}]
    prompt = reference[1].apply_chat_template(messages, tools=chat_tools([WEATHER]), add_generation_prompt=True,
                                              tokenize=False)
    assert f"<|im_start|>user\n<tool_response>\n{output}\n</tool_response><|im_end|>" in prompt
    assert done.usage.input_tokens == len(reference[1].tokenizer.encode(prompt)), "not the template's prompt"
    want_ids, _, _ = reference_run(reference, (prompt, {}))
    assert transcript == reference[1].tokenizer.decode(want_ids[:MAX_TOKENS], skip_special_tokens=True)
    _, want = reference_speech(reference, (prompt, {}), voice.lower(), MAX_TOKENS, TALKER_TOKENS, TALKER_MIN_TOKENS)
    audio = answer_audio(events)
    assert audio.shape == want.shape
    np.testing.assert_allclose(audio, np.clip(want, -1, 1), atol=1e-4 + 2 * PCM16_STEP, rtol=0)


@pytest.mark.asyncio(loop_scope="module")
async def test_realtime_barge_in_cancels_the_talker_and_code2wav_work_of_the_old_turn(server, qwen3_dir):
    """Server VAD on a Qwen3-Omni session: a question spoken while the answer is still being spoken
    cancels that answer (``response.done`` cancelled, ``turn_detected``): its talker request is aborted,
    and the stages say so themselves (vLLM's scheduler of the talker and of the thinker holds nothing
    and the talker makes no more tokens), code2wav is handed no more of it, nothing more of it reaches
    the client. The new question is answered in speech, hearing the first one again (a second heard
    turn: the thinker takes 4 audios a prompt; a longer history keeps its latest), and no stage holds
    anything afterwards."""
    from tests.realtime_helpers import aclient, answer_audio, events_until, of_type, silence, spoken, stream_audio
    from tests.serve_helpers import assert_nothing_in_flight, scrape, value

    def work():
        """What the stages have done, and hold, so far."""
        samples = scrape(server["url"], prefix="")
        return {"talker aborts": value(samples, "omni_engine_stage_requests_aborted_total", stage="1"),
                "talker tokens": value(samples, "vllm:generation_tokens_total", stage="1"),
                "code2wav pieces": value(samples, "omni_engine_stage_requests_total", stage="2"),  # (async_chunk)
                "scheduled": sum(value(samples, f"vllm:num_requests_{state}", stage=stage)
                                 for state in ("running", "waiting") for stage in ("0", "1"))}

    question = spoken(QUESTION)
    before = work()
    async with aclient(server).realtime.connect(model=SERVED) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 300})
        await events_until(conn, "session.updated")
        await stream_audio(conn, np.concatenate([question, silence(1.0)]))
        first = await events_until(conn, "response.output_audio.delta")
        first_id = of_type(first, "response.created")[0].response.id
        # Not paced as speech: the VAD hears the new question at once, while the talker still speaks;
        # its closing silence comes later, so the old turn's stages are watched before the new one starts.
        await stream_audio(conn, question)
        events: list = []
        await events_until(conn, "input_audio_buffer.speech_started", into=events)
        await events_until(conn, "response.done", into=events)
        cancelled = events[-1][1].response
        deadline = asyncio.get_running_loop().time() + 10
        while work()["talker aborts"] == before["talker aborts"] and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # (the orchestrator counts the abort as it sends it)
        await asyncio.sleep(0.3)  # the abort reaches the stages, and their last steps' counts the scrape
        at_cancel = work()
        await asyncio.sleep(0.5)  # long enough for a talker still at work to make tens of frames
        settled = work()
        await stream_audio(conn, silence(1.0))
        await events_until(conn, "response.done", into=events)
    assert cancelled.id == first_id and cancelled.status == "cancelled", cancelled
    assert cancelled.status_details.reason == "turn_detected"
    assert at_cancel["talker aborts"] - before["talker aborts"] == 1, (before, at_cancel)
    assert at_cancel["code2wav pieces"] > before["code2wav pieces"], "no piece of the answer before the barge-in"
    assert settled["scheduled"] == 0, f"the thinker or talker still holds requests of the cancelled turn: {settled}"
    for what in ("talker tokens", "code2wav pieces"):
        assert settled[what] == at_cancel[what], f"{what} after the barge-in: {at_cancel} -> {settled}"
    t_cancelled = next(t for t, ev in events if ev.type == "response.done")
    late = [ev.type for t, ev in events if t > t_cancelled and getattr(ev, "response_id", None) == first_id]
    assert not late, f"events of the cancelled response after its response.done: {late}"
    second = events[-1][1].response
    assert second.id != first_id and second.status in ("completed", "incomplete"), second.status_details
    assert len(answer_audio([(t, ev) for t, ev in events if getattr(ev, "response_id", None) == second.id])) > 0
    # The new turn's prompt holds both spoken turns (the thinker takes 4 audios a prompt) and what
    # was said of the old answer: at least twice the first turn's prompt and the words said.
    from transformers import AutoTokenizer

    said = len(AutoTokenizer.from_pretrained(qwen3_dir).encode(cancelled.output[0].content[0].transcript or ""))
    assert second.usage.input_tokens >= 2 * cancelled.usage.input_tokens + said, (cancelled.usage, second.usage)
    assert_nothing_in_flight(server)
