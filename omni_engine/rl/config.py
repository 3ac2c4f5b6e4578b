"""The actor-learner loop's YAML: schedule, freshness, packing, sync, decoding; checked before anything starts.

Field names follow the seed (``stage2_ab.schedule.b_ratio``, ``stage2_ab.async.version_window``,
``queue_limit``, ``packing_length``, ``packing_min_fill_ratio``, ``sync.mode: full``) so a config
written for it reads the same. Every problem is reported at once, each naming its field, as the
pipeline configs do::

    model: smollm2
    data: {train: data/train.jsonl, heldout: data/heldout.jsonl}
    train: {steps: 24, gradient_accumulation_steps: 2, lr: 2.0e-5}
    packing: {packing_length: 512, packing_min_fill_ratio: 0.6}
    stage2_ab:
      schedule: {b_ratio: 0.5}
      async: {version_window: 1, queue_limit: 8, rollout_batch_size: 4}
    sync: {every_steps: 4, mode: full, backend: shm}
    rollout: {url: "http://127.0.0.1:8000", temperature: 0.01, top_p: 0.95, top_k: -1, seed: 0}
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from omni_engine.config import convert as cv
from omni_engine.config import ConfigError, read_yaml

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
SYNC_MODES = ("full",)
SYNC_BACKENDS = ("shm", "zmq")
FENCE_MODES = ("wait", "abort", "keep")


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class DataConfig(_Base):
    """JSONL files of ``{"messages": [...], "answer": ...}``: channel A trains on ``train`` (and channel
    B draws its prompts from it on a stream of its own); ``heldout`` is only evaluated."""

    train: str
    heldout: str | None = None


class TrainConfig(_Base):
    steps: PositiveInt = 16  # optimizer steps
    gradient_accumulation_steps: PositiveInt = 1  # micro-steps (one packed forward/backward each) per step
    lr: PositiveFloat = 2.0e-5
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    seed: int = 0
    eval_every_steps: NonNegativeInt = 0  # held-out loss every N steps (0: at the start and the end only)


class PackingConfig(_Base):
    packing_length: Annotated[int, msgspec.Meta(ge=16)] = 512  # tokens per packed micro-batch
    # A pack is closed once it is at least this full and the next sample does not fit.
    packing_min_fill_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.6


class ScheduleConfig(_Base):
    b_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.5  # share of optimizer steps that want channel B


class AsyncConfig(_Base):
    """Channel B's background prefetch. ``enabled: false`` runs the synchronous loop (generate, then
    train, in turn): the baseline the benchmark compares against."""

    enabled: bool = True
    version_window: NonNegativeInt = 1  # a pack is consumed only if ver >= current_ver - version_window
    queue_limit: PositiveInt = 8  # ready packs kept per rank; the oldest is dropped beyond it
    rollout_batch_size: PositiveInt = 4  # prompts per rollout request


class Stage2ABConfig(_Base):
    schedule: ScheduleConfig = msgspec.field(default_factory=ScheduleConfig)
    async_: AsyncConfig = msgspec.field(default_factory=AsyncConfig, name="async")


class SyncConfig(_Base):
    every_steps: NonNegativeInt = 4  # push the learner's weights every N optimizer steps (0: never)
    mode: str = "full"  # the whole state dict each time (the only mode a vLLM server takes safely)
    backend: str = "shm"  # shm: learner on the server's host; zmq: any host
    fence: str = "wait"  # what the server does with requests in flight (none of ours: the gate drains them)


class RolloutConfig(_Base):
    """Where rollouts come from and the decoding knobs (logged with every run)."""

    url: str | None = None  # an OpenAI-compatible server; null: the example starts omni-engine serve
    api_key: str | None = None
    model: str | None = None  # the served model name; null: the server's first model
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.01
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.95
    top_k: int = -1
    seed: int | None = 0
    max_tokens: PositiveInt = 64
    # vLLM's min_tokens: EOS is not sampled before this many tokens. Models a task whose rollouts
    # are long (the seed's object lists) while its training targets stay the matched ground truth.
    min_tokens: NonNegativeInt = 0
    timeout_s: PositiveFloat = 120.0
    # A failed or timed-out batch is halved and retried, at most this many halvings deep.
    max_split_depth: NonNegativeInt = 3

    def decoding(self) -> dict[str, Any]:
        knobs = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                 "max_tokens": self.max_tokens}
        if self.min_tokens:  # vLLM's extension of the OpenAI body: sent only when set
            knobs["min_tokens"] = self.min_tokens
        return knobs


class ActorLearnerConfig(_Base):
    model: str  # a prepare-model recipe name (smollm2) or a Hugging Face model directory
    data: DataConfig
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    packing: PackingConfig = msgspec.field(default_factory=PackingConfig)
    stage2_ab: Stage2ABConfig = msgspec.field(default_factory=Stage2ABConfig)
    sync: SyncConfig = msgspec.field(default_factory=SyncConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    base_dir: str = "."
    _not_from_yaml = frozenset({"base_dir"})

    @property
    def prefetch(self) -> AsyncConfig:
        return self.stage2_ab.async_

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p


def _check(config: ActorLearnerConfig, report: cv.Report) -> None:
    ga = config.train.gradient_accumulation_steps
    if config.prefetch.queue_limit < ga:
        report("stage2_ab.async.queue_limit",
               f"{config.prefetch.queue_limit} is below train.gradient_accumulation_steps ({ga}): a B step needs "
               f"that many ready packs per rank, so the feasibility gate could never pass")
    if config.sync.mode not in SYNC_MODES:
        report("sync.mode", f"{config.sync.mode!r}: a vLLM rollout server takes only full weight syncs "
                            f"({', '.join(SYNC_MODES)})")
    if config.sync.backend not in SYNC_BACKENDS:
        report("sync.backend", f"unknown backend {config.sync.backend!r}; expected one of: {', '.join(SYNC_BACKENDS)}")
    if config.sync.fence not in FENCE_MODES:
        report("sync.fence", f"unknown fence mode {config.sync.fence!r}; expected one of: {', '.join(FENCE_MODES)}")
    if config.rollout.top_k == 0 or config.rollout.top_k < -1:
        report("rollout.top_k", f"{config.rollout.top_k}: -1 (off) or a positive number of tokens")
    if config.rollout.min_tokens > config.rollout.max_tokens:
        report("rollout.min_tokens", f"{config.rollout.min_tokens} is above rollout.max_tokens "
                                     f"({config.rollout.max_tokens})")
    if config.rollout.temperature == 0 and config.rollout.top_p < 1:
        report("rollout.top_p", "has no effect with temperature 0 (greedy); leave it at 1.0 or sample")
    from omni_engine.models.check import model_problem
    from omni_engine.models.prepare import RECIPES

    if (problem := model_problem(config.model, frozenset(RECIPES))) is not None:
        report("model", problem)
    for field, path in (("data.train", config.data.train), ("data.heldout", config.data.heldout)):
        if path is not None and not config.resolve(path).is_file():
            report(field, f"no such file: {config.resolve(path)}")


def parse_actor_learner_config(data: Any, source: str = "<dict>", base_dir: str | Path = ".") -> ActorLearnerConfig:
    """Validate a loaded mapping; one ConfigError lists every problem, each naming its field."""
    errors = cv.ErrorCollector(source)
    report = errors.pipeline()
    config = cv.convert_struct(data, ActorLearnerConfig, "", report)
    if config is not None:
        config.base_dir = str(base_dir)
        _check(config, report)
    if errors.errors or config is None:
        raise ConfigError(errors.errors, source, "actor-learner config")
    return config


def load_actor_learner_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ActorLearnerConfig:
    """Read and validate the YAML; relative paths in it are relative to its directory. ``overrides``
    (dotted field -> value, e.g. ``{"train.steps": 4}``) are applied before validation."""
    path = Path(path)
    data = read_yaml(path, "actor-learner config")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_actor_learner_config(data, str(path), path.parent)
