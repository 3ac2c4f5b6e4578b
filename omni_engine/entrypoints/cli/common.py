"""What every ``omni-engine`` subcommand shares: progress lines and the stages' environment."""

from __future__ import annotations

import os
import sys


def say(msg: str) -> None:
    """A progress line on stderr (stdout stays for the command's own output)."""
    print(f"[omni-engine] {msg}", file=sys.stderr, flush=True)


def set_stage_env_defaults() -> None:
    """Environment the stage processes inherit, unless the user set it: a small
    CPU KV cache (vLLM's default takes most of the machine's memory)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
