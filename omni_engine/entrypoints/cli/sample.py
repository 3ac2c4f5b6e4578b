"""``omni-engine sample --config sample.yaml``: rollouts over a dataset into crash-safe shards.

Rerunning with the same output directory resumes: finished shards and the
requests journaled in the unfinished one are not sent again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omni_engine.entrypoints.cli.common import say, set_stage_env_defaults

NAME = "sample"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(NAME, help="sample n answers per item of a JSONL dataset, in rounds, into shards")
    parser.add_argument("--config", required=True, type=Path, help="sample config (YAML)")
    parser.add_argument("--dry-run", action="store_true", help="validate the config and print the plan; sample nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar, even on a terminal")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from omni_engine.config import ConfigError
    from omni_engine.sampling.config import load_sample_config
    from omni_engine.sampling.items import ItemError
    from omni_engine.sampling.pipeline import load_items
    from omni_engine.sampling.verifiers import load_verifier

    try:
        config = load_sample_config(args.config)
        verifier = load_verifier(config.verifier.name, config.verifier.args)
        items = load_items(config, verifier)
    except (ConfigError, ItemError) as exc:
        say(str(exc))
        return 2
    if args.dry_run:
        print(json.dumps(plan(config, len(items)), indent=2))
        return 0
    set_stage_env_defaults()
    import uvloop

    return uvloop.run(_sample(config, verifier, items, args))


def plan(config, num_items: int) -> dict:
    """What a run would do, from the config alone."""
    from omni_engine.sampling.shards import shard_name

    rounds = config.sampling
    shards = -(-num_items // config.shard.size)
    out = config.resolve(config.output.dir)
    done = sum(1 for i in range(shards) if (out / shard_name(i)).exists())
    import msgspec

    sampler = {k: v for k, v in msgspec.to_builtins(config.sampler).items() if v is not None and k != "api_key"}
    return {"sampler": sampler,
            "items": num_items, "shards": shards, "shards_done": done, "shard_size": config.shard.size,
            "answers_per_round": rounds.step_size, "max_steps": rounds.max_steps, "max_rollouts": rounds.max_rollouts,
            "early_stop": rounds.early_stop, "verifier": config.verifier.name,
            "formatters": [f.name for f in config.formatters], "output_dir": str(out),
            "transfer_queue": (None if config.transfer_queue is None else
                               config.transfer_queue.rpc_address or config.transfer_queue.url),
            "max_requests": num_items * rounds.max_steps}


async def _sample(config, verifier, items: list[dict], args: argparse.Namespace) -> int:
    from omni_engine.entrypoints.signals import cancel_on_signals
    from omni_engine.sampling import make_sampler
    from omni_engine.sampling.base import SamplerInitError, SamplerUnavailable
    from omni_engine.sampling.pipeline import Pipeline
    from omni_engine.sampling.progress import TerminalProgress, format_summary
    from omni_engine.sampling.publish import PublishError
    from omni_engine.sampling.shards import ResumeMismatch

    cancel_on_signals()  # SIGTERM/SIGINT unwind through the sampler's shutdown
    sampler = make_sampler(config.sampler, config.base_dir)
    progress = TerminalProgress(enabled=False if args.no_progress else None)
    say(f"sampling with the {config.sampler.kind} sampler into {config.resolve(config.output.dir)}")
    try:
        summary = await Pipeline(config, sampler, verifier=verifier, progress=progress).run(items)
    except (SamplerInitError, ResumeMismatch, SamplerUnavailable, PublishError) as exc:
        say(str(exc))
        return 1
    say(format_summary(summary, str(config.resolve(config.output.dir))))
    return 0
