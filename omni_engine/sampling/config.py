"""``sample.yaml``: what ``omni-engine sample`` runs, validated before anything starts.

One file names the sampler (kind and parameters), the rounds (``sampling``),
how answers are scored (``verifier``, ``formatters``), the input JSONL, the
output directory and the shard size. Every problem is reported at once, each
naming its field (``sampler.base_url: ...``), as pipeline configs do; fields
that do nothing for the chosen sampler kind are refused, not ignored.

Example::

    sampler: {kind: openai, base_url: "http://127.0.0.1:8000/v1", model: smollm2,
              concurrency: 64, temperature: 1.0, max_tokens: 1024, seed: 0}
    sampling: {step_size: 4, max_rollouts: 16, max_steps: 4, early_stop: true}
    verifier: boxed
    formatters: [{name: min_correct, args: {k: 1}}]
    input: {path: data/math.jsonl}
    output: {dir: rollouts/math}
    shard: {size: 1000}
    transfer_queue: {rpc_address: "tcp://127.0.0.1:8890"}   # optional: rollouts also to a trainer
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from omni_engine.config import convert as cv
from omni_engine.config import ConfigError, load_pipeline_config, read_yaml

SAMPLER_KINDS = ("openai", "engine", "ray")
# The fields each kind uses beyond the common ones; any other kind's field is refused.
KIND_FIELDS: dict[str, frozenset[str]] = {
    "openai": frozenset({"base_url", "model", "api_key", "api_key_env", "timeout", "max_retries"}),
    "engine": frozenset({"pipeline"}),
    "ray": frozenset({"pipeline", "num_workers", "worker_resources", "ray_address"}),
}
_REQUIRED_BY_KIND = {"openai": ("base_url", "model"), "engine": ("pipeline",), "ray": ("pipeline",)}

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class SamplerConfig(_Base):
    """How answers are produced. Sampling fields left out (``None``) keep the
    server's or the stage's defaults (``default_sampling_params``)."""

    kind: str
    # openai
    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    api_key_env: str | None = None
    timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    max_retries: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # engine / ray: a pipeline stage config (YAML), relative to the sample config's directory
    pipeline: str | None = None
    # ray
    num_workers: PositiveInt | None = None
    worker_resources: dict[str, Annotated[float, msgspec.Meta(ge=0)]] | None = None
    ray_address: str | None = None
    # every kind: requests in flight (ray: per worker)
    concurrency: PositiveInt = 32
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    max_tokens: PositiveInt | None = None
    # Base of the per-item seeds (one per item and round); null: unseeded.
    seed: int | None = 0
    extra_params: dict[str, Any] = msgspec.field(default_factory=dict)

    def sampling_params(self) -> dict[str, Any]:
        """The sampling fields that were set (``extra_params`` last, as the seed passes them)."""
        params = {name: getattr(self, name) for name in ("temperature", "top_p", "max_tokens")
                  if getattr(self, name) is not None}
        return {**params, **self.extra_params}


class RoundsConfig(_Base):
    """The seed's ``sampling`` section: rounds, answers per round, early stop."""

    step_size: PositiveInt = 1
    max_rollouts: PositiveInt = 8
    max_steps: PositiveInt = 1
    early_stop: bool = False


class PluginConfig(_Base):
    """A built-in verifier or formatter by name, or a user's by dotted path, with its arguments."""

    name: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)


class InputConfig(_Base):
    path: str


class OutputConfig(_Base):
    dir: str


class ShardConfig(_Base):
    size: PositiveInt = 1000


class TransferQueueOutput(_Base):
    """A TransferQueue that every finished item's rollouts are also written to (one
    ``BatchWrite`` per item), for a trainer to read as groups. Not part of the run's settings:
    the shards are the same with or without it."""

    url: str | None = None  # HTTP (slime's /buffer/write)
    rpc_address: str | None = None  # ZMQ RPC (BatchWrite); used when given
    timeout: Annotated[float, msgspec.Meta(gt=0)] = 60.0  # seconds per call
    # HTTP: the queue's API key, or the variable holding it (default $OMNI_ENGINE_TRANSFER_QUEUE_API_KEY).
    api_key: str | None = None
    api_key_env: str | None = None
    # RPC with CURVE: the server's public key file (.key) and this client's keypair (.key_secret).
    curve_server_key: str | None = None
    curve_client_key: str | None = None


class SampleConfig(_Base):
    sampler: SamplerConfig
    input: InputConfig
    output: OutputConfig
    sampling: RoundsConfig = msgspec.field(default_factory=RoundsConfig)
    verifier: PluginConfig = msgspec.field(default_factory=lambda: PluginConfig(name="boxed"))
    formatters: list[PluginConfig] = msgspec.field(default_factory=list)
    shard: ShardConfig = msgspec.field(default_factory=ShardConfig)
    transfer_queue: TransferQueueOutput | None = None
    # Where relative paths point from (the file's directory); set by the loader.
    base_dir: str = "."
    _not_from_yaml = frozenset({"base_dir"})

    def resolve(self, path: str) -> Path:
        """``path`` from the config, relative to the config file's directory."""
        return resolve_path(path, self.base_dir)

    def run_settings(self) -> dict[str, Any]:
        """What decides the output's lines: a rerun into the same directory must match these."""
        sampler = {k: v for k, v in msgspec.to_builtins(self.sampler).items()
                   if k not in ("api_key", "api_key_env", "timeout", "max_retries", "concurrency", "num_workers",
                                "worker_resources", "ray_address", "base_url")}
        return {"sampler": sampler, "sampling": msgspec.to_builtins(self.sampling),
                "verifier": msgspec.to_builtins(self.verifier),
                "formatters": msgspec.to_builtins(self.formatters), "shard": msgspec.to_builtins(self.shard)}


def resolve_path(path: str, base_dir: str | Path) -> Path:
    """``path`` from a sample config: ``~`` expanded, relative to the config file's directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else Path(base_dir) / p


def sampler_problems(sampler: SamplerConfig) -> list[tuple[str, str]]:
    """(field, problem) for a sampler config: unknown kind, another kind's fields, missing ones.

    Run when a config is parsed and again by ``BaseSampler.initialize`` (a
    ``SamplerConfig`` may be built in code)."""
    if sampler.kind not in SAMPLER_KINDS:
        return [("sampler.kind", f"unknown sampler kind {sampler.kind!r}; expected one of: {', '.join(SAMPLER_KINDS)}")]
    problems = []
    for kind, fields in KIND_FIELDS.items():
        for name in sorted(fields - KIND_FIELDS[sampler.kind]):
            if getattr(sampler, name) is not None:
                problems.append((f"sampler.{name}", f"applies to sampler kind {kind!r} only, not {sampler.kind!r}"))
    for name in _REQUIRED_BY_KIND[sampler.kind]:
        if getattr(sampler, name) is None:
            problems.append((f"sampler.{name}", f"required for sampler kind {sampler.kind!r}"))
    if sampler.api_key is not None and sampler.api_key_env is not None:
        problems.append(("sampler.api_key", "give api_key or api_key_env, not both"))
    for key in ("n", "seed", "messages", "model"):
        if key in sampler.extra_params:
            problems.append((f"sampler.extra_params.{key}",
                             "set by the sampler (n: sampling.step_size; seed: sampler.seed)"))
    return problems


def _check_rounds(config: SampleConfig, report: cv.Report) -> None:
    rounds = config.sampling
    if rounds.early_stop and not config.formatters:
        report("sampling.early_stop", "early stop needs at least one formatter (formatters) to say when an item "
                                      "is satisfied")
    if config.formatters and not rounds.early_stop:
        report("formatters", "formatters decide early stop only; set sampling.early_stop: true or remove them")
    if config.sampler.temperature == 0 and rounds.step_size > 1:
        report("sampling.step_size", "greedy sampling (sampler.temperature: 0) gives one answer per request; "
                                     "step_size must be 1")
    if rounds.step_size > rounds.max_rollouts:
        report("sampling.step_size", f"{rounds.step_size} answers per round exceed sampling.max_rollouts "
                                     f"({rounds.max_rollouts})")


def _check_plugins(config: SampleConfig, report: cv.Report) -> None:
    from omni_engine.sampling.verifiers import PluginError, load_formatter, load_verifier

    for path, plugin, load in [("verifier", config.verifier, load_verifier),
                               *((f"formatters[{i}]", f, load_formatter) for i, f in enumerate(config.formatters))]:
        try:
            load(plugin.name, plugin.args)
        except PluginError as exc:
            report(f"{path}.{exc.field}", str(exc))


def _check_queue(config: SampleConfig, queue: TransferQueueOutput, report: cv.Report) -> None:
    """The ``transfer_queue`` section: where, and the credentials (key files loaded now)."""
    from omni_engine.stage_engine.security import KeyFileError, KeyPair, load_public_key

    if queue.url is None and queue.rpc_address is None:
        report("transfer_queue", "give url (HTTP) and/or rpc_address (ZMQ RPC) of the queue to write to")
    if queue.api_key is not None and queue.api_key_env is not None:
        report("transfer_queue.api_key", "give api_key or api_key_env, not both")
    if (queue.curve_server_key is None) != (queue.curve_client_key is None):
        report("transfer_queue.curve_client_key" if queue.curve_client_key is None else "transfer_queue.curve_server_key",
               "CURVE needs both curve_server_key (the server's public key file) and curve_client_key (this "
               "client's .key_secret file)")
    for field, load in (("curve_server_key", load_public_key), ("curve_client_key", KeyPair.load)):
        if getattr(queue, field) is not None:
            setattr(queue, field, str(config.resolve(getattr(queue, field))))
            try:
                load(getattr(queue, field))
            except KeyFileError as exc:
                report(f"transfer_queue.{field}", str(exc))


def _pipeline_problems(path: Path) -> list[str]:
    """What is wrong with the pipeline an engine or Ray sampler would start: its config and
    its models, found now rather than after the sampler's workers have started."""
    from omni_engine.models.check import check_models

    if not path.is_file():
        return [f"no such pipeline config: {path}"]
    try:
        check_models(load_pipeline_config(path))
    except ConfigError as exc:
        return exc.errors
    return []


def parse_sample_config(data: Any, source: str = "<dict>", base_dir: str | Path = ".") -> SampleConfig:
    """Validate a loaded ``sample.yaml`` mapping; one ConfigError lists every problem."""
    errors = cv.ErrorCollector(source)
    report = errors.pipeline()
    if isinstance(data, dict) and isinstance(data.get("verifier"), str):
        data = {**data, "verifier": {"name": data["verifier"]}}
    config = cv.convert_struct(data, SampleConfig, "", report)
    if config is not None:
        config.base_dir = str(base_dir)
        for field, problem in sampler_problems(config.sampler):
            report(field, problem)
        _check_rounds(config, report)
        _check_plugins(config, report)
        queue = config.transfer_queue
        if queue is not None:
            _check_queue(config, queue, report)
        if not config.resolve(config.input.path).is_file():
            report("input.path", f"no such file: {config.resolve(config.input.path)}")
        if config.sampler.pipeline is not None:
            for problem in _pipeline_problems(config.resolve(config.sampler.pipeline)):
                report("sampler.pipeline", problem)
    if errors.errors or config is None:
        raise ConfigError(errors.errors, source, "sample config")
    return config


def load_sample_config(path: str | Path) -> SampleConfig:
    """Read and validate a ``sample.yaml``; relative paths in it are relative to its directory."""
    path = Path(path)
    return parse_sample_config(read_yaml(path, "sample config"), str(path), path.parent)
