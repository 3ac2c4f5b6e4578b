"""The async actor-learner loop on CPU: two learner ranks fine-tune SmolLM2 on rollouts of itself.

    torchrun --nproc-per-node 2 examples/rl/actor_learner.py --config examples/rl/actor_learner.yaml

Channel A trains on the reference answers of ``data/train.jsonl``; channel B on the served
model's own answers to the same questions (its own sample stream), matched to the reference
by ``word_sets.preprocess``; both teacher-forced and packed. Each rank prefetches B in the
background into its versioned ready queue; rank 0 pushes the full weights to the server every
``sync.every_steps`` steps, fenced so that no rank has a rollout in flight meanwhile.

Without ``--url`` (or ``rollout.url``) rank 0 starts ``omni-engine serve`` of SmolLM2 with the RL
routes on and stops it at the end. ``--set train.steps=4`` overrides any field. Prints the run's
counters (one JSON object) on rank 0; ``--log-dir`` keeps every rank's step records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PIPELINE = HERE.parents[1] / "stage_configs" / "smollm2_text.yaml"


def overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--set {pair!r}: expected field=value, e.g. train.steps=4")
        out[key] = yaml.safe_load(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE / "actor_learner.yaml"))
    parser.add_argument("--url", default=None, help="a running rollout server (omni-engine serve, dev mode)")
    parser.add_argument("--log-dir", default=None, help="every rank's step records (rank<N>.jsonl), summary.json")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override a config field")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    import torch

    torch.set_num_threads(int(os.environ.get("OMNI_RL_THREADS", "1")))  # ranks share the cores with the server
    from omni_engine.config import ConfigError
    from omni_engine.rl.config import load_actor_learner_config
    from omni_engine.rl.runner import ActorLearnerRun, broadcast, init_distributed
    from omni_engine.rl.serve import rollout_server
    from word_sets import preprocess

    try:
        config = load_actor_learner_config(args.config, overrides(args.set))
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    me = init_distributed()
    log_dir = Path(args.log_dir) if args.log_dir else None
    url = args.url or config.rollout.url
    with contextlib.ExitStack() as stack:
        if url is None and me.is_main:
            server_log = (log_dir or Path(".")) / "rollout_server.log"
            server_log.parent.mkdir(parents=True, exist_ok=True)
            url = stack.enter_context(rollout_server(PIPELINE, config.rollout.model or "smollm2", server_log))
        url = broadcast(url)
        run = ActorLearnerRun(config, preprocess, url, log_dir=log_dir)
        try:
            summary = run.run()
        finally:
            run.close()
    if me.is_main:
        text = json.dumps(summary)
        if log_dir is not None:
            (log_dir / "summary.json").write_text(text)
        print(text, flush=True)


if __name__ == "__main__":
    main()
