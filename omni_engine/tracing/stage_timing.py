"""What a stage process records about a traced request: ``StageTiming``.

A stage needs no exporter to be traced. For a request the client marks as
traced (``StageGenerateRequest.trace``), the stage stamps when it received it,
when its engine started on it, its first and last output, how many outputs it
sent and how many bytes left through shared memory, and sends that with the
request's final output (``StageOutputs.timings``). The client turns it into the
stage's span. Times are wall-clock seconds (``time.time()``), so that spans of
processes on one host line up without a clock exchange.
"""

from __future__ import annotations

import msgspec


class StageTiming(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request in one stage process (0.0: did not happen, or the engine does not say)."""

    received: float
    # When the engine's work on it began (a batch that took it, vLLM's scheduler): queue wait ends.
    started: float = 0.0
    first_output: float = 0.0
    finished: float = 0.0
    outputs: int = 0
    shm_bytes: int = 0
    pid: int = 0

    @property
    def queue_wait_s(self) -> float | None:
        return max(0.0, self.started - self.received) if self.started else None
