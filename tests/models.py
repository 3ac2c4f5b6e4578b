"""Small generation models for tests that need tensors, not speech.

Importable by stage processes (``tests.models:...``) because spawned
processes inherit the test session's ``sys.path``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from omni_engine.connectors.shm import SEGMENT_INDEX
from omni_engine.engines.generation_model import GenerationRequest
from omni_engine.pipeline.input_processors import StageInput


class _Model:
    output_type = "tensor"

    def info(self) -> dict[str, Any]:
        return {"engine": type(self).__name__}

    async def shutdown(self) -> None:
        pass


class TensorSource(_Model):
    """Answers ``{"nbytes": N}`` with ``{"tensor": uint8 tensor of N bytes, all N % 251}``.

    With ``"into_slot": true`` the tensor is written straight into the stage's
    shared memory (``empty_output``); with ``"fail": true`` it fails after
    that, so the slot is never sent.
    """

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        from omni_engine.connectors.shm import empty_output

        results: list[Any] = []
        for r in requests:
            n = r.prompt["nbytes"]
            if r.prompt.get("into_slot"):
                t = torch.frombuffer(empty_output(n, r.request_id), dtype=torch.uint8).fill_(n % 251)
            else:
                t = torch.full((n,), n % 251, dtype=torch.uint8)
            results.append(RuntimeError("failed after writing its output") if r.prompt.get("fail")
                           else {"tensor": t})
        return results


class TensorSink(_Model):
    """Reports where the tensor it was given lives and what it holds.

    ``delay`` (or a request's ``"delay"``): seconds a batch takes -- work that
    keeps a request in flight, so a test can abort it or kill a stage while
    the tensor is held.
    """

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        delay = max([self.delay] + [r.prompt.get("delay", 0.0) for r in requests])
        if delay:
            await asyncio.sleep(delay)
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


class CheckedTensorSource(_Model):
    """TensorSource that judges each prompt alone (a bad one fails alone, as ValueError)
    and may first wait ``delay`` seconds, so that a request stays in flight."""

    MAX_BYTES = 64 << 20

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        results: list[Any] = []
        for r in requests:
            p = r.prompt
            ok = (isinstance(p, dict) and type(p.get("nbytes")) is int and 0 <= p["nbytes"] <= self.MAX_BYTES
                  and isinstance(p.get("delay", 0), (int, float)) and 0 <= p.get("delay", 0) <= 10)
            if not ok:
                results.append(ValueError(f"prompt must be {{'nbytes': 0..{self.MAX_BYTES}, 'delay': 0..10}}, "
                                          f"got {type(p).__name__}"))
                continue
            deadline = asyncio.get_running_loop().time() + p.get("delay", 0)
            while not r.aborted and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)  # in steps: an aborted request stops waiting
            results.append({"tensor": torch.full((p["nbytes"],), p["nbytes"] % 251, dtype=torch.uint8)})
        return results


def make_checked_tensor_source() -> CheckedTensorSource:
    return CheckedTensorSource()


def make_tensor_sink(delay: float = 0.0) -> TensorSink:
    return TensorSink(delay)


class KeyedBatches(_Model):
    """Renders in one pass only prompts of one ``"shape"`` (``batch_key``), as a vocoder's windows;
    records each batch's request ids. A prompt's ``"hold"`` (an asyncio.Event) keeps its batch
    running until set, so that requests queue behind it. A prompt without a shape cannot be keyed."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def batch_key(self, request: GenerationRequest) -> Any:
        return request.prompt["shape"]

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        self.batches.append([r.request_id for r in requests])
        for r in requests:
            if "hold" in r.prompt:
                await r.prompt["hold"].wait()
        return [{"shape": r.prompt["shape"]} if "shape" in r.prompt else ValueError(f"request {r.request_id!r}: no shape")
                for r in requests]


def make_keyed_batches() -> KeyedBatches:
    return KeyedBatches()


class ForwardTensor:
    """Input processor: the source's tensor goes on as the next stage's prompt
    (with the request's ``"sink_delay"``, if it has one, as the sink's ``"delay"``)."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.sources = sources
        self.extra = {"delay": prompt["sink_delay"]} if isinstance(prompt, dict) and "sink_delay" in prompt else {}

    def on_output(self, output: Any, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[StageInput]:
        return [StageInput({"tensor": outputs[s][-1].multimodal_output["tensor"], **self.extra})
                for s in self.sources]


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


def make_slow_loader(seconds: float = 60.0) -> Any:
    """A model that takes ``seconds`` to load (a stage that overruns its startup timeout: the
    real ones start in well under a second now that they import no vLLM)."""
    import time

    time.sleep(seconds)
    return TensorSource()


def make_unloadable() -> Any:
    """A model whose loading fails (the stage must not become ready)."""
    raise FileNotFoundError("weights.bin is missing")


class NegateValues:
    """Input processor: one request per source, holding its result negated
    (an edge processor that differs from ``CollectValues`` in what it builds)."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.sources = sources

    def on_output(self, output: Any, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[StageInput]:
        return [StageInput({"values": [-outputs[s][-1].multimodal_output["value"]]}) for s in self.sources]


class EnvProbe(_Model):
    """Answers with the value of environment variable ``name`` in the stage process."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        import os

        return [{"env": os.environ.get(self.name, "")} for _ in requests]


def make_env_probe(name: str) -> EnvProbe:
    return EnvProbe(name)


class PidProbe(_Model):
    """Answers with its process id (which replica ran the request) and the prompt's ``index``,
    after ``delay`` seconds of waiting (work that takes time but no CPU)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        import os

        if self.delay:
            await asyncio.sleep(self.delay)
        return [{"pid": os.getpid(), "index": r.prompt.get("index", 0)} for r in requests]


def make_pid_probe(delay: float = 0.0) -> PidProbe:
    return PidProbe(delay)


class LoopHolder(_Model):
    """Computes for ``hold`` seconds without awaiting (a model that blocks its event loop), then
    awaits ``wait`` seconds (work that takes time but holds nothing), and answers ``{"held": hold}``."""

    def __init__(self, hold: float = 0.0, wait: float = 0.0) -> None:
        self.hold, self.wait = hold, wait

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        import time

        time.sleep(self.hold)
        await asyncio.sleep(self.wait)
        return [{"held": self.hold} for _ in requests]


def make_loop_holder(hold: float = 0.0, wait: float = 0.0) -> LoopHolder:
    return LoopHolder(hold, wait)


class FanOut:
    """Input processor: the prompt's ``fan_out`` requests to the next stage, ``{"index": i}`` each
    (sub-requests of one request, as sentences become speech requests)."""

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.n = prompt.get("fan_out", 1) if isinstance(prompt, dict) else 1

    def on_output(self, output: Any, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[StageInput]:
        return [StageInput({"index": i}) for i in range(self.n)]


class ClockedSentence:
    """Input processor that follows its request's listener clock (``FollowsPlayback``): keeps the
    clock in ``clocks`` under the prompt's ``tag`` and sends the next stage one sentence to speak."""

    clocks: dict[str, Any] = {}

    def __init__(self, sources: list[int], dst: int, prompt: Any = None) -> None:
        self.tag = prompt.get("tag") if isinstance(prompt, dict) else None

    def follow_playback(self, clock: Any) -> None:
        ClockedSentence.clocks[self.tag] = clock

    def on_output(self, output: Any, new_text: str) -> list[StageInput]:
        return []

    def on_finish(self, outputs: dict[int, list[Any]], text: dict[int, str]) -> list[StageInput]:
        return [StageInput("A sentence to speak.")]


class StallingVoice(_Model):
    """A voice for the listener tests: each sentence is ``seconds`` of a tone, made at once, except one
    containing ``stall_word``, which comes ``stall_s`` late (an ``asyncio.sleep``: the stage's loop
    serves on meanwhile)."""

    output_type = "audio"

    def __init__(self, seconds: float = 0.5, stall_s: float = 2.0, stall_word: str = "STALL",
                 sample_rate: int = 16000) -> None:
        self.seconds, self.stall_s, self.stall_word, self.sample_rate = seconds, stall_s, stall_word, sample_rate

    async def generate(self, requests: list[GenerationRequest]) -> list[Any]:
        import numpy as np

        out = []
        for request in requests:
            text = request.prompt if isinstance(request.prompt, str) else str(request.prompt.get("prompt", ""))
            if self.stall_word in text:
                await asyncio.sleep(self.stall_s)
            t = np.arange(int(self.seconds * self.sample_rate)) / self.sample_rate
            out.append({"audio": (0.3 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32),
                        "sample_rate": self.sample_rate})
        return out


def make_stalling_voice(**kwargs: Any) -> StallingVoice:
    return StallingVoice(**{k: v for k, v in kwargs.items() if k in ("seconds", "stall_s", "stall_word")})
