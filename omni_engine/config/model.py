"""Pipeline stage configs (YAML), with vLLM-Omni's field names.

A pipeline is a graph of stages (an LLM, then a speech model, ...), each its own
process. The config is read and validated *completely* before any process
starts: a typo in stage 3 must not surface after stages 0-2 spent a minute
loading models. Every problem becomes one line naming the file, the stage and
the dotted field path, and all of them are raised together in one
:class:`ConfigError`.

Example::

    runtime: {execution_mode: async_chunk}
    stage_args:
      - stage_id: 0
        stage_type: llm
        engine_args: {model: smollm2, max_model_len: 2048}
      - stage_id: 1
        stage_type: generation
        engine_input_source: [0]
        engine_args: {model_factory: "omni_engine.engines.tts:make_espeak_tts"}
        final_output: true
        final_output_type: audio
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import msgspec

if TYPE_CHECKING:
    from omni_engine.stage_engine.security import CurveKeys

EXECUTION_MODES = ("sequential", "async_chunk")
# The engines a stage can run (``omni_engine.engines.build_stage_engine``). Named here, not
# there, so that reading a config never imports the engines (and with them vLLM: ~15 s cold).
STAGE_TYPES = ("llm", "generation")
TRANSPORTS = ("ipc", "tcp")
RESTART_POLICIES = ("no", "on-failure")
LOAD_BALANCE_POLICIES = ("least-loaded", "round-robin")
AFFINITIES = ("none", "request")
RETRY_POLICIES = ("before_first_output", "never")
# Where an in-process stage's event loop runs: a thread of its own, or the client's.
EVENT_LOOPS = ("own", "client")
# Where a stage process reads and writes its sockets (StageRuntimeConfig.io).
STAGE_IO = ("loop", "threads")
FINAL_OUTPUT_TYPES = ("text", "audio", "image", "latent", "tensor")
PLACEMENT_BACKENDS = ("local", "ray")
# Ray's placement-group strategies: how one stage's replicas are laid out over nodes.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ConfigError(ValueError):
    """An invalid pipeline config; ``errors`` holds one line per problem found."""

    def __init__(self, errors: list[str], source: str = "<dict>", what: str = "pipeline config") -> None:
        self.errors = list(errors)
        self.source = source
        if len(self.errors) == 1:
            message = self.errors[0]
        else:
            message = f"{len(self.errors)} errors in {what} {source}:\n" + "\n".join(
                f"  - {e}" for e in self.errors
            )
        super().__init__(message)


class _Base(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ConnectorsConfig(_Base):
    """How tensors travel between stages; ``None`` keeps the environment's default."""

    shm_threshold: Annotated[int, msgspec.Meta(ge=0)] | None = None
    use_shm: bool | None = None


class EdgeConfig(_Base):
    """A per-edge override; YAML ``from``/``to`` name an existing edge of the graph."""

    from_stage: int = msgspec.field(name="from")
    to: int
    execution_mode: str | None = None
    custom_process_input_func: str | None = None


class SecurityConfig(_Base):
    """ZMQ CURVE on every stage's sockets (README "Security").

    Key files are ``zmq.auth.create_certificates`` secret files
    (``*.key_secret``), relative to the config file. With ``curve`` on and a
    file not given, that keypair is generated in memory for the run.
    """

    curve: bool = False
    # The pipeline client's keypair: it binds ROUTER/PULL, the CURVE server.
    server_key: str | None = None
    # The stages' keypair: they connect DEALER/PUSH as CURVE clients, and
    # only this public key is admitted.
    client_key: str | None = None

    def curve_keys(self) -> CurveKeys | None:
        """The keys for one run (None with CURVE off); ConfigError naming a bad file and its field."""
        from omni_engine.stage_engine.security import CurveKeys, KeyFileError, KeyPair

        if not self.curve:
            return None
        pairs = {}
        for name in ("server_key", "client_key"):
            path = getattr(self, name)
            try:
                pairs[name] = KeyPair.load(path) if path else KeyPair.generate()
            except KeyFileError as exc:
                raise ConfigError([f"runtime.security.{name}: {exc}"]) from None
        return CurveKeys(pairs["server_key"], pairs["client_key"], fixed_client=self.client_key is not None)


class PlacementConfig(_Base):
    """Where stage processes run (README "Placement through Ray").

    ``local``: on the client's host. ``ray``: each replica of a process stage
    in a bundle of a Ray placement group (its stage's ``runtime.resources``),
    started there by a small launcher actor; Ray is imported only then.
    """

    backend: str = "local"
    # ray only: "auto" (RAY_ADDRESS, else the cluster `ray start` left on this
    # machine, else a new local one: ray.init()'s own order) or a cluster address.
    address: str | None = None


class PipelineRuntimeConfig(_Base):
    execution_mode: str = "sequential"
    # Requests in the pipeline at once; more are refused (HTTP 503), not queued without bound.
    max_inflight_requests: Annotated[int, msgspec.Meta(ge=1)] = 1024
    # Outputs of one request its caller has not read yet; past it the request
    # is aborted with an error, so a caller that stops reading cannot grow memory.
    max_undelivered_outputs: Annotated[int, msgspec.Meta(ge=1)] = 4096
    connectors: ConnectorsConfig = msgspec.field(default_factory=ConnectorsConfig)
    edges: list[EdgeConfig] = msgspec.field(default_factory=list)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    # Where the pipeline's OpenTelemetry spans go (vLLM's --otlp-traces-endpoint; README
    # "Observability"); None: no tracing, and none of its cost.
    otlp_traces_endpoint: str | None = None


class WeightsConfig(_Base):
    """Weight updates into the running pipeline (README "Weight updates (RL)").

    ``stages``: the llm stages vLLM's weight protocol reaches (None: every llm stage;
    [] turns weight updates off). ``backend``: how tensors reach them -- ``shm`` (same
    host), ``zmq`` (any host), or vLLM's own ``nccl`` / ``ipc`` on GPUs.
    """

    stages: list[int] | None = None
    backend: str = "shm"
    # Where the last pushed weights are kept for a replica that restarts (default: a
    # directory of the run's in the system temp dir, removed at shutdown).
    store_dir: str | None = None
    # A weight update with no call for this long is abandoned: its staged push is
    # dropped, and a pipeline paused for it resumes (a trainer that died must not
    # leave the pipeline paused).
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


WEIGHT_BACKENDS = ("shm", "zmq", "nccl", "ipc")
# The backends omni_engine's stages stage and check before loading (the rest load as they arrive).
STAGED_WEIGHT_BACKENDS = ("shm", "zmq")


class StageRuntimeConfig(_Base):
    # false: the stage runs in the client's process, over inproc:// (generation
    # stages, one replica, no restart, env or devices of its own).
    process: bool = True
    # process: false only. "own" (the default): the stage runs on an event loop of its own in
    # its thread; "client": on the client's event loop, no thread (fastest; its model must
    # not block the loop: async, or its work in threads of its own).
    event_loop: str | None = None
    # Stage processes only. "loop" (the default): the stage reads and writes its sockets on
    # its event loop; "threads": an input and an output thread do, for a model that computes
    # on its loop (its messages are then decoded and sent while it computes).
    io: str | None = None
    # Accelerator ids for the stage ("0,1", 0 or [0, 1]), given to its process
    # through the platform's device-control variable (README "Devices").
    devices: str | int | list[int | str] | None = None
    # CPU cores for the stage's process ("0", "2-3", "0,2" or [0, 2]): it runs on them alone
    # (sched_setaffinity, before anything starts its threads) and its intra-op threads follow
    # (OMP_NUM_THREADS, a Piper voice's threads). Shared out over num_replicas like devices.
    cpus: str | int | list[int] | None = None
    # Stage processes only: the process's niceness (set on its threads, os.setpriority; 0, the
    # default, leaves it), which its children (vLLM's EngineCore) inherit. On a few CPU cores, a stage whose work waits on a
    # listener's clock (code2wav) gets the cores first when the LLM stages beside it run niced.
    # Negative values need the privilege to raise priority (CAP_SYS_NICE).
    nice: Annotated[int, msgspec.Meta(ge=-20, le=19)] = 0
    # Requests the stage runs together: a generation stage's batch (default 1);
    # an llm stage's max_num_seqs (default: vLLM's).
    max_batch_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    transport: str = "ipc"
    # "on-failure": a stage process that dies is started again (requests in
    # flight through it still fail), at most max_restarts (default 3) times per replica.
    restart: str = "no"
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] | None = None
    # restart: on-failure only. true: a process that has imported what the stage runs waits beside
    # it (one per stage, started once the pipeline is up) and becomes the restarted replica: a
    # killed llm replica is back without paying vLLM's import again. Costs that process's memory.
    warm_spare: bool = False
    # tcp only: the address the client binds for this stage (default 127.0.0.1:
    # never reachable from other machines unless asked for).
    host: str | None = None
    # Processes running this stage; the orchestrator still sees one stage. A
    # request goes to the replica with the fewest requests in flight
    # ("least-loaded", ties rotated) or to the next in turn ("round-robin").
    # The three below apply with num_replicas > 1 only (None: the default named).
    num_replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    load_balance: str | None = None  # default "least-loaded"
    # "request": the sub-requests of one request stay on one replica (a stage
    # holding per-request state); "none" (the default): they spread like requests.
    affinity: str | None = None
    # When a replica dies, its requests that produced no output yet go to a live
    # replica ("before_first_output", the default) or fail with it ("never").
    retry: str | None = None
    # placement backend ray only: what each replica reserves in Ray ({CPU: 1, GPU: 1},
    # custom resources; default {CPU: 1}), and how the stage's replicas are laid out
    # over nodes ("PACK", the default: as few as possible; "SPREAD": as many).
    resources: dict[str, float] | None = None
    strategy: str | None = None

    def device_ids(self) -> tuple[str, ...] | None:
        """``devices`` as a tuple of ids (None: not set); validation has checked their shape."""
        if self.devices is None:
            return None
        return tuple(str(part).strip() for part in device_parts(self.devices))

    def replica_cpus(self, replica: int) -> tuple[int, ...] | None:
        """The CPU cores of one replica: ``cpus`` shared out in equal consecutive parts."""
        if self.cpus is None:
            return None
        cores = cpu_list(self.cpus)
        per = len(cores) // self.num_replicas
        return cores[replica * per:(replica + 1) * per]

    def replica_device_ids(self, replica: int) -> tuple[str, ...] | None:
        """The devices of one replica: ``devices`` shared out in equal consecutive parts."""
        ids = self.device_ids()
        if ids is None:
            return None
        per = len(ids) // self.num_replicas
        return ids[replica * per:(replica + 1) * per]


class MixingConfig(_Base):
    """Two-model mixing on an llm stage (the teacher): at every decoding step its logits row
    becomes log q ∝ (1-α)·log π_θ + α·log π_t, with π_θ from the llm stage ``theta_stage``
    scoring the request's own theta prompt plus the tokens generated so far."""

    theta_stage: int
    alpha: str = "fixed"  # or "kl_symmetry": per row, the α where KL(q‖π_θ) = KL(q‖π_t)
    alpha_value: float | None = None  # α for "fixed"
    # JSONL file: one line per request when it leaves the batch (its α per step).
    alpha_history: str | None = None
    # Theta's prompt goes through theta's chat template as one user message.
    theta_chat_template: bool = True
    # Seconds the teacher waits for theta's rows of one step before it decodes those rows alone.
    theta_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    # Debugging and tests: a directory where every step's π_θ, π_t, α and log q rows are saved.
    record_rows: str | None = None
    # Ask theta before the teacher's forward pass, so the two run at once: "auto" does on
    # accelerators, not on CPUs (the two engines would share the cores: measured 2x slower).
    overlap: bool | Literal["auto"] = "auto"


class StageConfig(_Base):
    """One stage: what engine it runs, on what, and which stages feed it."""

    stage_id: Annotated[int, msgspec.Meta(ge=0)]
    stage_type: str = "llm"  # vLLM-Omni's default
    runtime: StageRuntimeConfig = msgspec.field(default_factory=StageRuntimeConfig)
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)
    # [] (or missing) marks an entry stage: it gets the user prompt.
    engine_input_source: list[int] = msgspec.field(default_factory=list)
    custom_process_input_func: str | None = None
    # Keyword arguments for that function's factory (Qwen3-Omni's codec chunk sizes; what vLLM-Omni's
    # deploy files set in a connector's ``extra``).
    custom_process_input_args: dict[str, Any] = msgspec.field(default_factory=dict)
    final_output: bool = False
    final_output_type: str | None = None
    default_sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    mixing: MixingConfig | None = None

    def engine_args_for_engine(self) -> dict[str, Any]:
        """``engine_args`` as the engine takes them: an llm stage's ``runtime.max_batch_size``
        is vLLM's ``max_num_seqs`` (validation refuses the two when they differ); a mixing
        teacher's processor is among its logits processors (so the server's frontend
        validates each request's theta prompt)."""
        args = dict(self.engine_args)
        if self.stage_type == "llm" and self.runtime.max_batch_size is not None:
            args.setdefault("max_num_seqs", self.runtime.max_batch_size)
        if self.mixing is not None:
            from omni_engine.logits.mixing_wiring import MIXING_PROCESSOR

            args["logits_processors"] = [*(args.get("logits_processors") or ()), MIXING_PROCESSOR]
        return args

    def replace(self, **changes: Any) -> StageConfig:
        return msgspec.structs.replace(self, **changes)


class PipelineConfig(_Base):
    """A validated pipeline. Its graph is the runtime's ``StageGraph``; this only describes it."""

    _not_from_yaml: ClassVar[frozenset[str]] = frozenset({"source_path"})

    stage_args: list[StageConfig]
    runtime: PipelineRuntimeConfig = msgspec.field(default_factory=PipelineRuntimeConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    source_path: str | None = None  # set by load_pipeline_config, never read from YAML

    def stage(self, stage_id: int) -> StageConfig:
        for stage in self.stage_args:
            if stage.stage_id == stage_id:
                return stage
        raise KeyError(f"no stage {stage_id}; stage ids: {self.stage_ids()}")

    def stage_ids(self) -> list[int]:
        return [s.stage_id for s in self.stage_args]

    def weight_stage_ids(self) -> list[int]:
        """The stages weight updates reach: ``weights.stages``, or every llm stage."""
        if self.weights.stages is not None:
            return list(self.weights.stages)
        return [s.stage_id for s in self.stage_args if s.stage_type == "llm"]

    def replace(self, **changes: Any) -> PipelineConfig:
        """A copy with ``changes`` (``source_path`` kept)."""
        return msgspec.structs.replace(self, **changes)

    def with_traces_endpoint(self, endpoint: str | None) -> PipelineConfig:
        """The pipeline traced to ``endpoint`` (None: as it is): its spans, and vLLM's own request
        spans from every llm stage that names no endpoint of its own (they join the same trace)."""
        if not endpoint:
            return self
        stages = [msgspec.structs.replace(s, engine_args={**s.engine_args, "otlp_traces_endpoint": endpoint})
                  if s.stage_type == "llm" and not s.engine_args.get("otlp_traces_endpoint") else s
                  for s in self.stage_args]
        return self.replace(stage_args=stages,
                            runtime=msgspec.structs.replace(self.runtime, otlp_traces_endpoint=endpoint))


def cpu_list(cpus: str | int | list[int]) -> tuple[int, ...]:
    """``runtime.cpus`` as written ("0", "2-3", "0,2-3", 1 or [0, 2]) as core numbers; ValueError
    naming the part that is not a core or a range of cores."""
    if isinstance(cpus, bool):
        raise ValueError(f"{cpus!r} is not a CPU core")
    if isinstance(cpus, int):
        parts: list[int | str] = [cpus]
    elif isinstance(cpus, list):
        parts = list(cpus)
    else:
        parts = [p.strip() for p in cpus.split(",")]
    cores: list[int] = []
    for part in parts:
        if isinstance(part, int) and not isinstance(part, bool) and part >= 0:
            cores.append(part)
            continue
        first, dash, last = str(part).partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise ValueError(f"{part!r} is not a CPU core or a range of cores (e.g. 0, \"2-3\")")
        cores.extend(range(int(first), int(last) + 1) if dash else [int(first)])
    if not cores:
        raise ValueError("no CPU core listed")
    if len(set(cores)) != len(cores):
        raise ValueError(f"core {next(c for c in cores if cores.count(c) > 1)} is listed twice")
    return tuple(cores)


def device_parts(devices: str | int | list[int | str]) -> list[int | str]:
    """``runtime.devices`` as written ("0,1", 0 or [0, 1]) as a list of its entries."""
    return devices.split(",") if isinstance(devices, str) else devices if isinstance(devices, list) else [devices]
