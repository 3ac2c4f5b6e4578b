"""Small generation models for tests that need tensors, not speech.

Importable by stage processes (``tests.models:...``) because spawned
processes inherit the test session's ``sys.path``.
"""

from __future__ import annotations

from typing import Any

import torch

from omni_engine.connectors.shm import SEGMENT_INDEX
from omni_engine.engines.generation_model import GenerationRequest
from omni_engine.entrypoints.input_processors import StageInput


class _Model:
    output_type = "tensor"

    def info(self) -> dict[str, Any]:
        return {"engine": type(self).__name__}

    async def shutdown(self) -> None:
        pass


class TensorSource(_Model):
    """Answers ``{"nbytes": N}`` with ``{"tensor": uint8 tensor of N bytes, all N % 251}``."""

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        return [{"tensor": torch.full((r.prompt["nbytes"],), r.prompt["nbytes"] % 251, dtype=torch.uint8)}
                for r in requests]


class TensorSink(_Model):
    """Reports where the tensor it was given lives and what it holds."""

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        results = []
        for r in requests:
            t = r.prompt["tensor"]
            found = SEGMENT_INDEX.find(t.data_ptr(), t.numel() * t.element_size())
            results.append({
                "nbytes": t.numel(), "segment": found[0] if found else "",
                "first": int(t[0]), "all_same": bool((t == t[0]).all()),
            })
        return results


def make_tensor_source() -> TensorSource:
    return TensorSource()


def make_tensor_sink() -> TensorSink:
    return TensorSink()


class ForwardTensor:
    """Input processor: the source's tensor goes on as the next stage's prompt."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.sources = sources

    def on_output(self, output: Any, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[StageInput]:
        return [StageInput({"tensor": outputs[s][-1].multimodal_output["tensor"]}) for s in self.sources]


class Calc(_Model):
    """Applies ``op`` to the prompt's ``values``: a tiny stage for graph tests."""

    OPS = {"add1": lambda v: v[0] + 1, "times10": lambda v: v[0] * 10, "sum": sum}

    def __init__(self, op: str) -> None:
        self.op = self.OPS[op]

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        return [{"value": self.op(r.prompt["values"])} for r in requests]


def make_calc(op: str) -> Calc:
    return Calc(op)


class CollectValues:
    """Input processor: one request whose ``values`` are every source's result, in source order."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.sources = sources

    def on_output(self, output: Any, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[StageInput]:
        return [StageInput({"values": [outputs[s][-1].multimodal_output["value"] for s in self.sources]})]


class FatalModel(_Model):
    """Fails as an engine that can no longer serve (the stage must send DEAD and exit)."""

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        from omni_engine.engines.base import StageEngineError

        raise StageEngineError("device lost")


def make_fatal() -> FatalModel:
    return FatalModel()
