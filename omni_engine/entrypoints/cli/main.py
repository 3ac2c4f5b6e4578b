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
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from omni_engine import envs
from omni_engine.entrypoints.cli import bench, generate, prepare_model, sample, serve, transfer_queue
from omni_engine.entrypoints.cli.common import say

SUBCOMMANDS: list[ModuleType] = [
    prepare_model,
    generate,
    serve,
    sample,
    transfer_queue,
    bench,
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(prog="omni-engine", description="Multi-stage model pipeline server.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


# Errors whose message says what went wrong and where (file, stage, field, log): a command
# prints the message, not a traceback through our code (OMNI_ENGINE_TRACEBACK=1 adds it).
# By module and name, so that checking for them imports nothing (omni_engine.errors imports vLLM).
EXPLAINED_ERRORS = {
    "omni_engine.config": ("ConfigError",),
    "omni_engine.errors": ("StageStartupError", "StageDeadError"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the chosen subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own = {m.NAME: m for m in SUBCOMMANDS if getattr(m, "PARSES_OWN_ARGS", False)}
    if argv and argv[0] in own:
        return _run(own[argv[0]].main, argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return _run(handler, args)


def _run(handler: Callable[[Any], int], args: Any) -> int:
    """``handler(args)``'s exit code: 130 when interrupted, 1 with one message for an explained error."""
    try:
        return int(handler(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 130
    except Exception as exc:
        if not _explained(exc) or envs.show_tracebacks():
            raise
        say(str(exc))
        say("(OMNI_ENGINE_TRACEBACK=1 also prints the traceback)")
        return 1


def _explained(exc: BaseException) -> bool:
    for module_name, names in EXPLAINED_ERRORS.items():
        module = sys.modules.get(module_name)
        if module is not None and isinstance(exc, tuple(getattr(module, n) for n in names)):
            return True
    return False


if __name__ == "__main__":
    sys.exit(main())
