"""The ``omni-engine`` command: one argparse subcommand per module.

Each module in ``SUBCOMMANDS`` exposes ``add_parser(subparsers)``, which adds
its parser and sets ``handler`` (``Namespace -> int``) as a default. To add a
subcommand, write such a module and append it to the list; this file only
builds the parser and dispatches. A module with ``PARSES_OWN_ARGS`` (``serve``,
whose parser is vLLM's) gets its raw arguments through ``main(argv)``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from types import ModuleType

from omni_engine.entrypoints.cli import generate, prepare_model, sample, serve, transfer_queue

SUBCOMMANDS: list[ModuleType] = [
    prepare_model,
    generate,
    serve,
    sample,
    transfer_queue,
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="omni-engine", description="Multi-stage model pipeline server.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {m.NAME: m for m in SUBCOMMANDS if getattr(m, "PARSES_OWN_ARGS", False)}
    if argv and argv[0] in own:
        try:
            return int(own[argv[0]].main(argv[1:]))
        except (KeyboardInterrupt, asyncio.CancelledError):
            return 130
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(handler(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130


if __name__ == "__main__":
    sys.exit(main())
