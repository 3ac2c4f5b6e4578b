"""A directory holding one derived ``config.json``, made once per content in the cache.

A stage that runs part of a checkpoint (a talker) points vLLM's ``hf_config_path`` at a config of
that part alone while ``model`` stays the checkpoint; the directory is named by a digest of its
content, so a changed checkpoint or derivation gets a directory of its own and none is rewritten
under a running engine.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omni_engine import envs


def derived_config_dir(name: str, config: dict[str, Any], version: int, cache_dir: Path | None = None) -> Path:
    """``<cache>/derived/<name>-<digest>/config.json`` with ``config`` (written if missing)."""
    content = json.dumps(config, indent=2, sort_keys=True) + "\n"
    digest = hashlib.sha256(f"{version}\n{content}".encode()).hexdigest()[:16]
    target = (cache_dir or envs.cache_dir()) / "derived" / f"{name}-{digest}"
    config_path = target / "config.json"
    if not config_path.is_file() or config_path.read_text() != content:
        target.mkdir(parents=True, exist_ok=True)
        staging = target / f".config.json.{digest}.tmp"
        staging.write_text(content)
        staging.replace(config_path)
    return target
