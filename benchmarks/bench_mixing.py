#!/usr/bin/env python
"""Two-model mixing: tokens/s of the mixing pipeline against the teacher alone and theta alone.

    python benchmarks/bench_mixing.py [--rounds 3] [--max-tokens 48] [--config stage_configs/smollm2_mixing.yaml]

Three pipelines from the same config: the mixing pipeline (teacher + theta), the teacher
stage alone, and theta alone (its engine args as mixing runs it: prefix caching, no
chunked prefill). All three are started first and stay up (an idle engine core waits on
its socket and takes no CPU); then each round runs them in turn, one at a time (these
machines have 2 cores), at concurrency 1 and 8: each request decodes ``--max-tokens``
tokens (greedy, EOS ignored), and the step time is the wall time over the tokens per
request. Each round's ratio compares runs seconds apart, so the machine's drift (these
machines are shared) moves all three alike; the median over rounds is reported. Target:
mixing step <= (teacher step + theta step) x 1.2. The transport's share per step comes
from the α history (each request's seconds spent moving batches and rows between the
stages, over its steps). Writes ``benchmarks/results/bench_mixing.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# Four engine cores stay up at once: 1 GiB of KV cache each (vLLM CPU's own default is larger).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from benchmarks.bench_common import RESULTS, machine_info, progress, write_json  # noqa: E402
from omni_engine.config import load_pipeline_config  # noqa: E402
from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient  # noqa: E402
from omni_engine.logits.mixing_wiring import wire_mixing  # noqa: E402

QUESTION = "Explain in a few sentences why the sky is blue."
TARGET = 1.2


def variants(config_path: str, history: Path) -> dict[str, Any]:
    """The mixing pipeline, the teacher alone and theta alone (as mixing configures it)."""
    config = load_pipeline_config(config_path)
    teacher = next(s for s in config.stage_args if s.mixing is not None)
    mixing = teacher.mixing.__class__(**{**{f: getattr(teacher.mixing, f) for f in teacher.mixing.__struct_fields__},
                                         "alpha_history": str(history)})
    theta = config.stage(teacher.mixing.theta_stage)
    theta_args = {k: v for k, v in wire_mixing(config.stage_args)[(theta.stage_id, 0)].items()
                  if k == "enable_chunked_prefill"}
    alone = dict(final_output=True, final_output_type="text", engine_input_source=[])
    return {
        "mixing": config.replace(stage_args=[teacher.replace(mixing=mixing) if s is teacher else s
                                             for s in config.stage_args]),
        "teacher": config.replace(stage_args=[teacher.replace(mixing=None)]),
        "theta": config.replace(stage_args=[theta.replace(engine_args={**theta.engine_args, **theta_args}, **alone)]),
    }


async def measure(client: Any, config: Any, concurrency: int, max_tokens: int, tag: str) -> dict[str, float]:
    """One run of ``concurrency`` requests at once; request ids start with ``tag``."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            extra_args={"theta_prompt": QUESTION})
    prompt = render(config, [{"role": "user", "content": QUESTION + " The reference answer: Rayleigh scattering."}])

    async def one(rid: str) -> int:
        n = 0
        async for out in client.generate({"prompt": prompt}, params, rid):
            n = len(out.outputs[0].token_ids)
        return n

    started = time.perf_counter()
    tokens = await asyncio.gather(*(one(f"{tag}-{i}") for i in range(concurrency)))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens": sum(tokens), "tokens_per_s": sum(tokens) / wall, "step_s": wall / max_tokens}


async def run_rounds(configs: dict[str, Any], concurrency: tuple[int, ...], max_tokens: int,
                     rounds: int) -> list[dict[str, dict[int, dict[str, float]]]]:
    """Start every pipeline, warm each up, then ``rounds`` rounds of all of them in turn."""
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for name, config in configs.items():
            progress(f"starting {name}")
            clients[name] = await stack.enter_async_context(await MultiStageEngineClient.from_config(config))
            await measure(clients[name], config, 1, max_tokens, f"warm-up-{name}")
        results = []
        for r in range(rounds):
            results.append({name: {} for name in configs})
            for c in concurrency:
                for name, client in clients.items():
                    run = await measure(client, configs[name], c, max_tokens, f"r{r}-c{c}")
                    results[-1][name][c] = run
                    progress(f"round {r + 1} {name} concurrency {c}: {run['tokens_per_s']:.1f} tokens/s, "
                             f"step {run['step_s'] * 1000:.1f} ms")
        return results


_TEMPLATE: dict[str, Any] = {}


def render(config: Any, messages: list[dict]) -> str:
    if "tokenizer" not in _TEMPLATE:
        from transformers import AutoTokenizer

        from omni_engine.pipeline.stage_specs import prepare_models

        model = prepare_models(config, lambda m: None).stage_args[0].engine_args["model"]
        _TEMPLATE["tokenizer"] = AutoTokenizer.from_pretrained(model)
    return _TEMPLATE["tokenizer"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--config", default="stage_configs/smollm2_mixing.yaml")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    concurrency = (1, 8)
    with tempfile.TemporaryDirectory() as tmp:
        history = Path(tmp) / "alpha.jsonl"
        rounds = asyncio.run(run_rounds(variants(args.config, history), concurrency, args.max_tokens, args.rounds))
        lines = [json.loads(line) for line in history.read_text().splitlines()]
    report: dict[str, Any] = {"machine": machine_info(), "max_tokens": args.max_tokens, "rounds": rounds,
                              "target": TARGET}
    for c in concurrency:
        steps = [{k: runs[k][c]["step_s"] for k in ("mixing", "teacher", "theta")} for runs in rounds]
        ratios = [s["mixing"] / (s["teacher"] + s["theta"]) for s in steps]
        mine = [line for line in lines if line["request_id"].startswith("r") and f"-c{c}-" in line["request_id"]]
        transport = statistics.mean(line["transport_s"] / line["steps"] for line in mine)
        wait = statistics.mean(line["theta_wait_s"] / line["steps"] for line in mine)
        split = sum(line["theta_split_steps"] for line in mine) / sum(line["steps"] for line in mine)
        mix, teacher, theta = (statistics.median(s[k] for s in steps) for k in ("mixing", "teacher", "theta"))
        ratio = statistics.median(ratios)
        report[f"concurrency_{c}"] = {"mixing_step_ms": mix * 1000, "teacher_step_ms": teacher * 1000,
                                      "theta_step_ms": theta * 1000, "ratio_to_sum": ratio,
                                      "ratio_to_sum_per_round": ratios,
                                      "theta_wait_ms_per_step": wait * 1000,
                                      "theta_split_step_share": split,
                                      "transport_ms_per_step": transport * 1000,
                                      "transport_share": transport / mix, "meets_target": ratio <= TARGET}
        print(f"concurrency {c}: mixing step {mix * 1000:.1f} ms vs teacher {teacher * 1000:.1f} + theta "
              f"{theta * 1000:.1f} ms (medians): {ratio:.2f}x the sum (median of rounds "
              f"{', '.join(f'{x:.2f}' for x in ratios)}; target <= {TARGET}); waiting for theta "
              f"{wait * 1000:.1f} ms/step, of which transport {transport * 1000:.2f} ms ({transport / mix:.1%} of a "
              f"step); theta split {split:.1%} of the steps")
    write_json(RESULTS / "bench_mixing.json", report)


if __name__ == "__main__":
    main()
