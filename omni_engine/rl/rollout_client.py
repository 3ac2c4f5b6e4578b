"""``RolloutClient``: one rank's rollouts, split and retried on failure; ``HTTPRolloutClient`` from an
OpenAI-compatible server (``EngineRolloutClient``, in rollout_engine.py: a pipeline in this process).

Over HTTP a batch of prompts goes out as one ``/v1/completions`` request (``prompt`` is a
list: the server schedules them together). A batch that fails (a 5xx, a 408/429, a timeout, a
dropped connection) is halved and each half retried, recursively, at most
``max_split_depth`` halvings deep; a single prompt that fails is retried alone within
the same bound. Splitting can change what sampling produces (other batch neighbours,
another request's seed stream), so every rollout records whether it came from a split
batch, and the decoding knobs and seed are logged by the caller with the run.

Each rollout carries the weight version that made it: the ``weight_version`` the server
put on the response (``omni-engine serve`` does), or else the version the request was
issued under (the fence guarantees no push happens while it is in flight).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class RolloutError(RuntimeError):
    """A rollout batch failed for good (a non-retryable answer, or retries exhausted)."""


@dataclass
class Rollout:
    index: int  # the prompt's position in the batch the caller gave
    text: str
    finish_reason: str | None
    version: int
    latency_s: float
    split: bool  # made by a retry of a split batch: sampling may differ from the unsplit batch


@dataclass
class RolloutStats:
    requests: int = 0
    failures: int = 0
    splits: int = 0
    version_mismatches: int = 0  # server said another version than the gate's (a fence violation)
    latencies: list[float] = field(default_factory=list)


def numeric_version(label: Any) -> int | None:
    """A weight-version label as the loop's integer version; None for a non-numeric one ("default")."""
    return int(label) if isinstance(label, str) and label.lstrip("-").isdigit() else None


class RetryableRolloutError(Exception):
    """A failure worth a retry with a smaller batch (overload, timeout, a dropped connection)."""


class RolloutClient:
    """Split-and-retry over ``_send``, which a backend implements for one batch."""

    where = "the rollout backend"

    def __init__(self, decoding: dict[str, Any], *, timeout_s: float = 120.0, max_split_depth: int = 3) -> None:
        self.decoding = dict(decoding)
        self.max_split_depth = max_split_depth
        self.timeout_s = timeout_s
        self.stats = RolloutStats()

    def _send(self, prompts: list[tuple[int, str]], version: int, split: bool) -> list[Rollout]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _made_by(self, served: int | None, version: int) -> int:
        """The version a rollout carries: the one the backend says made it, else the gate's."""
        if served is not None and served != version:
            self.stats.version_mismatches += 1
        return served if served is not None else version

    def generate(self, prompts: list[str], version: int) -> list[Rollout]:
        """Rollouts of ``prompts`` (in order), made under weight ``version``."""
        rollouts = self._batch(list(enumerate(prompts)), version, depth=0)
        return sorted(rollouts, key=lambda r: r.index)

    def _batch(self, prompts: list[tuple[int, str]], version: int, depth: int) -> list[Rollout]:
        try:
            self.stats.requests += 1
            return self._send(prompts, version, split=depth > 0)
        except RolloutError:
            raise
        except (httpx.TransportError, RetryableRolloutError) as exc:
            self.stats.failures += 1
            if depth >= self.max_split_depth:
                first = prompts[0][0]
                raise RolloutError(f"rollout batch of {len(prompts)} prompt(s) (first index {first}) still failing "
                                   f"after {depth} split(s) at {self.where}: {exc}") from exc
            if len(prompts) == 1:
                return self._batch(prompts, version, depth + 1)
            self.stats.splits += 1
            half = len(prompts) // 2
            return (self._batch(prompts[:half], version, depth + 1)
                    + self._batch(prompts[half:], version, depth + 1))


class HTTPRolloutClient(RolloutClient):
    """Rollouts from ``url``'s ``/v1/completions`` (``omni-engine serve`` or any OpenAI-compatible server)."""

    def __init__(self, url: str, model: str | None, decoding: dict[str, Any], *, api_key: str | None = None,
                 timeout_s: float = 120.0, max_split_depth: int = 3) -> None:
        super().__init__(decoding, timeout_s=timeout_s, max_split_depth=max_split_depth)
        self.url = url.rstrip("/")
        self.where = self.url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s)
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        response = self._http.get(f"{self.url}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def _send(self, prompts: list[tuple[int, str]], version: int, split: bool) -> list[Rollout]:
        body = {"model": self.model, "prompt": [p for _, p in prompts], **self.decoding}
        start = time.perf_counter()
        response = self._http.post(f"{self.url}/v1/completions", json=body)
        latency = time.perf_counter() - start
        if response.status_code in RETRYABLE_STATUS:
            raise RetryableRolloutError(f"HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code >= 400:
            raise RolloutError(f"rollout request to {self.url}/v1/completions refused: HTTP "
                               f"{response.status_code}: {response.text[:1000]}")
        data = response.json()
        self.stats.latencies.append(latency)
        made_by = self._made_by(numeric_version(data.get("weight_version")), version)
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts):
            raise RolloutError(f"{self.url}/v1/completions answered {len(choices)} choices for {len(prompts)} prompts")
        return [Rollout(index, choice["text"], choice.get("finish_reason"),
                        made_by, latency, split)
                for (index, _), choice in zip(prompts, choices)]

    def close(self) -> None:
        self._http.close()
