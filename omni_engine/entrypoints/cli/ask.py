"""``omni-engine ask``: one question through a text stage and a speech stage.

Starts the two stage processes (SmolLM2 on vLLM, eSpeak NG), streams the
answer to stdout as it is generated, then speaks it and writes ``answer.txt``
and ``answer.wav``. A direct use of ``StageEngineCoreClient``; whole
pipelines from YAML configs go through the pipeline orchestrator.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

NAME = "ask"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help="ask SmolLM2 a question and hear the answer (text + WAV)")
    parser.add_argument("question", help="the question to ask")
    parser.add_argument("--output-dir", type=Path, default=Path("out"), help="where answer.txt/answer.wav go")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--voice", default="en")
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import uvloop

    return uvloop.run(_ask(args))


def _progress(msg: str) -> None:
    print(f"[omni-engine] {msg}", file=sys.stderr, flush=True)


async def _ask(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from omni_engine.audio import write_wav
    from omni_engine.engines.tts import SpeechParams
    from omni_engine.models.prepare import prepare_model
    from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
    from omni_engine.stage_engine.stage_process import StageProcessSpec

    model = prepare_model("smollm2", progress=_progress)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.question}], tokenize=False,
                                           add_generation_prompt=True)
    llm = StageEngineCoreClient(0, transport=args.transport, process=StageProcessSpec(
        "llm", dict(model=str(model), max_model_len=2048, max_num_seqs=16, enforce_eager=True, dtype="bfloat16")))
    tts = StageEngineCoreClient(1, transport=args.transport, process=StageProcessSpec(
        "generation", {"model_factory": "omni_engine.engines.tts:make_espeak_tts"}, final_output_type="audio"))
    started = time.monotonic()
    _progress("starting stage 0 (llm: vLLM) and stage 1 (generation: eSpeak NG) ...")
    try:
        await asyncio.gather(llm.start(), tts.start())
        _progress(f"stages ready in {time.monotonic() - started:.1f} s")
        t0 = time.monotonic()
        await llm.submit_request("ask-0", prompt, SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens, output_kind=RequestOutputKind.DELTA))
        parts: list[str] = []
        while True:
            output = await llm.get_output_async()
            parts.append(output.outputs[0].text)
            print(output.outputs[0].text, end="", flush=True)
            if output.finished:
                break
        print()
        text = "".join(parts).strip()
        _progress(f"stage 0: {len(text)} characters in {time.monotonic() - t0:.2f} s")
        await tts.submit_request("ask-0", text, SpeechParams(voice=args.voice))
        speech = await tts.get_output_async()
        audio, rate = speech.multimodal_output["audio"], speech.multimodal_output["sample_rate"]
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "answer.txt").write_text(text + "\n")
        wav = write_wav(args.output_dir / "answer.wav", audio, rate)
        _progress(f"stage 1: {len(audio) / rate:.2f} s of audio at {rate} Hz -> {wav}")
        return 0
    finally:
        await asyncio.gather(llm.shutdown(), tts.shutdown())
