"""Environment variables read by omni_engine, in one place (as vllm/envs.py).

Each is read when accessed, so tests and benchmarks can set them at run time.
"""

from __future__ import annotations

import os
from pathlib import Path


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def allow_pickle() -> bool:
    """Whether the stage wire format may carry pickled objects (off: unsafe)."""
    return _bool("OMNI_ENGINE_ALLOW_PICKLE", False)


def inline_threshold() -> int:
    """Tensors smaller than this many bytes travel inside the msgpack body."""
    return _int("OMNI_ENGINE_INLINE_THRESHOLD", 256)


def shm_threshold() -> int:
    """Tensors of at least this many bytes travel through shared memory."""
    return _int("OMNI_ENGINE_SHM_THRESHOLD", 1 << 20)


def shm_pool_bytes() -> int:
    """Upper bound of one stage's shared-memory pool; beyond it, ZMQ frames."""
    return _int("OMNI_ENGINE_SHM_POOL_BYTES", 2 << 30)


def shm_dir() -> Path:
    """Where POSIX shared memory lives (tmpfs)."""
    return Path(os.environ.get("OMNI_ENGINE_SHM_DIR", "/dev/shm"))


def use_shm() -> bool:
    return _bool("OMNI_ENGINE_USE_SHM", True)


def stage_startup_timeout_s() -> float:
    return float(_int("OMNI_ENGINE_STAGE_STARTUP_TIMEOUT", 600))


def cache_dir() -> Path:
    raw = os.environ.get("OMNI_ENGINE_CACHE")
    return Path(raw) if raw else Path.home() / ".cache" / "omni_engine"


def use_new_architecture() -> bool:
    """``VLLM_OMNI_USE_NEW_ARCHITECTURE``: ``AsyncOmni`` on ZMQ stage processes
    (1, the default) or on the deprecated ``multiprocessing.Queue`` ones (0)."""
    return _bool("VLLM_OMNI_USE_NEW_ARCHITECTURE", True)
