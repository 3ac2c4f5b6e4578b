"""Benchmark-only generation models (``engine_args.model_factory`` targets).

Used by ``benchmarks/bench_stage_ipc.py``; they do no work of their own so that
what is measured is the stage machinery (ZMQ, serialization, shared memory).
Kept free of heavy imports at module level: the stage process imports this.
"""

from __future__ import annotations

from typing import Any


class EchoModel:
    """Answers every request at once with a tiny result: ``{"echo": prompt}``."""

    output_type = "echo"

    async def generate(self, requests: list[Any]) -> list[dict[str, Any]]:
        return [{"echo": r.prompt} for r in requests]

    def info(self) -> dict[str, Any]:
        return {"engine": "bench-echo"}

    async def shutdown(self) -> None:
        pass


class TensorSourceModel:
    """Answers ``{"nbytes": N}`` with ``{"tensor": t}``, a preallocated uint8 tensor of N bytes.

    Tensors are made (and touched) on the first request of a size and reused,
    so what a request costs is moving the bytes, not producing them. Every
    byte of the N-byte tensor is ``N % 251`` so the consumer can spot-check it.
    """

    output_type = "tensor"

    def __init__(self) -> None:
        self._tensors: dict[int, Any] = {}

    def tensor(self, nbytes: int) -> Any:
        t = self._tensors.get(nbytes)
        if t is None:
            import torch

            t = self._tensors[nbytes] = torch.full((nbytes,), nbytes % 251, dtype=torch.uint8)
        return t

    async def generate(self, requests: list[Any]) -> list[dict[str, Any]]:
        return [{"tensor": self.tensor(int(r.prompt["nbytes"]))} for r in requests]

    def info(self) -> dict[str, Any]:
        return {"engine": "bench-tensor-source"}

    async def shutdown(self) -> None:
        self._tensors.clear()


def make_echo(**_: Any) -> EchoModel:
    return EchoModel()


def make_tensor_source(**_: Any) -> TensorSourceModel:
    return TensorSourceModel()
