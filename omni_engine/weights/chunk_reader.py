"""``ChunkReader``: the bytes of one pushed chunk, wherever the sender put them.

The stage (to stage the chunk) and the pipeline client (to keep it for replicas
that restart) both read every chunk: from the sender's shared-memory segment
(``shm``, mapped once and reused, as the sender reuses it) or from the sender's
socket (``zmq``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from omni_engine.weights.layout import ShmUpdateInfo, ZmqInitInfo, ZmqUpdateInfo


def numel(shape: list[int]) -> int:
    return math.prod(shape)


class ChunkReader:
    """One buffer per tensor of a chunk (views of the segment, or received frames)."""

    def __init__(self) -> None:
        self._segment: Any = None
        self._fetcher: Any = None

    def connect(self, init_info: ZmqInitInfo) -> None:
        """Where zmq chunks come from (the sender's address and CURVE keys)."""
        from omni_engine.weights.zmq_transport import ChunkFetcher

        self.close_fetcher()
        self._fetcher = ChunkFetcher(init_info.address, init_info.server_public_key, init_info.timeout_s,
                                     init_info.client_public_key, init_info.client_secret_key)

    def buffers(self, info: ShmUpdateInfo | ZmqUpdateInfo, dtypes: list[torch.dtype]) -> list[Any]:
        buffers = self._shm_buffers(info, dtypes) if isinstance(info, ShmUpdateInfo) else self._fetched(info)
        for name, dtype, shape, buf in zip(info.names, dtypes, info.shapes, buffers):
            if memoryview(buf).nbytes != numel(shape) * dtype.itemsize:
                raise ValueError(f"update_weights: tensor {name!r}: {memoryview(buf).nbytes} bytes arrived, shape "
                                 f"{shape} of {dtype} is {numel(shape) * dtype.itemsize}")
        return buffers

    def _shm_buffers(self, info: ShmUpdateInfo, dtypes: list[torch.dtype]) -> list[memoryview]:
        from omni_engine.connectors.shm import ShmSegment

        segment = self._segment
        if segment is None or segment.name != info.segment:
            self.close_segment()
            try:
                segment = self._segment = ShmSegment.attach(info.segment)
            except (FileNotFoundError, ValueError) as exc:
                raise ValueError(f"update_weights: cannot map shared-memory segment {info.segment!r} ({exc}); "
                                 "the shm backend needs the sender on the stage's host (use the zmq backend "
                                 "across hosts)") from None
        buffers = []
        for name, dtype, shape, offset in zip(info.names, dtypes, info.shapes, info.offsets):
            try:
                buffers.append(segment.view(int(offset), numel(shape) * dtype.itemsize))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"update_weights: tensor {name!r}: {exc}") from None
        return buffers

    def _fetched(self, info: ZmqUpdateInfo) -> list[Any]:
        if self._fetcher is None:
            raise ValueError("update_weights: a zmq chunk, but no zmq sender is known here: call "
                             "init_weight_transfer_engine with the sender's init_info first")
        frames = self._fetcher.fetch(info.push_id, int(info.chunk))
        if len(frames) != len(info.names):
            raise ValueError(f"update_weights: chunk {info.chunk} of push {info.push_id!r} has {len(frames)} "
                             f"tensors, the update_info names {len(info.names)}")
        return frames

    def close_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def close_fetcher(self) -> None:
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None

    def close(self) -> None:
        self.close_segment()
        self.close_fetcher()
