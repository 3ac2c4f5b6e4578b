#!/usr/bin/env python
"""Talk to a voice pipeline over OpenAI's Realtime API with the official ``openai`` client.

    omni-engine serve stage_configs/voice_assistant.yaml --served-model-name voice-assistant &
    python examples/realtime/talk.py question.wav --out answer.wav [--url http://127.0.0.1:8000]

Plays ``question.wav`` (any rate, mono or stereo, 16-bit) into a ``/v1/realtime`` session at the
pace of speech in 20 ms chunks, then a second of silence: the server's VAD hears the end of the
turn, transcribes it, and answers aloud. Prints the events' story (what the server heard, the
answer's transcript, the time to its first audio) and writes the answer's audio to ``--out``.
Without a WAV of your own, ``--say "What is the capital of France?"`` has the server's own voice
speak the question first.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import time
import wave

import numpy as np
import openai

RATE = 24000  # the session's audio/pcm rate, in and out
CHUNK = RATE // 50


def read_wav(path: str | io.BytesIO) -> np.ndarray:
    """``path`` (a WAV file) as float32 mono at 24 kHz."""
    with wave.open(path) as w:
        if w.getsampwidth() != 2:
            raise SystemExit("the question must be a 16-bit PCM WAV")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0
        samples = data.reshape(-1, w.getnchannels()).mean(axis=1)
        rate = w.getframerate()
    positions = np.arange(0, len(samples), rate / RATE)
    return np.interp(positions, np.arange(len(samples)), samples).astype(np.float32)


def pcm16(samples: np.ndarray) -> np.ndarray:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2")


async def talk(args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(base_url=f"{args.url}/v1", api_key=args.api_key)
    if args.say:
        speech = await client.audio.speech.create(model=args.model, voice="alloy", input=args.say,
                                                  response_format="wav")
        question = read_wav(io.BytesIO(speech.content))
    else:
        question = read_wav(args.wav)
    audio = pcm16(np.concatenate([question, np.zeros(RATE, dtype=np.float32)]))
    answer = bytearray()
    async with client.realtime.connect(model=args.model) as conn:
        await conn.recv()  # session.created
        await conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": args.voice}}})
        start = time.monotonic()
        for n, i in enumerate(range(0, len(audio), CHUNK)):
            await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + CHUNK].tobytes()).decode())
            await asyncio.sleep(max(0.0, start + (n + 1) / 50 - time.monotonic()))
        speech_end = start + (len(audio) - RATE) / RATE
        async for event in conn:
            if event.type == "input_audio_buffer.speech_stopped":
                print(f"end of speech heard at {event.audio_end_ms} ms")
            elif event.type == "conversation.item.input_audio_transcription.completed":
                print(f"you said: {event.transcript}")
            elif event.type == "response.output_audio.delta":
                if not answer:
                    print(f"first audio {time.monotonic() - speech_end:.2f} s after you stopped speaking")
                answer += base64.b64decode(event.delta)
            elif event.type == "response.output_audio_transcript.done":
                print(f"answer: {event.transcript}")
            elif event.type == "error":
                print(f"error: {event.error.message}")
            elif event.type == "response.done":
                print(f"response {event.response.status}")
                break
    with wave.open(args.out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(bytes(answer))
    print(f"wrote {args.out} ({len(answer) / 2 / RATE:.1f} s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wav", nargs="?", help="the question, a 16-bit WAV")
    parser.add_argument("--say", help="have the server speak this question instead of a WAV")
    parser.add_argument("--out", default="answer.wav")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--model", default="voice-assistant")
    parser.add_argument("--voice", default="alloy")
    args = parser.parse_args()
    if not args.wav and not args.say:
        parser.error("give a WAV or --say TEXT")
    asyncio.run(talk(args))


if __name__ == "__main__":
    main()
