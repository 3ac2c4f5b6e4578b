#!/usr/bin/env python
"""Real-time voice over ``/v1/realtime``: end of the user's speech -> first audio of the answer.

    python benchmarks/bench_realtime.py [--url http://127.0.0.1:8000 --api-key KEY] [--rounds 5]
                                        [--sessions 1 4]

Serves stage_configs/voice_assistant.yaml (Whisper tiny.en -> SmolLM2 -> Piper) unless ``--url``
points at a running server. Each session streams a spoken question ("What is the capital of
France?", made by the server's own voice, not timed) at the pace of speech in 20 ms chunks, then
silence, with the default server VAD (500 ms of silence ends the turn). Per turn, from the moment
the last chunk of speech was sent:

* ``vad``: until ``input_audio_buffer.speech_stopped`` (the silence the VAD waits for);
* ``transcribe``: until the input transcription is complete (Whisper stage);
* ``first_text``: until the first word of the answer (SmolLM2 stage);
* ``first_audio``: until the first ``response.output_audio.delta`` (first sentence through Piper).

Reported as p50/p95 at each session count, with ``first_audio - vad`` (the pipeline's own part).
Then barge-in: while a long answer streams (a story), the question starts; the time from
``speech_started`` to the first response's ``response.done`` (cancelled) is reported. JSON goes
to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import REPO, RESULTS, machine_info, pct, progress, write_json  # noqa: E402

MODEL = "voice-assistant"
CHUNK = 480  # 20 ms at 24 kHz
PHASES = ("vad", "transcribe", "first_text", "first_audio")


def start_server(port: int, key: str, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "serve", "stage_configs/voice_assistant.yaml",
           "--port", str(port), "--served-model-name", MODEL, "--api-key", key]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: see {log}")
        time.sleep(1)
    raise SystemExit(f"server not healthy in 600 s: see {log}")


def spoken(url: str, key: str, text: str) -> np.ndarray:
    import openai

    from omni_engine.realtime.audio_io import StreamResampler

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    raw = client.audio.speech.create(model=MODEL, voice="alloy", input=text, response_format="pcm").content
    resampler = StreamResampler(22050, 24000)
    samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    audio = np.concatenate([resampler.feed(samples), resampler.flush()])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2")


async def send_paced(conn: Any, audio: np.ndarray) -> float:
    """``audio`` at the pace of speech; returns when its last chunk was sent (monotonic)."""
    start = time.monotonic()
    for n, i in enumerate(range(0, len(audio), CHUNK)):
        await conn.input_audio_buffer.append(audio=base64.b64encode(audio[i:i + CHUNK].tobytes()).decode())
        await asyncio.sleep(max(0.0, start + 0.02 * (n + 1) - time.monotonic()))
    return time.monotonic()


async def one_turn(url: str, key: str, question: np.ndarray) -> dict[str, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    marks: dict[str, float] = {}
    async with client.realtime.connect(model=MODEL) as conn:
        await conn.recv()
        speech_end = await send_paced(conn, question)
        silence = asyncio.ensure_future(send_paced(conn, np.zeros(24000, dtype="<i2")))
        async for ev in conn:
            now = time.monotonic() - speech_end
            if ev.type == "input_audio_buffer.speech_stopped":
                marks.setdefault("vad", now)
            elif ev.type == "conversation.item.input_audio_transcription.completed":
                marks.setdefault("transcribe", now)
            elif ev.type == "response.output_audio_transcript.delta":
                marks.setdefault("first_text", now)
            elif ev.type == "response.output_audio.delta":
                marks.setdefault("first_audio", now)
            elif ev.type == "response.done":
                break
        await silence
    return marks


async def barge_in(url: str, key: str, first: np.ndarray, second: np.ndarray) -> float:
    """A long answer to ``first`` is interrupted by ``second``: ``speech_started`` -> its ``response.done``."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    async with client.realtime.connect(model=MODEL) as conn:
        await conn.recv()
        await conn.session.update(session={"type": "realtime", "max_output_tokens": 300})
        await send_paced(conn, np.concatenate([first, np.zeros(18000, dtype="<i2")]))
        async for ev in conn:
            if ev.type == "response.output_audio.delta":
                break
        sender = asyncio.ensure_future(send_paced(conn, np.concatenate([second, np.zeros(18000, dtype="<i2")])))
        started = None
        async for ev in conn:
            if ev.type == "input_audio_buffer.speech_started":
                started = time.monotonic()
            elif ev.type == "response.done":
                if started is None or ev.response.status != "cancelled":
                    raise SystemExit(f"the first answer ended ({ev.response.status}) before the user cut in")
                took = time.monotonic() - started
                break
        sender.cancel()
        return took


def summary(turns: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in PHASES:
        values = [t[phase] for t in turns if phase in t] or [float("nan")]
        out[phase] = {"p50": pct(values, 50), "p95": pct(values, 95), "n": len(values)}
    pipeline = [t["first_audio"] - t["vad"] for t in turns if "first_audio" in t and "vad" in t] or [float("nan")]
    out["pipeline_after_vad"] = {"p50": pct(pipeline, 50), "p95": pct(pipeline, 95)}
    return out


async def run(args: argparse.Namespace, url: str) -> dict[str, Any]:
    question = spoken(url, args.api_key, "What is the capital of France?")
    story = spoken(url, args.api_key, "Tell me a long story about a dragon.")
    await one_turn(url, args.api_key, question)  # warm-up
    results: dict[str, Any] = {"sessions": {}}
    for n in args.sessions:
        turns: list[dict[str, float]] = []
        for r in range(args.rounds):
            turns += await asyncio.gather(*(one_turn(url, args.api_key, question) for _ in range(n)))
            firsts = ", ".join(f"{t.get('first_audio', float('nan')):.2f}" for t in turns[-n:])
            progress(f"{n} session(s), round {r + 1}: first audio {firsts} s")
        results["sessions"][str(n)] = summary(turns)
    cancels = [await barge_in(url, args.api_key, story, question) for _ in range(args.rounds)]
    results["barge_in_cancel_s"] = {"p50": pct(cancels, 50), "max": max(cancels), "all": cancels}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server of stage_configs/voice_assistant.yaml")
    parser.add_argument("--api-key", default="bench-key")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args()
    proc = None
    url = args.url
    if url is None:
        port = 18000 + os.getpid() % 1000
        log = Path(tempfile.mkdtemp(prefix="bench-realtime-")) / "server.log"
        progress(f"starting the voice assistant server (log {log})")
        proc = start_server(port, args.api_key, log)
        url = f"http://127.0.0.1:{port}"
    try:
        results = asyncio.run(run(args, url))
    finally:
        if proc is not None:
            os.killpg(proc.pid, 15)
            proc.wait(60)
    for n, s in results["sessions"].items():
        print(f"{n} session(s): " + ", ".join(f"{k} p50 {v['p50']:.3f} s p95 {v['p95']:.3f} s" for k, v in s.items()))
    print(f"barge-in: cancelled {results['barge_in_cancel_s']['p50'] * 1000:.0f} ms (p50) after speech_started, "
          f"max {results['barge_in_cancel_s']['max'] * 1000:.0f} ms")
    write_json(RESULTS / "realtime.json", {"machine": machine_info(), "rounds": args.rounds, **results})


if __name__ == "__main__":
    main()
