"""``RealtimeSession`` on its own: the real Silero VAD on real (eSpeak NG) speech, with a recording
``RealtimeEngine`` in place of the pipeline, so the order of what the session asks of the pipeline is
visible: a turn is transcribed while the VAD still waits for its silence to end, a guess is dropped
(its request cancelled) when the user speaks on, and the final transcript is of the whole turn.
The pipeline side is tested over a real server in tests/voice/test_realtime_serve.py."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest

from omni_engine.audio import decode_audio, wav_bytes
from omni_engine.engines.tts import EspeakSynthesizer
from omni_engine.entrypoints.openai.realtime import vad_factory
from omni_engine.params import SpeechParams
from omni_engine.realtime.engine import ResponseStart, TextDelta
from omni_engine.realtime.session import RealtimeSession
from omni_engine.tracing.context import REQUEST_TRACE_HEADERS

pytestmark = pytest.mark.asyncio(loop_scope="session")
RATE = 24000


class RecordingEngine:
    """Transcribes to the audio's length in ms (so tests see which audio was sent) after ``delay`` s;
    answers "Fine." after ``answer_delay`` s. ``log`` gets ("respond" | "closed", request id), and
    can be the session's event list too, so the order of both is visible."""

    can_hear = can_speak = True
    hears_audio = False
    default_voice = None

    def __init__(self, delay: float = 0.3, answer_delay: float = 0.0, log: list | None = None,
                 trace: bool = False) -> None:
        self.delay, self.answer_delay = delay, answer_delay
        # trace: each turn is a RecordedTurn, and each request notes the trace context it ran in.
        self.trace, self.turns = trace, []
        self.contexts: dict[str, dict | None] = {}
        self.calls: list[tuple[str, int]] = []      # (request id, ms of audio)
        self.cancelled: list[str] = []
        self.log = log if log is not None else []
        self.asked: dict[str, list[dict]] = {}      # request id -> the messages it answered

    def start_turn(self, item_id):
        if not self.trace:
            return None
        self.turns.append(RecordedTurn(item_id, len(self.turns)))
        return self.turns[-1]

    def check_voice(self, voice, speed):
        pass

    def check_language(self, language):
        pass

    async def transcribe(self, audio, *, language, prompt, request_id):
        self.calls.append((request_id, len(audio) * 1000 // 16000))
        self.contexts[request_id] = REQUEST_TRACE_HEADERS.get()
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        return f"{len(audio) * 1000 // 16000} ms"

    async def respond(self, messages, *, request_id, **kwargs):
        self.log.append(("respond", request_id))
        self.asked[request_id] = messages
        self.contexts[request_id] = REQUEST_TRACE_HEADERS.get()
        try:
            yield ResponseStart(len(messages))
            await asyncio.sleep(self.answer_delay)
            yield TextDelta("Fine.", 2, "stop")
        finally:
            self.log.append(("closed", request_id))

    def answers(self, what: str = "respond") -> list[str]:
        return [rid for entry in self.log if isinstance(entry, tuple) and entry[0] == what for rid in entry[1:]]


class RecordedTurn:
    """A turn's trace as the session drives it: its events in order, attributes, how it ended."""

    def __init__(self, item_id: str | None, n: int) -> None:
        self.item_id, self.events, self.attrs, self.status = item_id, [], {}, None
        self.headers = {"traceparent": f"00-{n + 1:032x}-{n + 1:016x}-01"}

    def event(self, name: str) -> None:
        self.events.append(name)

    def set(self, key: str, value) -> None:
        self.attrs[key] = value

    def end(self, status: str) -> None:
        assert self.status is None, f"turn {self.item_id} ended twice ({self.status}, then {status})"
        self.status = status


@pytest.fixture(scope="module")
def phrase() -> np.ndarray:
    tts = EspeakSynthesizer()
    audio = tts.synthesize("Hello there, how are you doing today?", SpeechParams(voice="en"))
    # eSpeak ends a sentence with its pause (0.3 s), as inside a text; the tests here make the
    # pauses they are about themselves, so the phrase ends where its sound does.
    audio = audio[:np.nonzero(np.abs(audio) > 0.01)[0][-1] + 1]
    return decode_audio(wav_bytes(audio, tts.sample_rate), RATE)


def pcm_events(audio: np.ndarray) -> list[str]:
    pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2")
    return [json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(pcm[i:i + 480].tobytes()).decode()}) for i in range(0, len(pcm), 480)]


async def feed(session: RealtimeSession, audio: np.ndarray, sent: list, pace: float = 0.0) -> None:
    for message in pcm_events(audio):
        await session.handle(message)
        sent.append(None)
        await asyncio.sleep(pace)


def zeros(seconds: float) -> np.ndarray:
    return np.zeros(int(RATE * seconds), dtype=np.float32)


async def test_a_turn_is_transcribed_before_the_vad_confirms_its_end(phrase):
    engine, out = RecordingEngine(), []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(1.0)]), [])
    kinds = [e["type"] for e in out]
    stopped = kinds.index("input_audio_buffer.speech_stopped")
    # Every transcription was a guess made before the VAD confirmed the end; all but the last were
    # dropped (pauses inside the phrase), and the last one is the turn's.
    assert engine.calls and all("-stt-early-" in rid for rid, _ in engine.calls)
    assert engine.cancelled == [rid for rid, _ in engine.calls[:-1]]
    await asyncio.sleep(engine.delay + 0.2)
    done = next(e for e in out if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert done["item_id"] == out[stopped]["item_id"]
    assert int(done["transcript"].split()[0]) >= len(phrase) * 1000 // RATE - 100  # the whole phrase
    response = next(e for e in out if e["type"] == "response.done")
    assert response["response"]["status"] == "completed"
    await session.close()


async def test_speech_that_resumes_drops_the_guess(phrase):
    engine, out = RecordingEngine(delay=1.0), []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=vad_factory())
    # A 400 ms pause: long enough for a guess (125 ms), too short to end the turn (500 ms).
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(0.4), phrase, zeros(1.0)]), [])
    assert [e["type"] for e in out].count("input_audio_buffer.speech_stopped") == 1
    guesses = [(rid, ms) for rid, ms in engine.calls if "-stt-early-" in rid]
    assert len(guesses) == len(engine.calls) >= 2
    # The guess at the 400 ms pause (the phrase alone, padded with the 500 ms of silence that would
    # end its turn) was dropped when the phrase came again.
    assert any(abs(ms - (300 + len(phrase) * 1000 // RATE + 500)) < 400 for _, ms in guesses[:-1])
    assert engine.cancelled == [rid for rid, _ in guesses[:-1]]
    await asyncio.sleep(1.2)
    done = next(e for e in out if e["type"] == "conversation.item.input_audio_transcription.completed")
    assert int(done["transcript"].split()[0]) >= 2 * len(phrase) * 1000 // RATE  # both phrases, one turn
    await session.close()


async def test_closing_the_session_cancels_a_guess_in_flight(phrase):
    engine, out = RecordingEngine(delay=5.0), []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(0.4)]), [])
    assert engine.calls and "input_audio_buffer.speech_stopped" not in [e["type"] for e in out]
    in_flight = [rid for rid, _ in engine.calls if rid not in engine.cancelled]
    assert len(in_flight) == 1
    await session.close()
    assert engine.cancelled[-1] == in_flight[0]


def position(log: list, kind: str) -> int:
    return next(i for i, e in enumerate(log) if isinstance(e, dict) and e["type"] == kind)


async def done_response(log: list, timeout: float = 3.0) -> dict:
    deadline = asyncio.get_running_loop().time() + timeout
    while not any(isinstance(e, dict) and e["type"] == "response.done" for e in log):
        assert asyncio.get_running_loop().time() < deadline, "no response.done"
        await asyncio.sleep(0.02)
    return log[position(log, "response.done")]["response"]


async def test_the_answer_starts_in_the_vad_s_silence_and_the_response_adopts_it(phrase):
    log: list = []
    engine = RecordingEngine(delay=0.05, log=log)
    session = RealtimeSession(engine, log.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(1.0)]), [], pace=0.01)
    response = await done_response(log)
    # The LLM was asked before the VAD ended the turn, and the response read that answer: it made no
    # request of its own. (An answer begun in a pause inside the phrase was dropped as it went on.)
    *dropped, adopted = engine.answers()
    assert "-preempted-" in adopted and response["id"] not in engine.asked
    assert log.index(("respond", adopted)) < position(log, "input_audio_buffer.speech_stopped")
    assert all(log.index(("closed", rid)) < position(log, "input_audio_buffer.speech_stopped") for rid in dropped)
    assert response["status"] == "completed" and response["output"][0]["content"][0]["transcript"] == "Fine."
    transcript = log[position(log, "conversation.item.input_audio_transcription.completed")]["transcript"]
    assert engine.asked[adopted][-1] == {"role": "user", "content": transcript}
    # Its events come in the usual order: the turn's transcript, then the response's output.
    assert (position(log, "input_audio_buffer.committed") < position(log, "response.created")
            < position(log, "conversation.item.input_audio_transcription.completed")
            < position(log, "response.output_item.added"))
    await session.close()


async def test_speech_that_resumes_drops_the_answer_begun_in_the_pause(phrase):
    log: list = []
    engine = RecordingEngine(delay=0.05, answer_delay=5.0, log=log)
    session = RealtimeSession(engine, log.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(0.4), phrase, zeros(0.4)]), [], pace=0.01)
    await asyncio.sleep(0.1)
    assert "input_audio_buffer.speech_stopped" not in [e["type"] for e in log if isinstance(e, dict)]
    answers = engine.answers()
    assert len(answers) >= 2 and all("-preempted-" in rid for rid in answers)
    # Each answer but the last was aborted when the user spoke on; the last waits for the VAD.
    assert engine.answers("closed") == answers[:-1]
    assert engine.asked[answers[-1]][-1]["content"].split()[0] >= engine.asked[answers[0]][-1]["content"].split()[0]
    await session.close()  # and closing the session aborts the last one
    assert engine.answers("closed") == answers


async def test_an_answer_to_what_the_session_no_longer_asks_is_not_used(phrase):
    log: list = []
    engine = RecordingEngine(delay=0.05, log=log)
    session = RealtimeSession(engine, log.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(0.3)]), [], pace=0.01)
    await asyncio.sleep(0.1)
    *_, preempted = engine.answers()
    await session.handle(json.dumps({"type": "session.update", "session": {"type": "realtime",
                                                                            "instructions": "Be brief."}}))
    await feed(session, zeros(0.5), [], pace=0.01)
    response = await done_response(log)
    assert response["status"] == "completed"
    # The response asked anew (with the new instructions); the answer begun before was aborted.
    assert engine.answers()[-2:] == [preempted, response["id"]]
    assert engine.asked[response["id"]][0] == {"role": "system", "content": "Be brief."}
    assert preempted in engine.answers("closed")
    await session.close()


async def test_a_traced_turn_records_its_moments_and_its_requests_run_under_it(phrase):
    engine, out = RecordingEngine(trace=True), []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(1.0)]), [])
    for _ in range(100):
        if any(e["type"] == "response.done" for e in out):
            break
        await asyncio.sleep(0.05)
    (turn,) = engine.turns
    stopped = next(e for e in out if e["type"] == "input_audio_buffer.speech_stopped")
    done = next(e for e in out if e["type"] == "response.done")
    assert turn.item_id == stopped["item_id"] and turn.attrs["response_id"] == done["response"]["id"]
    moments = [e for e in turn.events if e != "answer_started_early"]
    assert moments == ["speech_started", "vad_stop", "transcript_ready", "first_word"], turn.events
    assert turn.status == "completed"
    # Every request of the turn (the guesses, the transcript, the answer) ran in the turn's trace context.
    assert engine.contexts and all(ctx == turn.headers for ctx in engine.contexts.values()), engine.contexts
    await session.close()


async def test_a_barge_in_is_recorded_on_the_turn_it_cut_off(phrase):
    engine, out = RecordingEngine(trace=True, answer_delay=5.0), []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=vad_factory())
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(1.0)]), [])
    for _ in range(100):  # the first answer is under way
        if engine.answers():
            break
        await asyncio.sleep(0.05)
    await feed(session, np.concatenate([phrase, zeros(1.0)]), [])
    first, second = engine.turns[:2]
    assert "barge_in" in first.events and first.status == "cancelled"
    assert second.events[:2] == ["speech_started", "vad_stop"] and "barge_in" not in second.events
    await session.close()
    assert all(turn.status is not None for turn in engine.turns)  # closing ends every turn


class HearingEngine(RecordingEngine):
    """An LLM that hears (Qwen-Omni's thinker) and no speech-to-text stage; its own voices."""

    can_hear = False
    hears_audio = True
    default_voice = "Chelsie"


async def test_an_llm_that_hears_gets_the_turn_s_audio_and_nothing_transcribes_it(phrase):
    """With VAD: the committed turn goes into the answer's chat as an input_audio part (a float WAV of
    exactly the samples the session kept), no transcription runs, early or late, and a session that
    asks for transcription is refused by field; the session starts in the engine's default voice."""
    engine, out = HearingEngine(), []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=vad_factory())
    assert session.config.audio.input.transcription is None and session.config.audio.output.voice == "Chelsie"
    await session.handle(json.dumps({"type": "session.update", "session": {
        "type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}))
    error = out[-1]
    assert error["type"] == "error" and error["error"]["param"] == "session.audio.input.transcription", error
    await feed(session, np.concatenate([zeros(0.3), phrase, zeros(1.0)]), [])
    for _ in range(100):
        if engine.asked:
            break
        await asyncio.sleep(0.05)
    assert not engine.calls, f"transcribed: {engine.calls}"
    (messages,) = engine.asked.values()
    (part,) = messages[-1]["content"]
    assert messages[-1]["role"] == "user" and part["type"] == "input_audio" and part["input_audio"]["format"] == "wav"
    heard = decode_audio(base64.b64decode(part["input_audio"]["data"]), 16000)
    stopped = next(e for e in out if e["type"] == "input_audio_buffer.speech_stopped")
    item = session.conversation.get(stopped["item_id"])
    np.testing.assert_array_equal(heard, item.audio)
    assert 0.5 * len(phrase) < len(heard) < len(phrase) + RATE, (len(heard), len(phrase))
    assert "audio" not in json.dumps(item.to_json()).replace('"input_audio"', "")  # never sent back
    await session.close()
