"""What every ``omni-engine`` subcommand shares: progress lines, the stages' environment, JSON flags."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def say(msg: str) -> None:
    """A progress line on stderr (stdout stays for the command's own output)."""
    print(f"[omni-engine] {msg}", file=sys.stderr, flush=True)


def set_stage_env_defaults() -> None:
    """Environment the stage processes inherit, unless the user set it: a small
    CPU KV cache (vLLM's default takes most of the machine's memory)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def json_list(text: str) -> list:
    """An argparse type: a flag's value as a JSON array (``--sampling-params-list``)."""
    return _json_of(text, list, "array")


def json_object(text: str) -> dict:
    """An argparse type: a flag's value as a JSON object (``--extra-args``, ``--extra-body``)."""
    return _json_of(text, dict, "object")


def _json_of(text: str, kind: type, name: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, kind):
        raise argparse.ArgumentTypeError(f"expected a JSON {name}, got {type(value).__name__}")
    return value
