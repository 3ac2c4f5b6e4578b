"""What one chunk of a weight push says about its tensors, for both ends.

The trainer side (``WeightSender``) writes it and the stage side
(``StagedWeightTransferEngine``) reads it. It is vLLM's own shape for
``update_info`` (``names``, ``dtype_names``, ``shapes``, as its NCCL and IPC
backends send) plus where each tensor's bytes are: an offset into a shared-memory
segment (``shm``) or a chunk to fetch (``zmq``). Everything is JSON-safe, so the
same dict travels through ``/update_weights`` over HTTP, vLLM's
``HTTPVLLMWeightSyncClient`` included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# Tensors start at multiples of this in a segment (a cache line: aligned copies).
ALIGNMENT = 64


def dtype_from_name(name: str, where: str) -> torch.dtype:
    """``torch.float32`` from "float32" (or "torch.float32"); ValueError naming ``where`` otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype (e.g. 'float32', 'bfloat16')")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass
class ShmUpdateInfo:
    """One chunk of a ``shm`` push: tensor ``i`` is ``nbytes(i)`` bytes at ``offsets[i]`` of ``segment``."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    segment: str
    offsets: list[int]


@dataclass
class ZmqUpdateInfo:
    """One chunk of a ``zmq`` push: the stage asks the sender for chunk ``chunk`` of push ``push_id``
    and receives one frame per tensor, in ``names`` order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    push_id: str
    chunk: int


@dataclass
class ShmInitInfo:
    """Nothing to rendezvous for shared memory; the segment is named per chunk."""


@dataclass
class ZmqInitInfo:
    """Where the sender serves chunks. ``server_public_key`` (z85) turns CURVE on; the client
    keypair is the one the sender's authenticator admits (secret: this travels only over the
    engine's authenticated control routes)."""

    address: str
    server_public_key: str | None = None
    client_public_key: str | None = None
    client_secret_key: str | None = None
    timeout_s: float = 60.0


@dataclass(frozen=True)
class TensorSpec:
    """What a pushed tensor must be: its checkpoint name, shape and the dtypes a stage accepts."""

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...] = field(default=())


def check_lists(info: Any, where: str) -> None:
    """The parallel lists of an update info have one entry per tensor, of the right kinds."""
    n = len(info.names)
    for attr in ("dtype_names", "shapes") + (("offsets",) if hasattr(info, "offsets") else ()):
        values = getattr(info, attr)
        if not isinstance(values, list) or len(values) != n:
            raise ValueError(f"{where}: update_info.{attr} must be a list with one entry per name "
                             f"({n} names), got {values!r:.200}")
    for i, name in enumerate(info.names):
        if not isinstance(name, str):
            raise ValueError(f"{where}: update_info.names[{i}] is {type(name).__name__}, not a string")
        shape = info.shapes[i]
        if not isinstance(shape, (list, tuple)) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"{where}: tensor {name!r}: shape {shape!r} is not a list of sizes")


def parse_init_info(init_dict: dict[str, Any]) -> ShmInitInfo | ZmqInitInfo:
    """The backend's init info: zmq when it names the sender's ``address``, else shm (nothing to set up)."""
    if not isinstance(init_dict, dict):
        raise ValueError(f"init_weight_transfer_engine: init_info must be a JSON object, got "
                         f"{type(init_dict).__name__}")
    cls = ZmqInitInfo if "address" in init_dict else ShmInitInfo
    try:
        return cls(**init_dict)
    except TypeError as exc:
        raise ValueError(f"init_weight_transfer_engine: invalid init_info for the "
                         f"{'zmq' if cls is ZmqInitInfo else 'shm'} backend: {exc}") from None


def parse_update_info(update_dict: dict[str, Any]) -> ShmUpdateInfo | ZmqUpdateInfo:
    """One chunk's update info, told apart by what it holds: a segment (shm) or a push id (zmq)."""
    if not isinstance(update_dict, dict):
        raise ValueError(f"update_weights: update_info must be a JSON object, got {type(update_dict).__name__}")
    cls = ShmUpdateInfo if "segment" in update_dict else ZmqUpdateInfo if "push_id" in update_dict else None
    if cls is None:
        raise ValueError("update_weights: update_info is neither a shm chunk (names, dtype_names, shapes, "
                         "segment, offsets) nor a zmq chunk (names, dtype_names, shapes, push_id, chunk); "
                         f"got keys {sorted(update_dict)}")
    try:
        return cls(**update_dict)
    except TypeError as exc:
        raise ValueError(f"update_weights: invalid update_info: {exc}") from None
