"""Rank 0's push: the learner's full state dict into the rollout server, as one fenced weight update."""

from __future__ import annotations

import time
from typing import Any

import torch

from omni_engine.rl.rollout_client import numeric_version
from omni_engine.weights import OmniHTTPWeightSyncClient, WeightSender


class LearnerWeightPusher:
    """Pushes ``model``'s weights (the unwrapped module, not the DDP wrapper) to ``url`` under an
    integer version, through the server's RL routes (``VLLM_SERVER_DEV_MODE=1``): ``shm`` on the
    server's host, ``zmq`` from any host. ``fence`` is what the server does with requests in flight
    (the learner's own are drained by the RequestGate before this runs)."""

    def __init__(self, url: str, model: torch.nn.Module, *, backend: str = "shm", api_key: str | None = None,
                 fence: str = "wait", bind: str = "tcp://127.0.0.1:0") -> None:
        self.model = model
        self.fence = fence
        self.client = OmniHTTPWeightSyncClient(url, api_key=api_key)
        self.sender = WeightSender(backend, bind=bind)
        self.client.init_weight_transfer_engine(self.sender.init_info())
        self.pushes: list[dict[str, Any]] = []

    def server_version(self) -> int:
        """The server's weight version as an integer (0 when it has none yet or a non-numeric label)."""
        return numeric_version(self.client.weight_version()) or 0

    def __call__(self, version: int) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            state = {name: t.detach() for name, t in self.model.state_dict().items()}
            chunks = self.sender.push(self.client, state, version=str(version), mode=self.fence)
        self.pushes.append({"version": version, "chunks": chunks, "seconds": time.perf_counter() - start})

    def close(self) -> None:
        self.sender.close()
