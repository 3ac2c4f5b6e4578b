"""``/v1/audio/speech/stream`` on ``omni-engine serve`` of the voice assistant (Piper speaks): text
appended a few characters at a time, as an LLM would stream it, comes back as audio sentence by
sentence and in order, before the text is even committed; the audio says the words (the server's
own Whisper hears them); G.711 output; clear mid-stream; bad input. Nothing may stay in flight on
any stage afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import numpy as np
import openai
import pytest
import pytest_asyncio
import websockets

from omni_engine.audio import wav_bytes
from omni_engine.realtime.audio_io import decode_input
from tests.serve_helpers import assert_nothing_in_flight

pytestmark = [pytest.mark.llm, pytest.mark.asyncio(loop_scope="session")]

MODEL = "voice-assistant"
TEXT = "The weather is nice today. We will go to the park. See you there"
SENTENCES = ["The weather is nice today.", "We will go to the park.", "See you there"]
EARLY = TEXT.index("We will") + 6  # the first sentence and part of the second


def url_of(server, model: str = MODEL) -> str:
    return server["url"].replace("http", "ws", 1) + f"/v1/audio/speech/stream?model={model}"


def connect_raw(server, model: str = MODEL) -> websockets.connect:
    return websockets.connect(url_of(server, model), additional_headers={"Authorization": f"Bearer {server['api_key']}"})


@contextlib.asynccontextmanager
async def connect(server, model: str = MODEL) -> AsyncIterator[websockets.ClientConnection]:
    async with connect_raw(server, model) as ws:
        created = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert created["type"] == "session.created" and created["session"]["voice"] == "alloy", created
        yield ws


async def send(ws, kind: str, **fields) -> None:
    await ws.send(json.dumps({"type": kind, **fields}))


async def append_in_pieces(ws, text: str, size: int = 3) -> None:
    for i in range(0, len(text), size):
        await send(ws, "input_text.append", text=text[i:i + size])


async def events_until(ws, kind: str, into: list, timeout: float = 60.0) -> list:
    """Events (receive time, body) up to and including the first of type ``kind``, added to ``into``."""
    async with asyncio.timeout(timeout):
        while True:
            body = json.loads(await ws.recv())
            into.append((time.monotonic(), body))
            assert body["type"] != "error", body
            if body["type"] == kind:
                return into


def of_type(events: list, kind: str) -> list[dict]:
    return [body for _, body in events if body["type"] == kind]


def audio_of(events: list, fmt: str = "audio/pcm", index: int | None = None) -> np.ndarray:
    """The float32 audio of the deltas (of one sentence if ``index``), decoded from the session format."""
    parts = [decode_input(d["delta"], fmt) for d in of_type(events, "response.output_audio.delta")
             if index is None or d["sentence_index"] == index]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def streamed(server) -> tuple[list, float]:
    """TEXT streamed in 3-character pieces: the events, and when the commit was sent. The rest of the text
    is sent only once the first sentence's audio has come back: streaming must not wait for the commit."""
    events: list = []
    async with connect(server) as ws:
        await append_in_pieces(ws, TEXT[:EARLY])
        await events_until(ws, "response.sentence.done", events)
        await append_in_pieces(ws, TEXT[EARLY:])
        committed = time.monotonic()
        await send(ws, "input_text.commit")
        await events_until(ws, "response.done", events)
    return events, committed


# ------------------------------------------------------------- streaming
async def test_sentences_are_spoken_in_order_as_the_text_streams_in(streamed):
    events, committed = streamed
    done = of_type(events, "response.sentence.done")
    assert [d["sentence_index"] for d in done] == [0, 1, 2]
    assert [d["text"] for d in done] == SENTENCES
    first_audio = next(t for t, body in events if body["type"] == "response.output_audio.delta")
    assert first_audio < committed  # the first sentence was heard before the text was finished
    # In order: each sentence's deltas, then its sentence.done, then the next sentence's.
    order = [(body["type"], body["sentence_index"]) for _, body in events if "sentence_index" in body]
    indices = [i for _, i in order]
    assert indices == sorted(indices)
    for d in done:
        kinds = [k for k, i in order if i == d["sentence_index"]]
        assert kinds[-1] == "response.sentence.done" and set(kinds[:-1]) == {"response.output_audio.delta"}
        audio = audio_of(events, index=d["sentence_index"])
        assert len(audio) > 0.3 * 24000 and np.abs(audio).max() > 0.05
        assert abs(d["audio_ms"] - len(audio) * 1000 / 24000) <= 1
    last = events[-1][1]
    assert last["type"] == "response.done" and last["sentences"] == 3
    assert last["audio_ms"] == sum(d["audio_ms"] for d in done)
    assert all(body.get("event_id") for _, body in events)


async def test_the_audio_says_the_text(server, streamed):
    events, _ = streamed
    client = openai.OpenAI(base_url=server["url"] + "/v1", api_key=server["api_key"], max_retries=0, timeout=60)
    heard = await asyncio.to_thread(client.audio.transcriptions.create, model="whisper-1",
                                    file=("a.wav", wav_bytes(audio_of(events), 24000)))
    assert "weather" in heard.text.lower() and "park" in heard.text.lower(), heard.text


async def test_g711_output(server, streamed):
    events: list = []
    async with connect(server) as ws:
        await send(ws, "session.update", session={"output_audio_format": {"type": "audio/pcmu"}})
        updated, = of_type(await events_until(ws, "session.updated", []), "session.updated")
        assert updated["session"]["output_audio_format"] == {"type": "audio/pcmu", "rate": 8000}
        await send(ws, "input_text.append", text=SENTENCES[0])
        await send(ws, "input_text.commit")
        await events_until(ws, "response.done", events)
    ulaw = audio_of(events, "audio/pcmu")
    pcm_s, ulaw_s = len(audio_of(streamed[0], index=0)) / 24000, len(ulaw) / 8000
    # The same sentence, the same length (the server's durations are steady), up to the rounding of
    # resampling the voice's 22.05 kHz to 8 kHz and to 24 kHz.
    assert abs(ulaw_s - pcm_s) <= 0.002, (ulaw_s, pcm_s)
    assert np.abs(ulaw).max() > 0.05
    assert of_type(events, "response.sentence.done")[0]["audio_ms"] == len(ulaw) // 8


async def test_clear_drops_the_sentences_not_yet_sent(server):
    text = " ".join(f"This is sentence number {n} of the list." for n in range(1, 13)) + " "
    events: list = []
    async with connect(server) as ws:
        await send(ws, "input_text.append", text=text)
        await events_until(ws, "response.output_audio.delta", events)
        await send(ws, "input_text.clear")
        await events_until(ws, "input_text.cleared", events)
        cleared = of_type(events, "input_text.cleared")[0]["aborted_sentences"]
        assert cleared, "every sentence was already spoken: nothing was left to clear"
        after: list = []
        with contextlib.suppress(TimeoutError):
            await events_until(ws, "never", after, timeout=2.0)
        assert after == []  # nothing of the cleared sentences comes later
        sent = {d["sentence_index"] for d in of_type(events, "response.output_audio.delta")}
        assert not sent & set(cleared)
        await send(ws, "input_text.append", text="Back again. ")
        await send(ws, "input_text.commit")
        await events_until(ws, "response.done", after)
    done = of_type(after, "response.sentence.done")
    assert [d["text"] for d in done] == ["Back again."] and done[0]["sentence_index"] == 12
    assert len(audio_of(after)) > 0.3 * 24000 and after[-1][1]["sentences"] == 1


# ------------------------------------------------------------- bad input
async def test_bad_events_are_error_events_and_the_connection_goes_on(server):
    async with connect(server) as ws:
        async def error_for(message: str | bytes) -> dict:
            await ws.send(message)
            body = json.loads(await asyncio.wait_for(ws.recv(), 30))
            assert body["type"] == "error" and body["event_id"], body
            assert set(body["error"]) >= {"type", "code", "message", "param"}
            return body["error"]

        assert (await error_for("{not json"))["code"] == "invalid_json"
        assert (await error_for(b"\x00\x01"))["code"] == "invalid_json"
        unknown = await error_for(json.dumps({"type": "input_audio_buffer.append", "event_id": "ev1"}))
        assert unknown["param"] == "type" and unknown["event_id"] == "ev1"
        voice = await error_for(json.dumps({"type": "session.update", "session": {"voice": "zz"}}))
        assert voice["param"] == "session.voice" and "voice" in voice["message"]
        speed = await error_for(json.dumps({"type": "session.update", "session": {"speed": 9}}))
        assert speed["param"] == "session.speed"
        fmt = await error_for(json.dumps({"type": "session.update", "session": {"output_audio_format": {"type": "mp3"}}}))
        assert fmt["param"].startswith("session.output_audio_format")
        assert (await error_for(json.dumps({"type": "input_text.append", "text": 5})))["param"] == "text"
        events: list = []
        await send(ws, "input_text.append", text="Still here.")
        await send(ws, "input_text.commit")
        await events_until(ws, "response.done", events)
        assert of_type(events, "response.sentence.done")[0]["text"] == "Still here."
        assert events[-1][1]["sentences"] == 1


async def test_an_unknown_model_is_refused(server):
    async with connect_raw(server, "nope") as ws:
        body = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert body["type"] == "error" and body["error"]["code"] == "model_not_found"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 30)
    assert closed.value.rcvd.code == 1008


async def test_the_handshake_needs_the_api_key(server):
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url_of(server)):
            pass
    assert refused.value.response.status_code == 401


# ------------------------------------------------------------- afterwards
async def test_nothing_is_left_in_flight(server):
    assert_nothing_in_flight(server)
