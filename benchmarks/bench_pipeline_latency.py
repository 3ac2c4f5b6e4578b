"""Time to first text, time to first audio and total time of the speech pipeline,
sequential vs async_chunk, measured in one run on the same stage processes.

    python benchmarks/bench_pipeline_latency.py [--runs 3] [--max-tokens 96] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

QUESTIONS = ["Tell me a short story about a cat.", "What is the capital of France?"]


async def one(client, prompt, request_id, mode, max_tokens):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    first = {}
    async for out in client.generate(prompt, params, request_id, execution_mode=mode):
        first.setdefault(out.final_output_type, time.perf_counter() - t0)
    return {"first_text_s": first["text"], "first_audio_s": first["audio"], "total_s": time.perf_counter() - t0}


async def main(args) -> None:
    from transformers import AutoTokenizer

    from omni_engine.config import load_pipeline_config
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient

    config = load_pipeline_config(args.config)
    client = await MultiStageEngineClient.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(client.stage_contexts[0].client.process_spec.engine_args["model"])
    rows = []
    try:
        for question in QUESTIONS:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                   add_generation_prompt=True)
            await one(client, prompt, f"warmup-{question}", "async_chunk", args.max_tokens)
            for mode in ("sequential", "async_chunk"):
                runs = [await one(client, prompt, f"{mode}-{question}-{i}", mode, args.max_tokens)
                        for i in range(args.runs)]
                row = {"question": question, "mode": mode}
                row.update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
                rows.append(row)
    finally:
        await client.shutdown_async()
    print(f"{'question':38} {'mode':12} {'first text':>11} {'first audio':>12} {'total':>8}")
    for r in rows:
        print(f"{r['question'][:38]:38} {r['mode']:12} {r['first_text_s']:10.3f}s {r['first_audio_s']:11.3f}s "
              f"{r['total_s']:7.3f}s")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "cpus": os.cpu_count(), "runs": args.runs,
                               "max_tokens": args.max_tokens, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="stage_configs/smollm2_speech.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--json", default="benchmarks/results/bench_pipeline_latency.json")
    asyncio.run(main(parser.parse_args()))
