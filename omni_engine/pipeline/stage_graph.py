"""``StageGraph``: which stage feeds which, and which stages a request needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from omni_engine.pipeline.input_processors import TextPassthrough
from omni_engine.pipeline.stage_context import StageContext
from omni_engine.utils import resolve_dotted


class StageGraph:
    """The stage graph from ``engine_input_source`` (list order for hand-built stages).

    Stage order (``order``) is the order stages were given in; routing never
    depends on it, only on sources and consumers.
    """

    def __init__(self, stages: Sequence[StageContext]) -> None:
        self.contexts = {ctx.stage_id: ctx for ctx in stages}
        self.order = [ctx.stage_id for ctx in stages]
        self.sources = {ctx.stage_id: self._sources_of(i, ctx) for i, ctx in enumerate(stages)}
        self.consumers = {sid: [d for d in self.order if sid in self.sources[d]] for sid in self.order}
        # One input processor factory per destination stage (its custom_process_input_func).
        self.processor_factories = {sid: _processor_factory(ctx) for sid, ctx in self.contexts.items()}

    def _sources_of(self, index: int, ctx: StageContext) -> list[int]:
        if ctx.stage_config is not None:
            return list(ctx.stage_config.engine_input_source)
        return [self.order[index - 1]] if index > 0 else []

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

    def sources_within(self, sid: int, used: Sequence[int], entry: int | None = None) -> list[int]:
        """The sources of ``sid`` that take part in a request using ``used`` stages."""
        return [] if sid == entry else [s for s in self.sources[sid] if s in used]


def _processor_factory(ctx: StageContext) -> Any:
    path = ctx.input_processor
    if path is None:
        return TextPassthrough
    return resolve_dotted(path, f"stage {ctx.stage_id} custom_process_input_func")
