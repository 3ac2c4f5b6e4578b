"""Scoring answers (``Verifier``) and deciding when an item has enough (``Formatter``).

A verifier turns one answer into a score (1.0 correct, 0.0 not, or anything
in between); a formatter looks at an item's kept rollouts and says whether it
``is_satisfied`` -- the Pipeline stops an item early once every formatter is.
Built-ins are named (``boxed``, ``min_correct``, ``pair``); anything else is a
dotted path (``my_pkg.verify:MathVerifier``) to a class or factory called with
the config's ``args``. Both are loaded when the config is validated, so a typo
fails before any model starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

from omni_engine.utils import resolve_dotted


@runtime_checkable
class Verifier(Protocol):
    """``verify`` scores one answer. A verifier may also list ``required_metadata``: keys every
    item's metadata must have (checked when the input is read, before anything is sampled)."""

    def verify(self, response: str, metadata: dict[str, Any]) -> float: ...


@runtime_checkable
class Formatter(Protocol):
    def is_satisfied(self, rollouts: Sequence[dict[str, Any]]) -> bool: ...


_BOXED = "\\boxed{"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def final_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), else the last number, else None."""
    start = text.rfind(_BOXED)
    if start >= 0:
        depth, i = 1, start + len(_BOXED)
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _as_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, expected: Any) -> bool:
    """Numerically equal when both are numbers (``1,000`` = ``1000.0`` = ``2000/2``), else equal as text
    (whitespace and ``$`` ignored)."""
    expected_text = str(expected).strip()
    a, b = _as_number(answer), _as_number(expected_text)
    if a is not None and b is not None:
        return a == b
    def norm(s: str) -> str:
        return "".join(s.replace("$", "").split())
    return norm(answer) == norm(expected_text)


class BoxedAnswerVerifier:
    """1.0 when the final ``\\boxed{...}`` (or the last number) equals ``metadata[answer_key]``."""

    def __init__(self, answer_key: str = "answer") -> None:
        self.answer_key = answer_key
        self.required_metadata = (answer_key,)

    def verify(self, response: str, metadata: dict[str, Any]) -> float:
        if self.answer_key not in metadata:
            raise KeyError(f"boxed verifier: the item's metadata has no {self.answer_key!r}")
        answer = final_answer(response)
        return 1.0 if answer is not None and answers_match(answer, metadata[self.answer_key]) else 0.0


class MinCorrect:
    """Satisfied with at least ``k`` rollouts scoring at least ``threshold`` (e.g. SFT data: one good answer)."""

    def __init__(self, k: int = 1, threshold: float = 1.0) -> None:
        if k < 1:
            raise ValueError(f"min_correct: args.k must be >= 1, got {k}")
        self.k, self.threshold = k, threshold

    def is_satisfied(self, rollouts: Sequence[dict[str, Any]]) -> bool:
        return sum(1 for r in rollouts if (r["score"] or 0) >= self.threshold) >= self.k


class PreferencePair:
    """Satisfied with one rollout scoring >= ``threshold`` and one below (a chosen/rejected pair)."""

    def __init__(self, threshold: float = 1.0) -> None:
        self.threshold = threshold

    def is_satisfied(self, rollouts: Sequence[dict[str, Any]]) -> bool:
        scores = [r["score"] or 0 for r in rollouts]
        return any(s >= self.threshold for s in scores) and any(s < self.threshold for s in scores)


VERIFIERS: dict[str, Callable[..., Any]] = {"boxed": BoxedAnswerVerifier}
FORMATTERS: dict[str, Callable[..., Any]] = {"min_correct": MinCorrect, "pair": PreferencePair}


class PluginError(ValueError):
    """A verifier or formatter that cannot be loaded; ``field`` is ``name`` or ``args``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _load(name: str, args: dict[str, Any], builtins: dict[str, Callable[..., Any]], what: str,
          method: str) -> Any:
    if name in builtins:
        factory = builtins[name]
    elif ":" in name or "." in name:
        try:
            factory = resolve_dotted(name, what)
        except ValueError as exc:
            raise PluginError("name", str(exc)) from None
    else:
        raise PluginError("name", f"unknown {what} {name!r}; built-in: {', '.join(builtins)}, or a dotted path "
                         "like 'my_pkg.module:Name'")
    try:
        obj = factory(**args)
    except (TypeError, ValueError) as exc:
        raise PluginError("args", f"{what} {name!r} with args {args}: {exc}") from None
    if not callable(getattr(obj, method, None)):
        raise PluginError("name", f"{what} {name!r} has no {method}() method")
    return obj


def load_verifier(name: str, args: dict[str, Any] | None = None) -> Verifier:
    return _load(name, args or {}, VERIFIERS, "verifier", "verify")


def load_formatter(name: str, args: dict[str, Any] | None = None) -> Formatter:
    return _load(name, args or {}, FORMATTERS, "formatter", "is_satisfied")
