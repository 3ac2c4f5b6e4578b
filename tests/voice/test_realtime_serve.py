"""``/v1/realtime`` (OpenAI's Realtime API) on ``omni-engine serve`` of the voice assistant (Whisper ->
SmolLM2 -> Piper), through the official ``openai`` client's realtime connection: spoken questions in
20 ms chunks with server VAD, spoken answers back (checked by transcribing them with the server's own
Whisper stage), barge-in, history, bad input, and many sessions at once. Nothing may stay in flight
on any stage afterwards."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets

import numpy as np
import openai
import pytest
import websockets

from tests.realtime_helpers import aclient, answer_audio, events_until, heard, of_type, silence, spoken, stream_audio
from tests.serve_helpers import assert_nothing_in_flight

pytestmark = [pytest.mark.llm, pytest.mark.asyncio(loop_scope="session")]

MODEL = "voice-assistant"
TEXT_ONLY = {"type": "realtime", "output_modalities": ["text"]}


@pytest.fixture(scope="module")
def france():
    return spoken("What is the capital of France?")


@pytest.fixture(scope="module")
def germany():
    return spoken("What is the capital of Germany?")


# ------------------------------------------------------------- spoken turns
async def test_a_spoken_question_is_answered_aloud_with_server_vad(server, client, france):
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        created = await conn.recv()
        assert created.type == "session.created"
        assert created.session.audio.input.turn_detection.type == "server_vad"
        await stream_audio(conn, np.concatenate([silence(0.5), france, silence(1.0)]))
        events = await events_until(conn, "response.done")
    started, = of_type(events, "input_audio_buffer.speech_started")
    stopped, = of_type(events, "input_audio_buffer.speech_stopped")
    # Speech begins at 500 ms; the item keeps 300 ms of padding before it, and ends after 500 ms of silence.
    assert 100 <= started.audio_start_ms <= 400 and started.item_id == stopped.item_id
    assert stopped.audio_end_ms - started.audio_start_ms >= len(france) / 24
    transcript, = of_type(events, "conversation.item.input_audio_transcription.completed")
    assert "capital" in transcript.transcript.lower() and "france" in transcript.transcript.lower()
    done = of_type(events, "response.done")[-1]
    assert done.response.status == "completed"
    said = of_type(events, "response.output_audio_transcript.done")[-1].transcript
    assert "Paris" in said
    audio = answer_audio(events)
    assert len(audio) > 24000 * 0.5
    assert "paris" in heard(client, audio).lower()
    assert_nothing_in_flight(server)


async def test_a_traced_turn_is_a_span_with_its_moments_over_the_requests_it_made(server, receiver, france):
    trace_id, session_span = secrets.token_hex(16), secrets.token_hex(8)
    headers = {"traceparent": f"00-{trace_id}-{session_span}-01"}
    async with aclient(server).realtime.connect(model=MODEL, extra_headers=headers) as conn:
        await conn.recv()
        await stream_audio(conn, np.concatenate([silence(0.5), france, silence(1.0)]))
        events = await events_until(conn, "response.done")
    response_id = of_type(events, "response.done")[-1].response.id
    spans = receiver.wait_for(trace_id, lambda s: any(x.name == "realtime_turn" for x in s)
                              and sum(x.name == "omni_request" for x in s) >= 2)
    (turn,) = [s for s in spans if s.name == "realtime_turn"]
    assert turn.parent_span_id == session_span and turn.attributes["omni.realtime.status"] == "completed"
    assert turn.attributes["omni.realtime.response_id"] == response_id
    moments = [name for name, _ in turn.events if name != "answer_started_early"]
    assert moments == ["speech_started", "vad_stop", "transcript_ready", "first_word", "first_audio"], turn.events
    times = [t for _, t in turn.events]
    assert times == sorted(times) and turn.start_ns <= times[0] and times[-1] <= turn.end_ns
    # The turn's pipeline requests (Whisper's transcription, the spoken answer) are its children.
    requests = [s for s in spans if s.name == "omni_request"]
    assert requests and all(r.parent_span_id == turn.span_id for r in requests)
    stages = {s.attributes["omni.stage.type"] for s in spans if s.name.startswith("omni_stage ")}
    assert stages == {"llm", "generation"}


async def test_barge_in_cancels_the_answer_and_the_new_question_is_answered(server, client, france):
    story = spoken("Tell me a long story about a dragon.")
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 300})
        await stream_audio(conn, np.concatenate([story, silence(1.0)]))
        first = await events_until(conn, "response.output_audio.delta")
        first_id = of_type(first, "response.created")[0].response.id
        sender = asyncio.ensure_future(stream_audio(conn, np.concatenate([france, silence(1.0)]), realtime=True))
        events: list = []
        await events_until(conn, "input_audio_buffer.speech_started", into=events)
        await events_until(conn, "response.done", into=events)
        await sender
        await events_until(conn, "response.done", into=events)
    t_started = next(t for t, ev in events if ev.type == "input_audio_buffer.speech_started")
    t_cancelled, cancelled = next((t, ev) for t, ev in events if ev.type == "response.done")
    assert cancelled.response.id == first_id and cancelled.response.status == "cancelled"
    assert cancelled.response.status_details.reason == "turn_detected"
    assert t_cancelled - t_started < 0.3, f"cancelled {1000 * (t_cancelled - t_started):.0f} ms after speech_started"
    after = [ev for t, ev in events if t > t_cancelled and getattr(ev, "response_id", None) == first_id]
    assert not after, f"events of the cancelled response after its response.done: {[ev.type for ev in after]}"
    # The story's item keeps only what was spoken before the user cut in.
    story_item = cancelled.response.output[0]
    assert story_item.status == "incomplete"
    second = events[-1][1]
    assert second.response.status == "completed" and second.response.id != first_id
    assert "Paris" in second.response.output[0].content[0].transcript
    assert_nothing_in_flight(server)


async def test_history_feeds_the_next_answer(server, client, france):
    """"That city" means Paris only to a session that heard the first question; a fresh one names another."""
    follow_up = spoken("What is the population of that city?")

    async def answers(*questions: np.ndarray) -> list[str]:
        said = []
        async with aclient(server).realtime.connect(model=MODEL) as conn:
            await conn.recv()
            for question in questions:
                await stream_audio(conn, np.concatenate([question, silence(1.0)]))
                events = await events_until(conn, "response.done")
                said.append(events[-1][1].response.output[0].content[0].transcript)
        return said

    first, second = await answers(france, follow_up)
    alone, = await answers(follow_up)
    assert "Paris" in first and "Paris" in second, (first, second)
    assert "Paris" not in alone, alone


async def test_a_history_longer_than_the_context_keeps_its_latest_turns(server):
    """SmolLM2's context is 2048 tokens; eight items of ~400 tokens do not fit: the oldest are left out."""
    filler = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.session.update(session={**TEXT_ONLY, "instructions": "Answer in a few words."})
        await events_until(conn, "session.updated")
        for i in range(8):
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": f"Note {i}: {filler}"}]})
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is the capital of France?"}]})
        await conn.response.create()
        done = (await events_until(conn, "response.done"))[-1][1].response
    assert done.status in ("completed", "incomplete"), done.status_details
    assert 1000 < done.usage.input_tokens <= 2048 - 64, done.usage
    assert "Paris" in done.output[0].content[0].text


# --------------------------------------------------------- manual turns
async def test_manual_commit_and_text_answers(server, france):
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.session.update(session={**TEXT_ONLY, "audio": {"input": {"turn_detection": None}}})
        updated = (await events_until(conn, "session.updated"))[-1][1]
        assert updated.session.audio.input.turn_detection is None
        await stream_audio(conn, france)
        await conn.input_audio_buffer.commit()
        await conn.response.create()
        events = await events_until(conn, "response.done")
    assert not of_type(events, "input_audio_buffer.speech_started")
    assert of_type(events, "input_audio_buffer.committed")
    assert not of_type(events, "response.output_audio.delta")
    text = of_type(events, "response.output_text.done")[-1].text
    assert "Paris" in text and "".join(ev.delta for ev in of_type(events, "response.output_text.delta")) == text


async def test_response_cancel_and_closing_mid_answer_abort_the_pipeline(server, france):
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story about a dragon and a knight."}]})
        await conn.response.create(response={"max_output_tokens": 400})
        await events_until(conn, "response.output_audio_transcript.delta")
        await conn.response.cancel()
        done = (await events_until(conn, "response.done"))[-1][1]
        assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
        await conn.response.create(response={"max_output_tokens": 400})
        await events_until(conn, "response.output_audio_transcript.delta")
    # The socket closed mid-answer: the server aborts the request on every stage.
    assert_nothing_in_flight(server)


async def test_truncate_retrieve_and_delete_items(server):
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Tell me a long story about a dragon."}]})
        await conn.response.create(response={"max_output_tokens": 60})
        events = await events_until(conn, "response.done")
        item = events[-1][1].response.output[0]
        spoken_text = item.content[0].transcript
        deltas = b"".join(base64.b64decode(ev.delta) for ev in of_type(events, "response.output_audio.delta"))
        assert spoken_text.count(".") >= 2 and deltas, spoken_text
        # The listener stopped 100 ms into the audio: no whole sentence was heard.
        await conn.conversation.item.truncate(item_id=item.id, content_index=0, audio_end_ms=100)
        truncated = (await events_until(conn, "conversation.item.truncated"))[-1][1]
        assert (truncated.item_id, truncated.audio_end_ms) == (item.id, 100)
        await conn.conversation.item.retrieve(item_id=item.id)
        kept = (await events_until(conn, "conversation.item.retrieved"))[-1][1].item
        assert kept.content[0].transcript == ""
        await conn.conversation.item.delete(item_id=item.id)
        assert (await events_until(conn, "conversation.item.deleted"))[-1][1].item_id == item.id
        await conn.conversation.item.retrieve(item_id=item.id)
        gone = (await events_until(conn, "error"))[-1][1].error
        assert gone.code == "item_not_found" and gone.param == "item_id"


# ------------------------------------------------------------- bad input
async def test_bad_events_are_error_events_and_the_session_goes_on(server):
    url = server["url"].replace("http", "ws") + f"/v1/realtime?model={MODEL}"
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {server['api_key']}"}) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"

        async def error_for(message: str) -> dict:
            await ws.send(message)
            body = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert body["type"] == "error", body
            assert set(body["error"]) >= {"type", "code", "message", "param"}
            return body["error"]

        assert (await error_for("{not json"))["code"] == "invalid_json"
        unknown = await error_for(json.dumps({"type": "response.explode", "event_id": "ev1"}))
        assert unknown["param"] == "type" and unknown["event_id"] == "ev1" and "response.explode" in unknown["message"]
        odd = await error_for(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}))
        assert odd["param"] == "audio" and "16-bit" in odd["message"]
        assert (await error_for(json.dumps({"type": "input_audio_buffer.append", "audio": "!!"})))["param"] == "audio"
        rate = await error_for(json.dumps({"type": "session.update", "session": {
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}}))
        assert rate["param"] == "session.audio.input.format.rate"
        voice = await error_for(json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "zz"}}}}))
        assert voice["param"] == "session.audio.output.voice"
        empty = await error_for(json.dumps({"type": "input_audio_buffer.commit"}))
        assert empty["code"] == "input_audio_buffer_commit_empty"
        assert (await error_for(json.dumps({"type": "response.cancel"})))["code"] == "response_cancel_not_active"
        # Still a working session: a text turn is answered.
        await ws.send(json.dumps({"type": "session.update", "session": TEXT_ONLY}))
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]}}))
        await ws.send(json.dumps({"type": "response.create"}))
        async with asyncio.timeout(60):
            while (body := json.loads(await ws.recv()))["type"] != "response.done":
                pass
        assert body["response"]["status"] == "completed"


async def test_the_handshake_needs_the_api_key(server):
    url = server["url"].replace("http", "ws") + f"/v1/realtime?model={MODEL}"
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url):
            pass
    assert refused.value.response.status_code == 401
    wrong = openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(Exception) as by_client:
        async with wrong.realtime.connect(model=MODEL) as conn:
            await conn.recv()
    assert "401" in str(by_client.value)


# ------------------------------------------------------------ concurrency
async def test_eight_sessions_at_once_are_all_answered(server, france):
    async def one(i: int) -> str:
        async with aclient(server).realtime.connect(model=MODEL) as conn:
            await conn.recv()
            await stream_audio(conn, np.concatenate([silence(0.2 + 0.05 * i), france, silence(1.0)]))
            events = await events_until(conn, "response.done", timeout=300)
        assert events[-1][1].response.status == "completed"
        return of_type(events, "response.output_audio_transcript.done")[-1].transcript

    answers = await asyncio.gather(*(one(i) for i in range(8)))
    assert all("Paris" in a for a in answers), answers
    assert_nothing_in_flight(server)
