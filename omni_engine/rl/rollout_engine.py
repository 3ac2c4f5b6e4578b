"""``EngineRolloutClient``: a rank's rollouts from a ``MultiStageEngineClient`` in the learner's process.

The engine lives on its own event loop (the thread that started it); the prefetch
thread hands each batch to that loop and waits for it, so the learner needs no
server and no HTTP. Every prompt of a batch is one request, all in flight at once
(the stages batch them); the weight version comes from the outputs' stage versions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from typing import Any

from omni_engine.rl.rollout_client import (
    RetryableRolloutError,
    Rollout,
    RolloutClient,
    RolloutError,
    numeric_version,
)


def _version_of(output: Any) -> int | None:
    versions = [v[-1] for v in (getattr(output, "stage_versions", None) or {}).values() if v]
    return numeric_version(versions[-1]) if versions else None


class EngineRolloutClient(RolloutClient):
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop, decoding: dict[str, Any], *,
                 timeout_s: float = 120.0, max_split_depth: int = 3, request_prefix: str = "rollout") -> None:
        super().__init__(decoding, timeout_s=timeout_s, max_split_depth=max_split_depth)
        self.engine = engine
        self.loop = loop
        self.where = "the in-process pipeline"
        self._ids = itertools.count()
        self._prefix = f"{request_prefix}-{id(self):x}"

    def _params(self) -> Any:
        from vllm import SamplingParams

        d = self.decoding
        return SamplingParams(temperature=d.get("temperature", 1.0), top_p=d.get("top_p", 1.0),
                              top_k=d.get("top_k", -1), seed=d.get("seed"), max_tokens=d.get("max_tokens", 64),
                              min_tokens=d.get("min_tokens", 0))

    async def _one(self, prompt: str, params: Any) -> Any:
        final = None
        async for output in self.engine.generate({"prompt": prompt}, params, f"{self._prefix}-{next(self._ids)}"):
            final = output
        return final

    async def _all(self, prompts: list[str]) -> list[Any]:
        params = self._params()
        return await asyncio.gather(*(self._one(p, params) for p in prompts))

    def _send(self, prompts: list[tuple[int, str]], version: int, split: bool) -> list[Rollout]:
        start = time.perf_counter()
        future = asyncio.run_coroutine_threadsafe(self._all([p for _, p in prompts]), self.loop)
        try:
            outputs = future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()  # leaving the generators aborts the requests on every stage
            raise RetryableRolloutError(f"no answer within {self.timeout_s} s") from None
        except (ValueError, TypeError) as exc:
            raise RolloutError(f"the in-process pipeline refused the rollout batch: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - an engine failure: worth a smaller retry
            raise RetryableRolloutError(repr(exc)) from exc
        latency = time.perf_counter() - start
        self.stats.latencies.append(latency)
        rollouts = []
        for (index, _), output in zip(prompts, outputs):
            made_by = self._made_by(_version_of(output), version)
            completion = output.outputs[0]
            rollouts.append(Rollout(index, completion.text, completion.finish_reason, made_by, latency, split))
        return rollouts
