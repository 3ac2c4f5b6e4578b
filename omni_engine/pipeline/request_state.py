"""One request of the orchestrator, as data: ``ClientRequestState`` (what each stage
has done for it, the caller's queue) and one ``StageTrack`` per stage it visits.

What happens to a request lives beside it: ``request_events`` counts its
events into the metrics, ``request_endings`` ends it (abort, failure, finish).
This module imports neither, so the three form no circle.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.sampling_params import RequestOutputKind

from omni_engine.metrics import OrchestratorMetrics, RequestMetrics
from omni_engine.outputs import OmniRequestOutput

if TYPE_CHECKING:
    from omni_engine.pipeline.playback_clock import PlaybackClock
    from omni_engine.pipeline.stage_graph import EdgeInputs
    from omni_engine.tracing.request_trace import RequestTrace


@dataclass
class StageTrack:
    """One stage's part in one request."""

    # Sources that still have to finish before this stage gets (more) input.
    sources_pending: int
    # Consumers that have not yet been given this stage's outputs (on_finish).
    consumers_pending: int = 0
    # Sub-requests in flight: id -> chunk index k.
    inflight: dict[str, int] = field(default_factory=dict)
    # Output kind per in-flight sub-request, to turn outputs into new text.
    kinds: dict[str, RequestOutputKind] = field(default_factory=dict)
    # Text seen so far per (sub-request, completion index), for cumulative outputs.
    seen: dict[tuple[str, int], int] = field(default_factory=dict)
    submitted: int = 0
    # Every sub-request id ever sent to this stage (ended on the stage client at the end).
    sub_ids: list[str] = field(default_factory=list)
    text: str = ""
    # Outputs kept for consumers that start when this stage is done (sequential).
    outputs: list[OmniRequestOutput] = field(default_factory=list)
    submitted_at: dict[int, float] = field(default_factory=dict)
    first_output_at: dict[int, float] = field(default_factory=dict)
    # Delivery order to the caller: chunk next_emit goes out first; later ones wait.
    next_emit: int = 0
    held: dict[int, list[OmniRequestOutput]] = field(default_factory=dict)
    # The last cumulative text output of a final stage (an abort's partial answer).
    last_output: OmniRequestOutput | None = None
    closed: bool = False
    done: bool = False
    # The sub-request whose input is still coming in parts (``StageInput.opens_stream``), the one
    # whose input came so (kept), and its final output while the stage's sources still run.
    open_stream: str | None = None
    streamed: str | None = None
    held_final: tuple[int, OmniRequestOutput] | None = None

    @property
    def complete(self) -> bool:
        """No more input will come and nothing is in flight."""
        return self.sources_pending == 0 and not self.inflight


@dataclass
class ClientRequestState:
    """A request in the pipeline: what each stage has done, and the caller's queue."""

    END: ClassVar[object] = object()

    request_id: str
    prompt: Any
    params: dict[int, Any]
    final_stages: frozenset[int]
    stages: dict[int, StageTrack]
    metrics: RequestMetrics
    pipeline_metrics: OrchestratorMetrics
    execution_mode: str = "sequential"
    # Per destination stage: the input processors of its edges, for this request.
    processors: dict[int, EdgeInputs] = field(default_factory=dict)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Set once the caller left too many outputs unread (the request is being failed).
    overflowed: bool = False
    # Set when the request ends (finished, failed or aborted): a routing step
    # that awaited meanwhile must not submit anything more for it.
    ended: bool = False
    # Set by abort_request: nothing new is submitted; the stages' final (partial)
    # outputs still come in and end the caller's stream.
    aborting: bool = False
    ended_event: asyncio.Event = field(default_factory=asyncio.Event)
    # Stage id -> the weight versions whose outputs this request used so far (every final
    # output carries them: audio made from text of version v says v).
    stage_versions: dict[int, list[str]] = field(default_factory=dict)
    # Its spans, when the pipeline traces (omni_engine.tracing.request_trace.RequestTrace).
    trace: RequestTrace | None = None
    # When its output is needed (``time.time()`` seconds; None: no hurry), stamped on every
    # sub-request; a request that ends in speech has a clock instead, a deadline per piece.
    deadline: float | None = None
    playback: PlaybackClock | None = None
    # Stage id -> the LoRA adapter (vLLM's LoRARequest) its sub-requests run with.
    lora_requests: dict[int, Any] = field(default_factory=dict)

    def deadline_of(self, k: int, prompt: Any) -> float | None:
        """The deadline of sub-request ``k`` (of any stage) whose input is ``prompt``."""
        if self.playback is None:
            return self.deadline
        self.playback.note_input(k, prompt)
        return self.playback.deadline(k)

    def add_versions(self, versions: dict[int, list[str]]) -> None:
        for sid, names in versions.items():
            known = self.stage_versions.setdefault(sid, [])
            known.extend(v for v in names if v not in known)


def new_text_of(track: StageTrack, sub_id: str, output: OmniRequestOutput) -> str:
    """The text this output adds (first completion), whatever its output kind."""
    if not output.outputs:
        return ""
    completion = output.outputs[0]
    text = completion.text or ""
    if track.kinds.get(sub_id) is RequestOutputKind.DELTA:
        return text
    key = (sub_id, completion.index)
    seen = track.seen.get(key, 0)
    track.seen[key] = len(text)
    if output.finished:
        track.seen.pop(key, None)
    return text[seen:]
