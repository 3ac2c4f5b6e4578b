"""``RolloutPublisher``: a finished item's rollouts, written to a TransferQueue for a trainer.

Each item that finishes its rounds becomes one ``BatchWrite`` of trajectories in
slime's shape (``uid``, ``instance_id`` = the item's id, ``messages`` = the
prompt and the answer, ``reward`` = the verifier's score, ``extra_info``), so
its kept answers form the item's group in the queue. The queue keeps its own
``group_size``: set it to the answers an item keeps (``max_rollouts`` without
early stop), or give the queue a group timeout for items that stop early.

Uids are ``<run id>:<item id>:<answer index>``. The run id is made once per
output directory (``manifest.json``), and a resumed run replays the rollouts it
journaled, so the items a crash left unconfirmed are written again with the same
uids and the queue's exact dedup drops what had arrived: every answer reaches the
queue once. A full queue is waited for (its ``Retry-After``), never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from omni_engine.sampling.config import TransferQueueOutput

logger = logging.getLogger(__name__)

# The start-up check waits at most this long for the queue to answer (a ZMQ connect never fails by itself).
STARTUP_TIMEOUT_S = 10.0


class PublishError(RuntimeError):
    """The TransferQueue is unreachable or refused a write (the message names the field or item)."""


def trajectory(run_id: str, item: dict[str, Any], index: int, rollout: dict[str, Any]) -> dict[str, Any]:
    """One kept answer as a queue trajectory."""
    return {"uid": f"{run_id}:{item['id']}:{index}",
            "instance_id": item["id"],
            "messages": [*item["messages"], {"role": "assistant", "content": rollout["response"]}],
            "reward": rollout["score"],
            "extra_info": {"run_id": run_id, "round": rollout["round"], "finish_reason": rollout["finish_reason"],
                           "prompt_tokens": rollout["prompt_tokens"],
                           "completion_tokens": rollout["completion_tokens"],
                           "metadata": item.get("metadata", {})}}


def _api_key(cfg: TransferQueueOutput) -> str | None:
    """``api_key``, else the variable ``api_key_env`` names (which must be set), else the client's default."""
    if cfg.api_key is not None or cfg.api_key_env is None:
        return cfg.api_key
    key = os.environ.get(cfg.api_key_env)
    if not key:
        raise PublishError(f"transfer_queue.api_key_env: environment variable {cfg.api_key_env} is not set")
    return key


def _curve(cfg: TransferQueueOutput) -> Any:
    if cfg.curve_server_key is None or cfg.curve_client_key is None:
        return None
    from omni_engine.transfer_queue.security import client_curve_keys

    return client_curve_keys(cfg.curve_server_key, cfg.curve_client_key)


class RolloutPublisher:
    """Writes finished items to the queue ``config`` names; ``start`` checks it answers."""

    def __init__(self, config: TransferQueueOutput) -> None:
        self.config = config
        self.run_id = ""
        self._client = None

    @property
    def target(self) -> str:
        if self.config.rpc_address is not None:
            return f"transfer_queue.rpc_address {self.config.rpc_address}"
        return f"transfer_queue.url {self.config.url}"

    async def start(self, run_id: str) -> None:
        """Connect for the run ``run_id`` (the output directory's: its uids are made of it)."""
        from omni_engine.transfer_queue import AsyncTransferQueueClient

        cfg = self.config
        self.run_id = run_id
        self._client = AsyncTransferQueueClient(url=cfg.url, rpc_address=cfg.rpc_address, timeout=cfg.timeout,
                                                api_key=_api_key(cfg), curve=_curve(cfg))
        try:
            await asyncio.wait_for(self._client.status(), min(cfg.timeout, STARTUP_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - whatever the transport raised, the queue is not usable
            await self.close()
            reason = "no answer in time" if isinstance(exc, asyncio.TimeoutError) else str(exc)
            raise PublishError(f"{self.target}: the transfer queue does not answer: {reason}") from None

    async def publish(self, item: dict[str, Any], rollouts: list[dict[str, Any]]) -> tuple[int, int]:
        """Write ``item``'s rollouts (one batch): (new to the queue, already there)."""
        from omni_engine.transfer_queue import BufferFullError

        assert self._client is not None, "start() first"
        batch = [trajectory(self.run_id, item, i, rollout) for i, rollout in enumerate(rollouts)]
        written = 0
        while True:
            try:
                result = await self._client.batch_write(batch)
            except BufferFullError as exc:
                # What fitted is in (in order); the rest is retried once the queue has room. (Over
                # HTTP the answer does not say: all of it is sent again, the queue dedups.)
                if exc.result is not None:
                    written += exc.result.written
                    batch = batch[len(batch) - exc.result.refused:]
                wait = exc.retry_after_s or 1.0
                logger.info("transfer queue is full; item %s waits %.1f s", item["id"], wait)
                await asyncio.sleep(wait)
                continue
            except Exception as exc:  # noqa: BLE001 - TransferQueueError, or the HTTP transport's own
                raise PublishError(f"{self.target}: writing item {item['id']!r} failed: {exc}") from None
            written += result.written
            return written, len(rollouts) - written

    async def close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.close()
