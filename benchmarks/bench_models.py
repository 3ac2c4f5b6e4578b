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


class FreshTensorSourceModel:
    """Answers ``{"nbytes": N}`` with a *new* uint8 tensor of N bytes and the time it was made.

    New each time, as a model's outputs are: a source that re-sent one buffer
    would let pickle's shared-memory path skip its copy, and would be wrong
    (the consumer would see the next request's bytes). ``made_at`` is
    ``time.monotonic()`` (one clock for every process of the machine), so the
    sink can time the transfer alone, without the making of the tensor.
    """

    output_type = "tensor"

    async def generate(self, requests: list[Any]) -> list[dict[str, Any]]:
        import time

        import torch

        from omni_engine.connectors.shm import empty_output

        results = []
        for r in requests:
            nbytes = int(r.prompt["nbytes"])
            if r.prompt.get("into_slot"):  # written where it will be sent from: no copy at all
                tensor = torch.frombuffer(empty_output(nbytes, r.request_id), dtype=torch.uint8)
            else:
                tensor = torch.empty(nbytes, dtype=torch.uint8)
            tensor.fill_(nbytes % 251)
            results.append({"tensor": tensor, "made_at": time.monotonic()})
        return results

    def info(self) -> dict[str, Any]:
        return {"engine": "bench-fresh-tensor-source"}

    async def shutdown(self) -> None:
        pass


class TensorSinkModel:
    """Takes ``{"tensor", "made_at"}``; answers when it got it and whether the bytes are right."""

    output_type = "tensor"

    async def generate(self, requests: list[Any]) -> list[dict[str, Any]]:
        import time

        now = time.monotonic()
        results = []
        for r in requests:
            t = r.prompt["tensor"]
            n = t.numel()
            results.append({"nbytes": n, "made_at": r.prompt["made_at"], "received_at": now,
                            "ok": int(t[0]) == int(t[n - 1]) == n % 251})
        return results

    def info(self) -> dict[str, Any]:
        return {"engine": "bench-tensor-sink"}

    async def shutdown(self) -> None:
        pass


class ForwardStampedTensor:
    """Input processor: the source's tensor and its ``made_at`` go on to the sink."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.source = sources[0]

    def on_output(self, output: Any, new_text: str) -> list[Any]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[Any]:
        from omni_engine.pipeline.input_processors import StageInput

        made = outputs[self.source][-1].multimodal_output
        return [StageInput({"tensor": made["tensor"], "made_at": made["made_at"]})]


def make_fresh_tensor_source(**_: Any) -> FreshTensorSourceModel:
    return FreshTensorSourceModel()


def make_tensor_sink(**_: Any) -> TensorSinkModel:
    return TensorSinkModel()
