"""``WeightStore``: the last committed push, kept where a new replica process can load it.

A replica that restarts (or is added) after an update must come back on the
pipeline's current weights. The pipeline client keeps them: while the stages
stage a chunk, the client writes the same chunk (read from the sender's
segment, or fetched from the zmq sender as one more consumer) into a
safetensors file, in a thread, so the write overlaps the stages' copies and
never holds a stage's engine. A push becomes the store's current one only
when it commits everywhere; an aborted one is deleted.

By default the store lives in ``/dev/shm`` when it has room: files there are memory,
never written back to a disk. Measured here, 540 MB written to a disk-backed temp dir
per push cost the stages a quarter of their decode throughput for many seconds after
(the kernel flushing dirty pages on the same two cores); in tmpfs, nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from omni_engine.weights.chunk_reader import ChunkReader
from omni_engine.weights.layout import (
    ALIGNMENT,
    ZmqUpdateInfo,
    dtype_from_name,
    parse_init_info,
    parse_update_info,
)

# torch dtype names -> safetensors' names
_SAFETENSORS_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def write_safetensors(path: Path, names: list[str], dtype_names: list[str], shapes: list[list[int]],
                      buffers: list[Any]) -> None:
    """A safetensors file of raw tensor bytes (``buffers``), written without building it in memory."""
    header: dict[str, Any] = {}
    offset = 0
    for name, dtype, shape, buf in zip(names, dtype_names, shapes, buffers):
        st_dtype = _SAFETENSORS_NAMES.get(str(dtype).removeprefix("torch."))
        if st_dtype is None:
            raise ValueError(f"weight store: tensor {name!r} has dtype {dtype}, which safetensors cannot hold")
        nbytes = memoryview(buf).nbytes
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % ALIGNMENT)  # data starts aligned (the format allows padding)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for buf in buffers:
            f.write(buf)
    os.replace(tmp, path)


STORE_PREFIX = "omni-weights-"
# /dev/shm must have this much free to hold the store (a model and a push under way).
MIN_SHM_FREE = 4 << 30


def default_store_root() -> Path:
    """A new directory for this process's store: in ``/dev/shm`` if it has room, else the temp dir.
    Directories of dead processes' stores are removed on the way."""
    from omni_engine.connectors.shm import SHM_DIR
    from omni_engine.stage_engine.stage_sockets import remove_stale_runtime_dirs

    base = Path(tempfile.gettempdir())
    try:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize >= MIN_SHM_FREE:
            base = SHM_DIR
    except OSError:
        pass
    remove_stale_runtime_dirs(STORE_PREFIX, "*-*", base)
    return Path(tempfile.mkdtemp(prefix=f"{STORE_PREFIX}{os.getpid()}-", dir=base))


class WeightStore:
    """Chunks of the push under way (``pending``) and of the last committed one (``current``)."""

    def __init__(self, root: str | Path | None = None) -> None:
        """``root``: the directory to keep pushes in (default: ``default_store_root()``, removed
        by ``close``)."""
        self._own = root is None
        self.root = Path(root) if root is not None else default_store_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.pending = self.root / "pending"
        self.current = self.root / "current"
        self._chunks = 0
        self._reader = ChunkReader()
        self._connected: dict[str, Any] | None = None  # the zmq init info the reader is connected for

    # ------------------------------------------------------------- a push
    def begin(self) -> None:
        shutil.rmtree(self.pending, ignore_errors=True)
        self.pending.mkdir()
        self._chunks = 0

    def write_chunk(self, update_info: dict[str, Any], init_info: dict[str, Any] | None) -> None:
        """Write one chunk of the push under way (blocking: run it in a thread)."""
        info = parse_update_info(update_info)
        if isinstance(info, ZmqUpdateInfo) and init_info != self._connected:
            self._reader.connect(parse_init_info(init_info or {}))  # type: ignore[arg-type]
            self._connected = init_info
        dtypes = [dtype_from_name(d, n) for n, d in zip(info.names, info.dtype_names)]
        buffers = self._reader.buffers(info, dtypes)
        index = self._chunks
        self._chunks += 1
        write_safetensors(self.pending / f"chunk{index:05d}.safetensors", info.names, info.dtype_names,
                          info.shapes, buffers)

    def commit(self) -> None:
        """The push under way is the current one now."""
        self._reader.close_segment()
        old = self.root / "old"
        shutil.rmtree(old, ignore_errors=True)
        if self.current.exists():
            os.replace(self.current, old)
        os.replace(self.pending, self.current)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        self._reader.close_segment()
        shutil.rmtree(self.pending, ignore_errors=True)

    def files(self) -> list[str]:
        """The current push's chunk files, in order ([] before the first commit)."""
        return sorted(str(p) for p in self.current.glob("chunk*.safetensors")) if self.current.exists() else []

    def close(self) -> None:
        self._reader.close()
        if self._own:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            shutil.rmtree(self.pending, ignore_errors=True)
