"""What samplers take and give: items, sample tasks, responses.

Items are the seed's ``{"id", "messages", "metadata"}`` dicts, kept as dicts
(they are written back out with their rollouts, unknown keys included). A
``Response`` carries what the Pipeline needs besides the text: the finish
reason (``length`` answers are dropped as truncated) and token counts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec


class ItemError(ValueError):
    """A malformed input item; the message names the file, the line and the field."""


class Response(msgspec.Struct, frozen=True):
    """One answer. ``str(response)`` is its text (the seed's plain-text view)."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def __str__(self) -> str:
        return self.text


class SampleTask(msgspec.Struct, frozen=True):
    """``n`` answers for one item in one of its rounds (``seed``: that round's seed, or None)."""

    item: dict[str, Any]
    n: int
    round: int = 0
    seed: int | None = None

    @property
    def item_id(self) -> str:
        return self.item["id"]


class ItemResult(msgspec.Struct, frozen=True):
    """The outcome of one task: its responses, or the error that ended it after retries."""

    item_id: str
    round: int
    responses: list[Response]
    error: str | None = None


class BatchResult(dict):
    """``{item_id: [Response, ...]}`` as the seed's ``sample_batch`` returns it (a failed
    item maps to ``[]``), with ``errors`` (``{item_id: message}``) beside it."""

    def __init__(self, results: dict[str, list[Response]], errors: dict[str, str]) -> None:
        super().__init__(results)
        self.errors = errors

    def texts(self) -> dict[str, list[str]]:
        """The seed's plain view: ``{item_id: [text, ...]}``."""
        return {item_id: [r.text for r in responses] for item_id, responses in self.items()}


def item_seed(base: int | None, item_id: str, round: int) -> int | None:
    """A stable seed per (base, item, round): the same answers whoever samples the item, in
    whatever order, and again after a resume. None when the run is unseeded."""
    if base is None:
        return None
    digest = hashlib.blake2b(f"{base}\0{item_id}\0{round}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


def check_item(item: Any, where: str) -> dict[str, Any]:
    """``item`` as the pipeline uses it (``metadata`` defaults to ``{}``), or an ItemError."""
    if not isinstance(item, dict):
        raise ItemError(f"{where}: expected a JSON object with id and messages, got {type(item).__name__}")
    item_id = item.get("id")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
        raise ItemError(f"{where}: id: expected a non-empty string (or an integer), got {item_id!r}")
    messages = item.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ItemError(f"{where} (id {item_id}): messages: expected a non-empty list of chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise ItemError(f"{where} (id {item_id}): messages[{i}]: expected {{role, content}}, got {message!r}")
    metadata = item.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ItemError(f"{where} (id {item_id}): metadata: expected an object, got {type(metadata).__name__}")
    return {**item, "id": str(item_id), "metadata": metadata}


def read_items(path: str | Path) -> list[dict[str, Any]]:
    """Every item of a JSONL file, checked; ids must be unique (they key the output)."""
    items: list[dict[str, Any]] = []
    seen: dict[str, int] = {}
    for lineno, line in _lines(Path(path)):
        where = f"{path}:{lineno}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ItemError(f"{where}: not JSON: {exc}") from None
        item = check_item(raw, where)
        if item["id"] in seen:
            raise ItemError(f"{where}: id {item['id']!r} repeats line {seen[item['id']]}; ids must be unique")
        seen[item["id"]] = lineno
        items.append(item)
    return items


def check_metadata(items: list[dict[str, Any]], required: tuple[str, ...] | list[str], source: str) -> None:
    """Every item's metadata has the ``required`` keys (a verifier's), or an ItemError naming the items."""
    for key in required:
        missing = [item["id"] for item in items if key not in item["metadata"]]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ItemError(f"{source}: metadata.{key}, which the verifier needs, is missing in items {shown}")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield lineno, line
