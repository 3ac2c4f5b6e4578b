"""``StageGraph``: which stage feeds which, how (edge mode, input processor), and which stages a request needs.

The one graph model of a pipeline: built from the stages' ``engine_input_source``
(list order for hand-built stages) and the pipeline's ``runtime.edges``
overrides. The config only validates it; routing reads it from here.
"""

from __future__ import annotations

import functools

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_engine.config import EdgeConfig, PipelineConfig
from omni_engine.outputs import OmniRequestOutput
from omni_engine.pipeline.input_processors import FollowsPlayback, InputProcessor, StageInput, TextPassthrough
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.utils import resolve_dotted

if TYPE_CHECKING:
    from omni_engine.pipeline.playback_clock import PlaybackClock

EXECUTION_MODES = ("sequential", "async_chunk")


@dataclass(frozen=True)
class RequestPlan:
    """What a request of one shape (entry stage, final stages) uses of the graph: computed once
    per shape, so a request's submit does not walk the graph."""

    finals: frozenset[int]
    used: tuple[int, ...]  # in stage order
    sources: dict[int, tuple[int, ...]]  # per used stage: its sources that take part
    consumers: dict[int, int]  # per used stage: how many of its consumers take part


@dataclass
class EdgeInputs:
    """One request's input processors into one stage: one per group of its
    sources that share a processor factory (one group unless edges override it)."""

    groups: list[tuple[InputProcessor, list[int]]]

    def for_source(self, src: int) -> InputProcessor:
        for processor, sources in self.groups:
            if src in sources:
                return processor
        raise KeyError(f"stage {src} does not feed this stage in this request")

    def follow_playback(self, clock: PlaybackClock) -> None:
        """The request's listener clock, to each processor that paces by it (``FollowsPlayback``)."""
        for processor, _ in self.groups:
            if isinstance(processor, FollowsPlayback):
                processor.follow_playback(clock)

    def on_finish(self, outputs: dict[int, list[OmniRequestOutput]], text: dict[int, str]) -> list[StageInput]:
        """Every group's inputs, in the order of the stage's ``engine_input_source``."""
        inputs: list[StageInput] = []
        for processor, sources in self.groups:
            inputs += processor.on_finish({s: outputs[s] for s in sources}, {s: text[s] for s in sources})
        return inputs


class StageGraph:
    """The stage graph of a pipeline.

    Stage order (``order``) is the order stages were given in; routing never
    depends on it, only on sources and consumers. An edge's input processor
    is its ``runtime.edges`` override, else the destination stage's
    ``custom_process_input_func``, else ``TextPassthrough``.
    """

    def __init__(self, stages: Sequence[StageContext], execution_mode: str = "sequential",
                 edges: Sequence[EdgeConfig] = ()) -> None:
        if execution_mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {EXECUTION_MODES}, got {execution_mode!r}")
        self.contexts = {ctx.stage_id: ctx for ctx in stages}
        self.order = [ctx.stage_id for ctx in stages]
        self.execution_mode = execution_mode
        self.sources = {ctx.stage_id: self._sources_of(i, ctx) for i, ctx in enumerate(stages)}
        self.consumers = {sid: [d for d in self.order if sid in self.sources[d]] for sid in self.order}
        self.edge_modes: dict[tuple[int, int], str] = {}
        self.edge_processors: dict[tuple[int, int], Any] = {}
        stage_factories = {sid: _factory(ctx.input_processor, f"stage {sid} custom_process_input_func",
                                         ctx.input_processor_args)
                           for sid, ctx in self.contexts.items()}
        for dst, srcs in self.sources.items():
            for src in srcs:
                self.edge_processors[(src, dst)] = stage_factories[dst]
        for edge in edges:
            key = (edge.from_stage, edge.to)
            if key not in self.edge_processors:
                raise ValueError(f"runtime.edges: {key[0]} -> {key[1]} is not an edge of the stage graph")
            if edge.execution_mode is not None:
                self.edge_modes[key] = edge.execution_mode
            if edge.custom_process_input_func is not None:
                self.edge_processors[key] = _factory(
                    edge.custom_process_input_func, f"edge {key[0]} -> {key[1]} custom_process_input_func")

    @classmethod
    def from_config(cls, config: PipelineConfig) -> StageGraph:
        """The graph of ``config`` before any stage runs (its contexts have no client)."""
        contexts = [StageContext(s.stage_id, s, None, s.final_output, s.final_output_type or "text")  # type: ignore[arg-type]
                    for s in config.stage_args]
        return cls(contexts, config.runtime.execution_mode, config.runtime.edges)

    def _sources_of(self, index: int, ctx: StageContext) -> list[int]:
        if ctx.stage_config is not None:
            return list(ctx.stage_config.engine_input_source)
        return [self.order[index - 1]] if index > 0 else []

    # ---------------------------------------------------------------- edges
    def edge_mode(self, src: int, dst: int, request_mode: str | None = None) -> str:
        """The edge's own mode, else the request's, else the pipeline's."""
        return self.edge_modes.get((src, dst), request_mode or self.execution_mode)

    def edge_inputs(self, dst: int, sources: Sequence[int], prompt: Any) -> EdgeInputs:
        """Fresh input processors for one request into ``dst`` from ``sources``."""
        groups: list[tuple[Any, list[int]]] = []
        for src in sources:
            factory = self.edge_processors[(src, dst)]
            group = next((g for g in groups if g[0] is factory), None)
            if group is None:
                groups.append((factory, [src]))
            else:
                group[1].append(src)
        return EdgeInputs([(factory(srcs, dst, prompt), srcs) for factory, srcs in groups])

    # -------------------------------------------------------------- requests
    def params_by_stage(self, sampling_params_list: Sequence[Any] | None) -> dict[int, Any]:
        """The seed's stage-ordered ``sampling_params_list`` keyed by stage id (None: the stage's default)."""
        given = list(sampling_params_list or [])
        if len(given) > len(self.order):
            raise ValueError(f"sampling_params_list has {len(given)} entries for {len(self.order)} stages "
                             f"(stage order {self.order})")
        return {sid: given[i] for i, sid in enumerate(self.order) if i < len(given) and given[i] is not None}

    def final_stage_ids(self) -> list[int]:
        return [sid for sid in self.order if self.contexts[sid].is_final_output]

    def final_stages(self, final_stage_id: int | Sequence[int] | None) -> set[int]:
        """The stages a request ends at: the given ones, else the pipeline's final stages."""
        if final_stage_id is None:
            finals = self.final_stage_ids() or [self.order[-1]]
        elif isinstance(final_stage_id, int):
            finals = [final_stage_id]
        else:
            finals = list(final_stage_id)
        unknown = [sid for sid in finals if sid not in self.contexts]
        if unknown:
            raise ValueError(f"final_stage_id {unknown} not in the pipeline (stages {self.order})")
        return set(finals)

    def stages_needed(self, finals: set[int], entry: int | None = None) -> list[int]:
        """The final stages and everything upstream of them (up to ``entry``), in stage order."""
        needed, todo = set(), list(finals)
        while todo:
            sid = todo.pop()
            if sid not in needed:
                needed.add(sid)
                if sid != entry:
                    todo.extend(self.sources[sid])
        if entry is not None:
            roots = [sid for sid in needed if not any(s in needed for s in self.sources[sid]) or sid == entry]
            if roots != [entry]:
                raise ValueError(f"final stage(s) {sorted(finals)} are not fed by entry stage {entry} alone")
        return [sid for sid in self.order if sid in needed]

    def plan(self, entry: int | None, final_stage_id: int | Sequence[int] | None) -> RequestPlan:
        """The stages a request starting at ``entry`` (None: the sources) and ending at
        ``final_stage_id`` (None: ``entry``, else the pipeline's finals) uses; ValueError if none."""
        finals = self.final_stages(entry if final_stage_id is None else final_stage_id)
        used = self.stages_needed(finals, entry)
        return RequestPlan(frozenset(finals), tuple(used),
                           {sid: tuple(self.sources_within(sid, used, entry)) for sid in used},
                           {sid: sum(1 for d in self.consumers[sid] if d in used) for sid in used})

    def sources_within(self, sid: int, used: Sequence[int], entry: int | None = None) -> list[int]:
        """The sources of ``sid`` that take part in a request using ``used`` stages."""
        return [] if sid == entry else [s for s in self.sources[sid] if s in used]


def _factory(path: str | None, what: str, args: dict[str, Any] | None = None) -> Any:
    """The input processor factory at ``path`` (``TextPassthrough`` without one), given ``args``
    (``custom_process_input_args``) as keywords; arguments it does not take are refused by name."""
    if path is None:
        if args:
            raise ValueError(f"{what.replace('func', 'args')} {sorted(args)} without a custom_process_input_func")
        return TextPassthrough
    factory = resolve_dotted(path, what)
    if not args:
        return factory
    import inspect

    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(args) - set(accepted))
    if unknown:
        raise ValueError(f"{what.replace('func', 'args')}: {path} takes no {', '.join(unknown)} "
                         f"(it takes {', '.join(p for p in accepted if p not in ('sources', 'dst', 'prompt'))})")
    return functools.partial(factory, **args)
