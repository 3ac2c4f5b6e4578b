"""Rollout sampling: n answers per prompt over a dataset, in rounds, into crash-safe shards.

``BaseSampler`` (``OpenAISampler``, ``EngineSampler``, ``RaySampler``) produces
answers; ``Pipeline`` runs the rounds, verification, early stop and shards over
any of them. The CLI is ``omni-engine sample --config sample.yaml``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omni_engine.sampling.base import BaseSampler, SamplerInitError, SamplerUnavailable, WorkQueue
from omni_engine.sampling.config import SampleConfig, SamplerConfig, load_sample_config, parse_sample_config
from omni_engine.sampling.items import BatchResult, ItemResult, Response, SampleTask

if TYPE_CHECKING:
    from pathlib import Path


def make_sampler(config: SamplerConfig, base_dir: str | Path = ".") -> BaseSampler:
    """The sampler ``config.kind`` names (imports only that backend)."""
    if config.kind == "openai":
        from omni_engine.sampling.openai_sampler import OpenAISampler

        return OpenAISampler(config)
    if config.kind == "engine":
        from omni_engine.sampling.engine_sampler import EngineSampler

        return EngineSampler(config, base_dir=base_dir)
    if config.kind == "ray":
        from omni_engine.sampling.ray_sampler import RaySampler

        return RaySampler(config, base_dir=str(base_dir))
    raise ValueError(f"sampler.kind: unknown sampler kind {config.kind!r}")


__all__ = [
    "BaseSampler",
    "BatchResult",
    "ItemResult",
    "Response",
    "SampleConfig",
    "SampleTask",
    "SamplerConfig",
    "SamplerInitError",
    "SamplerUnavailable",
    "WorkQueue",
    "load_sample_config",
    "make_sampler",
    "parse_sample_config",
]
