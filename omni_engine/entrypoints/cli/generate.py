"""``omni-engine generate``: run one prompt through a pipeline from a stage config.

Writes every final output: ``answer.txt`` for text stages and ``answer.wav``
for audio stages (the chunks joined in order), and shows per-stage progress
on stderr: stage start-up, time to first output and completion of each.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from omni_engine.entrypoints.cli.common import json_list, json_object, say, set_stage_env_defaults

NAME = "generate"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(NAME, help="run one prompt through a pipeline (text, WAV, ...)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="pipeline stage config (YAML)")
    source.add_argument("--model", help="a model (checkpoint directory or prepare-model recipe) instead: its "
                                        "family's pipeline, found by its architectures, or one vLLM stage")
    parser.add_argument("--prompt", required=True, help="the user's message")
    parser.add_argument("--output-dir", type=Path, default=Path("out"))
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=None, help="override the text stage's max_tokens")
    parser.add_argument("--extra-args", type=json_object, default=None, metavar="JSON",
                        help="the request's extra_args (vllm_xargs) for logits processors, as a JSON object; "
                             "e.g. a mixing pipeline's '{\"theta_prompt\": \"...\"}'")
    parser.add_argument("--sampling-params-list", type=json_list, default=None, metavar="JSON",
                        help="per-stage sampling params (vLLM-Omni's sampling_params_list): a JSON array, one "
                             "object or null per stage in stage order, each merged over that stage's "
                             "default_sampling_params; e.g. a greedy talker with a voice: "
                             "'[null, {\"temperature\": 0, \"max_tokens\": 600, \"extra_args\": "
                             "{\"voice\": \"Ethan\"}}]'")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    set_stage_env_defaults()
    import uvloop

    from omni_engine.config import ConfigError, load_pipeline_config
    from omni_engine.config.for_model import pipeline_config_for_model
    from omni_engine.pipeline.stage_specs import prepare_models

    try:
        # Models are checked (and recipes prepared) before anything heavy is imported:
        # the chat template below is read from the checked model.
        config = prepare_models(load_pipeline_config(args.config) if args.config is not None
                                else pipeline_config_for_model(args.model), say)
        args.params = request_params(config, args.max_tokens, args.extra_args, args.sampling_params_list)
    except ConfigError as exc:
        say(str(exc))
        return 2
    return uvloop.run(_generate(args, config))


def _chat_prompt(config, question: str) -> str:
    """``question`` in the text stage's chat template (its tokenizer, as vLLM's server would load it)."""
    from transformers import AutoTokenizer

    from omni_engine.models.check import stage_model_error

    index, llm = next(((i, s) for i, s in enumerate(config.stage_args) if s.stage_type == "llm"), (0, None))
    if llm is None:
        return question
    field = "tokenizer" if llm.engine_args.get("tokenizer") else "model"
    name = llm.engine_args[field]
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
    except (OSError, ValueError) as exc:
        raise stage_model_error(config, index, field, f"cannot put the prompt in {name}'s chat template: {exc}; "
                                "--raw sends the prompt as it is") from exc


async def _generate(args: argparse.Namespace, config) -> int:
    from omni_engine.audio import write_wav
    from omni_engine.entrypoints.multi_stage_engine_client import MultiStageEngineClient
    from omni_engine.entrypoints.signals import cancel_on_signals
    prompt = args.prompt if args.raw else _chat_prompt(config, args.prompt)
    # SIGTERM/SIGINT: unwind through `async with` so every stage is shut down.
    cancel_on_signals()
    started = time.monotonic()
    say(f"starting {len(config.stage_args)} stage(s) from {args.config or args.model}")
    async with await MultiStageEngineClient.from_config(config, progress=say) as client:
        say(f"pipeline ready in {time.monotonic() - started:.1f} s ({config.runtime.execution_mode})")
        params = args.params
        text: list[str] = []
        audio: list[np.ndarray] = []
        rate = 0
        t0 = time.monotonic()
        seen: set[int] = set()
        async for output in client.generate(prompt, params, "cli-0"):
            if output.stage_id not in seen:
                seen.add(output.stage_id)
                say(f"stage {output.stage_id}: first {output.final_output_type} after {time.monotonic() - t0:.2f} s")
            if output.final_output_type == "text" and output.outputs:
                text.append(output.outputs[0].text)
                print(output.outputs[0].text, end="", flush=True)
            elif "audio" in output.multimodal_output:
                audio.append(output.multimodal_output["audio"])
                rate = output.multimodal_output["sample_rate"]
            if output.finished:
                say(f"stage {output.stage_id}: done after {time.monotonic() - t0:.2f} s")
        print()
    return _write_outputs(args.output_dir, "".join(text).strip(), audio, rate, write_wav)


def request_params(config, max_tokens: int | None, extra_args: dict | None = None,
                   per_stage: list | None = None) -> dict[int, dict] | None:
    """Sampling params by stage id. An LLM entry stage is asked for DELTA text, which this command
    prints and joins as it arrives, whatever the config's default kind (vLLM's default is
    CUMULATIVE); ``max_tokens`` and ``extra_args`` are the entry stage's; ``per_stage`` (stage order,
    None to keep a stage's) is merged field by field over each stage's ``default_sampling_params``.
    A bad entry is a ``ConfigError`` naming it."""
    from omni_engine.config import ConfigError
    from omni_engine.params import merged_params, to_sampling_params

    stages = config.stage_args
    per_stage = list(per_stage or [])
    if len(per_stage) > len(stages):
        raise ConfigError([f"--sampling-params-list has {len(per_stage)} entries for {len(stages)} stages"])
    out: dict[int, dict] = {}
    for index, (stage, entry) in enumerate(zip(stages, per_stage)):
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise ConfigError([(f"--sampling-params-list[{index}] (stage {stage.stage_id}) must be an object or "
                                f"null, got {type(entry).__name__}")])
        merged = merged_params(stage.default_sampling_params, entry)
        if stage.stage_type == "llm":  # refused before anything starts, as vLLM would refuse it
            try:
                to_sampling_params(merged)
            except (TypeError, ValueError) as exc:
                raise ConfigError([f"--sampling-params-list[{index}] (stage {stage.stage_id}): {exc}"]) from None
        out[stage.stage_id] = merged
    entry = stages[0]
    if entry.stage_type == "llm":
        params = dict(out.get(entry.stage_id) or entry.default_sampling_params, output_kind="delta")
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        if extra_args:
            params["extra_args"] = {**(params.get("extra_args") or {}), **extra_args}
        out[entry.stage_id] = params
    return out or None


def _write_outputs(out_dir: Path, text: str, audio: list[np.ndarray], rate: int, write_wav) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    if text:
        (out_dir / "answer.txt").write_text(text + "\n")
        say(f"wrote {out_dir / 'answer.txt'}")
    if audio:
        wave = np.concatenate(audio)
        path = write_wav(out_dir / "answer.wav", wave, rate)
        say(f"wrote {path}: {len(wave) / rate:.2f} s of audio at {rate} Hz")
    return 0
