"""What a stage's vLLM worker adds for request-keyed logits processors (reached by name
through ``collective_rpc``; mixed into the worker with the weight-update methods)."""

from __future__ import annotations

from typing import Any


class LogitsWorkerExtension:
    """Mixed into vLLM's worker (``self`` is the worker)."""

    def omni_release_logits_requests(self) -> int:
        """Release every request the worker's request-keyed processors still hold (at shutdown:
        vLLM tells a processor of a request's end only at its next batch update, which a
        stopping engine never runs). The number released."""
        from omni_engine.logits.request_keyed import RequestKeyedLogitsProcessor

        runner: Any = getattr(self, "model_runner", None)
        batch = getattr(runner, "input_batch", None)
        processors = list(getattr(getattr(batch, "logitsprocs", None), "all", ()) or ())
        processors += list(getattr(getattr(runner, "sampler", None), "logits_processors", ()) or ())
        released = 0
        for processor in processors:
            if isinstance(processor, RequestKeyedLogitsProcessor):
                released += len(processor.table)
                processor.table.clear()
        return released
