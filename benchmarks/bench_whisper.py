#!/usr/bin/env python
"""Whisper's real-time factor in its stage: seconds of processing per second of audio.

    python benchmarks/bench_whisper.py [--models whisper-tiny-en whisper-tiny-en-15s whisper-base] [--rounds 3] [--concurrency 8]

Each model runs as stage_configs/whisper.yaml (Whisper in vLLM, in its own stage process), fed a
spoken passage (the Piper voice reads a 10-15 s text; made in-process, not timed). Reported per
model: the median time of one request alone and its real-time factor (RTF = time / audio seconds;
below 1 is faster than real time), and the RTF of ``--concurrency`` requests at once (total time /
total audio: what batching in vLLM buys), plus the word error rate of the transcript. A voice turn
(a ~2 s question, as a realtime session commits it) is timed alone too: there the window's padding,
not the speech, is most of the encoder's work (compare whisper-tiny-en with whisper-tiny-en-15s).
Writes JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, progress, write_json  # noqa: E402

PASSAGE = ("The weather today is sunny and warm. We will meet at the library after lunch, and then we will "
           "walk to the park with our friends. In the evening we plan to cook dinner together.")
QUESTION = "What is the capital of France?"
CONFIG = Path(__file__).resolve().parent.parent / "stage_configs" / "whisper.yaml"


def spoken(text: str) -> np.ndarray:
    """``text`` read by the Piper voice, at 16 kHz."""
    from piper import PiperVoice

    from omni_engine.engines.transcription import audio_prompt_of
    from omni_engine.models.prepare import prepare_model

    voice_dir = prepare_model("piper-joe")
    voice = PiperVoice.load(str(voice_dir / "en_US-joe-medium.onnx"))
    chunks = list(voice.synthesize(text))
    audio = np.concatenate([c.audio_float_array for c in chunks])
    return audio_prompt_of({"multi_modal_data": {"audio": (audio, chunks[0].sample_rate)}}).audio


async def transcribe(client: Any, audio: np.ndarray, request_id: str) -> tuple[float, str]:
    from vllm import SamplingParams

    t0 = time.perf_counter()
    text = ""
    async for out in client.generate({"prompt": "", "multi_modal_data": {"audio": audio}},
                                     SamplingParams(temperature=0, max_tokens=224), request_id, entry_stage_id=0):
        text = out.outputs[0].text
    return time.perf_counter() - t0, text


async def bench_model(model: str, audio: np.ndarray, turn: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    from omni_engine.engines.transcription import word_error_rate
    from tests.stress.pipeline import speech_config, start_pipeline

    seconds = audio.size / 16000
    t0 = time.perf_counter()
    client = await start_pipeline(speech_config(CONFIG, model=model))
    start_s = time.perf_counter() - t0
    try:
        await transcribe(client, audio, f"{model}-warmup")
        alone, text = [], ""
        for r in range(args.rounds):
            took, text = await transcribe(client, audio, f"{model}-alone-{r}")
            alone.append(took)
        turns, turn_text = [], ""
        for r in range(args.rounds):
            took, turn_text = await transcribe(client, turn, f"{model}-turn-{r}")
            turns.append(took)
        batched = []
        for r in range(args.rounds):
            t1 = time.perf_counter()
            await asyncio.gather(*(transcribe(client, audio, f"{model}-c{r}-{i}") for i in range(args.concurrency)))
            batched.append(time.perf_counter() - t1)
    finally:
        await client.shutdown_async()
    one = statistics.median(alone)
    many = statistics.median(batched)
    row = {"model": model, "start_s": start_s, "audio_s": seconds, "alone_s": one, "rtf_alone": one / seconds,
           "concurrency": args.concurrency, "batch_s": many, "rtf_batched": many / (seconds * args.concurrency),
           "wer": word_error_rate(PASSAGE, text), "text": text.strip(), "turn_audio_s": turn.size / 16000,
           "turn_s": statistics.median(turns), "turn_wer": word_error_rate(QUESTION, turn_text),
           "turn_text": turn_text.strip()}
    progress(f"{model}: start {start_s:.0f} s; alone {one:.2f} s (RTF {row['rtf_alone']:.3f}); "
             f"{args.concurrency} at once {many:.2f} s (RTF {row['rtf_batched']:.3f}); WER {row['wer']:.3f}; "
             f"a {row['turn_audio_s']:.1f} s turn {row['turn_s']:.2f} s (WER {row['turn_wer']:.3f})")
    return row


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    audio, turn = spoken(PASSAGE), spoken(QUESTION)
    return [await bench_model(model, audio, turn, args) for model in args.models]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["whisper-tiny-en", "whisper-tiny-en-15s", "whisper-base"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    print(f"\n{'model':20} {'audio s':>8} {'alone s':>8} {'RTF':>6} {'x' + str(args.concurrency) + ' s':>8} "
          f"{'RTF':>6} {'WER':>6} {'turn s':>7} {'WER':>6}")
    for r in rows:
        print(f"{r['model']:20} {r['audio_s']:8.1f} {r['alone_s']:8.2f} {r['rtf_alone']:6.3f} {r['batch_s']:8.2f} "
              f"{r['rtf_batched']:6.3f} {r['wer']:6.3f} {r['turn_s']:7.2f} {r['turn_wer']:6.3f}")
    path = write_json(RESULTS / "whisper.json", {"machine": machine_info(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
