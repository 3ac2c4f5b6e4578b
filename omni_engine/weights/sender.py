"""``WeightSender``: the trainer's side of a weight push into a running pipeline.

It turns a ``state_dict`` (or any iterable of ``(name, tensor)``) into the
``update_info`` chunks of the ``shm`` or ``zmq`` backend, in bounded chunks, and
drives vLLM's protocol through any client with its four weight methods:
vLLM's ``HTTPVLLMWeightSyncClient``, ``OmniHTTPWeightSyncClient`` (the same, with
an API key and the fence routes), or a ``MultiStageEngineClient`` in-process
(``push_async``).

    sender = WeightSender("shm")
    client = OmniHTTPWeightSyncClient("http://host:8000", api_key="...")
    client.init_weight_transfer_engine(sender.init_info())
    sender.push(client, model.state_dict(), version="step-12")
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from omni_engine.connectors.shm import ShmSegment, new_run_prefix
from omni_engine.weights.layout import aligned, dtype_name

DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 60.0

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _items(weights: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    return iter(weights.items()) if isinstance(weights, Mapping) else iter(weights)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's data as a flat uint8 tensor on the host (no copy when it is already there)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class WeightSender:
    """Pushes named tensors to the stages over ``shm`` (this host) or ``zmq`` (any host)."""

    def __init__(self, backend: str = "shm", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 bind: str = "tcp://127.0.0.1:0", curve: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """``chunk_bytes`` bounds what one ``update_weights`` carries (a larger tensor goes alone).
        ``bind``/``curve``: where the zmq backend serves chunks, and whether with CURVE.
        ``timeout_s``: how long a stage waits for a zmq chunk before failing the update."""
        if backend not in ("shm", "zmq"):
            raise ValueError(f"WeightSender: backend must be 'shm' or 'zmq', got {backend!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"WeightSender: chunk_bytes must be positive, got {chunk_bytes}")
        self.backend = backend
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self._prefix = new_run_prefix()
        self._segment: ShmSegment | None = None
        self._server: Any = None
        if backend == "zmq":
            from omni_engine.weights.zmq_transport import ChunkServer

            self._server = ChunkServer(bind, curve)

    # ------------------------------------------------------------ protocol
    def init_info(self) -> dict[str, Any]:
        """What ``init_weight_transfer_engine`` takes for this sender (JSON-safe)."""
        if self._server is not None:
            return self._server.init_info(self.timeout_s)
        return {}

    def update_infos(self, weights: NamedTensors) -> Iterator[dict[str, Any]]:
        """One ``update_info`` per chunk. A chunk's data is in place when it is yielded and is
        overwritten when the next is asked for: send each before advancing."""
        push_id = secrets.token_hex(6)
        for index, chunk in enumerate(self._chunks(weights)):
            names = [name for name, _ in chunk]
            info: dict[str, Any] = {
                "names": names,
                "dtype_names": [dtype_name(t.dtype) for _, t in chunk],
                "shapes": [list(t.shape) for _, t in chunk],
            }
            data = [_as_bytes(t) for _, t in chunk]
            if self._server is not None:
                self._server.offer(push_id, index, [d.numpy() for d in data])
                info.update(push_id=push_id, chunk=index)
            else:
                info.update(self._write_shm(data))
            yield info
        if self._server is not None:
            self._server.withdraw()

    def push(self, client: Any, weights: NamedTensors, version: str | None = None, mode: str | None = None) -> int:
        """start, every chunk, finish(version) through a synchronous client (vLLM's
        ``VLLMWeightSyncClient`` shape); the number of chunks. A failure aborts the update
        on the engine side (nothing is loaded) and is raised.

        ``mode`` ("wait", "abort", "keep") fences the push with the client's ``pause`` /
        ``reset_prefix_cache`` / ``resume`` (``OmniHTTPWeightSyncClient`` has them)."""
        if mode is not None:
            client.pause(mode)
        try:
            client.start_weight_update()
            chunks = 0
            for info in self.update_infos(weights):
                client.update_weights(info)
                chunks += 1
            client.finish_weight_update(version)
            if mode is not None:
                client.reset_prefix_cache()
        finally:
            if mode is not None:
                client.resume()
        return chunks

    async def push_async(self, engine: Any, weights: NamedTensors, version: str, mode: str = "wait") -> int:
        """The whole fenced update on an in-process ``MultiStageEngineClient``: pause (``mode``),
        transfer, commit with ``version``, reset the prefix cache, resume."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        chunks = 0
        async with engine.weight_update(version, mode=mode):
            for info in self.update_infos(weights):
                await engine.update_weights(WeightTransferUpdateRequest(update_info=info))
                chunks += 1
        return chunks

    # -------------------------------------------------------------- chunks
    def _chunks(self, weights: NamedTensors) -> Iterator[list[tuple[str, torch.Tensor]]]:
        chunk: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in _items(weights):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"WeightSender: weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            nbytes = aligned(tensor.numel() * tensor.element_size())
            if chunk and size + nbytes > self.chunk_bytes:
                yield chunk
                chunk, size = [], 0
            chunk.append((name, tensor))
            size += nbytes
        if chunk:
            yield chunk

    def _write_shm(self, data: list[torch.Tensor]) -> dict[str, Any]:
        offsets, end = [], 0
        for d in data:
            offsets.append(end)
            end += aligned(d.numel())
        segment = self._segment_of(max(end, 1))
        for offset, d in zip(offsets, data):
            if d.numel():
                torch.frombuffer(segment.view(offset, d.numel()), dtype=torch.uint8).copy_(d)
        return {"segment": segment.name, "offsets": offsets}

    def _segment_of(self, size: int) -> ShmSegment:
        """The segment chunks are written to: made once (pre-faulted) and reused, grown if a chunk needs more."""
        if self._segment is not None and self._segment.size >= size:
            return self._segment
        self._close_segment()
        name = f"{self._prefix}_w{secrets.token_hex(2)}"
        self._segment = ShmSegment.create(name, size)
        return self._segment

    def _close_segment(self) -> None:
        if self._segment is not None:
            self._segment.unlink()
            self._segment.close()
            self._segment = None

    def close(self) -> None:
        """Free the segment / the zmq server; idempotent."""
        self._close_segment()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> "WeightSender":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close_segment()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
