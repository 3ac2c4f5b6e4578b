"""The example task's channel-B preprocess: parse a rollout, match it to the ground truth, build the target.

As in the seed: the predicted items (words here, objects there) are matched to the
ground-truth ones; the target is the matched ground truth in the rollout's own order,
then the false negatives appended; false positives are dropped. Exact words need no
Hungarian solver: a word matches itself or nothing.
"""

from __future__ import annotations

import re
from typing import Any

_WORD = re.compile(r"[a-z]+")
_LIST = re.compile(r"which of these words are \w+: (.*?)\?", re.IGNORECASE)


def candidates(sample: dict[str, Any]) -> list[str]:
    """The words the question offers."""
    match = _LIST.search(sample["messages"][-1]["content"])
    return [w.strip().lower() for w in match.group(1).split(",")] if match else []


def parse(text: str, offered: list[str]) -> list[str]:
    """The offered words a rollout names, in its order, each once."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(text.lower()):
        if word in offered:
            seen.setdefault(word, None)
    return list(seen)


def preprocess(sample: dict[str, Any], rollout: Any) -> str | None:
    """The training target for a rollout; None for an empty one (nothing to learn an order from)."""
    if not rollout.text.strip():
        return None
    truth = [w.strip() for w in sample["answer"].split(",") if w.strip()]
    predicted = parse(rollout.text, candidates(sample))
    matched = [w for w in predicted if w in truth]
    missed = [w for w in truth if w not in matched]
    return ", ".join(matched + missed)
