#!/usr/bin/env python
"""First audio of a spoken answer: the Piper pipeline against the eSpeak NG one, async_chunk against sequential.

    python benchmarks/bench_speech_voices.py [--rounds 5] [--max-tokens 64]

Both pipelines (stage_configs/smollm2_piper.yaml: SmolLM2 -> phonemizer -> Piper VITS;
stage_configs/smollm2_speech.yaml: SmolLM2 -> eSpeak NG) run at once; each round asks each
pipeline the same question (a two-sentence-or-longer answer, greedy) once per execution mode,
in turn, so the machine's noise hits all four alike. Reported per pipeline and mode: medians of
the time to first text, to first audio, to the end, and the seconds of audio made. Also the
Piper voice alone: seconds of audio per second of synthesis, one utterance at a time, with
1 and 2 onnxruntime threads. Writes JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import RESULTS, machine_info, progress, write_json  # noqa: E402

QUESTION = "Tell me a short story about a cat."
CONFIGS = {"piper": "stage_configs/smollm2_piper.yaml", "espeak": "stage_configs/smollm2_speech.yaml"}
MODES = ("async_chunk", "sequential")


async def one_answer(client: Any, prompt: str, params: Any, mode: str, request_id: str) -> dict[str, float]:
    t0 = time.perf_counter()
    first_text = first_audio = None
    seconds = 0.0
    async for out in client.generate(prompt, params, request_id, modalities=["text", "audio"], execution_mode=mode):
        now = time.perf_counter() - t0
        if out.outputs and out.outputs[0].text and first_text is None:
            first_text = now
        mm = out.multimodal_output
        if mm and mm.get("audio") is not None:
            first_audio = now if first_audio is None else first_audio
            seconds += len(mm["audio"]) / mm["sample_rate"]
    return {"first_text_s": first_text, "first_audio_s": first_audio, "e2e_s": time.perf_counter() - t0,
            "audio_s": seconds}


async def pipelines_part(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from omni_engine.config import load_pipeline_config
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.pipeline.stage_specs import prepare_models

    configs = {name: prepare_models(load_pipeline_config(path)) for name, path in CONFIGS.items()}
    tokenizer = AutoTokenizer.from_pretrained(configs["piper"].stage(0).engine_args["model"])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                           add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, output_kind=RequestOutputKind.DELTA)
    clients = {}
    try:
        for name, config in configs.items():
            progress(f"starting the {name} pipeline")
            clients[name] = await MultiStageEngineClient.from_config(config)
        runs: dict[tuple[str, str], list[dict[str, float]]] = {(n, m): [] for n in clients for m in MODES}
        for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
            for name, client in clients.items():
                for mode in MODES:
                    result = await one_answer(client, prompt, params, mode, f"{name}-{mode}-{r}")
                    if r:
                        runs[(name, mode)].append(result)
            progress(f"round {r} done")
    finally:
        for client in clients.values():
            await client.shutdown_async()
    rows = []
    for (name, mode), results in runs.items():
        row = {"pipeline": name, "mode": mode, "rounds": len(results)}
        for key in ("first_text_s", "first_audio_s", "e2e_s", "audio_s"):
            row[key] = statistics.median(r[key] for r in results)
        rows.append(row)
    return rows


def voice_part(utterances: int) -> list[dict[str, Any]]:
    """Seconds of audio per second of synthesis for the Piper voice alone."""
    from omni_engine.engines.generation_model import GenerationRequest
    from omni_engine.engines.piper import PiperPhonemizer, PiperVoice
    from omni_engine.models.prepare import prepare_model

    voice_dir = str(prepare_model("piper-joe"))
    ids = PiperPhonemizer(model=voice_dir).phoneme_ids(
        "The quick brown fox jumps over the lazy dog, and then it runs back home.")
    rows = []
    for threads in (1, 2):
        voice = PiperVoice(model=voice_dir, threads=threads)
        request = GenerationRequest("bench", {"phoneme_ids": ids})
        voice._render(request)  # warm-up
        t0, audio_s = time.perf_counter(), 0.0
        for _ in range(utterances):
            out = voice._render(request)
            audio_s += out["audio"].size / out["sample_rate"]
        took = time.perf_counter() - t0
        rows.append({"threads": threads, "utterances": utterances, "audio_s_per_s": audio_s / took,
                     "ms_per_utterance": 1000 * took / utterances})
        asyncio.run(voice.shutdown())
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--utterances", type=int, default=10)
    ap.add_argument("--out", default=str(RESULTS / "bench_speech_voices.json"))
    args = ap.parse_args()
    voice = voice_part(args.utterances)
    rows = asyncio.run(pipelines_part(args))
    print(f"{'pipeline':<8} {'mode':<12}{'first text':>11}{'first audio':>12}{'e2e':>8}{'audio':>8}")
    for r in rows:
        print(f"{r['pipeline']:<8} {r['mode']:<12}{r['first_text_s']:>11.3f}{r['first_audio_s']:>12.3f}"
              f"{r['e2e_s']:>8.3f}{r['audio_s']:>8.2f}")
    for v in voice:
        print(f"Piper voice, {v['threads']} thread(s): {v['audio_s_per_s']:.1f} s of audio per s, "
              f"{v['ms_per_utterance']:.0f} ms per utterance")
    print(f"wrote {write_json(args.out, {'machine': machine_info(), 'args': vars(args), 'pipelines': rows, 'voice': voice})}")


if __name__ == "__main__":
    main()
