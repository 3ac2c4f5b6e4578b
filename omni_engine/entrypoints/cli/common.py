"""What every ``omni-engine`` subcommand shares: progress lines, the stages' environment, JSON flags."""

from __future__ import annotations

import argparse
import json
import os
import sys


def say(msg: str) -> None:
    """A progress line on stderr (stdout stays for the command's own output)."""
    print(f"[omni-engine] {msg}", file=sys.stderr, flush=True)


def set_stage_env_defaults() -> None:
    """Environment the stage processes inherit, unless the user set it: a small
    CPU KV cache (vLLM's default takes most of the machine's memory)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def json_list(text: str) -> list:
    """An argparse type: a flag's value as a JSON array (``--sampling-params-list``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"expected a JSON array, got {type(value).__name__}")
    return value


def json_object(text: str) -> dict:
    """An argparse type: a flag's value as a JSON object (``--extra-args``, ``--extra-body``)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value
