"""JSON Lines files read with their line numbers, so that an error names ``file:line``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def jsonl_rows(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of every non-blank line; ``error("file:N: not JSON: ...")`` for a bad one."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{number}: not JSON: {exc}") from None
