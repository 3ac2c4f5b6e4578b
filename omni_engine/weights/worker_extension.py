"""What a stage's vLLM worker adds for weight updates (vLLM's ``worker_extension_cls``).

vLLM mixes this class into its worker, so its methods are reachable through
``collective_rpc`` by name, in whatever process the worker runs (vLLM's engine
core is a process of its own). Importing this module also registers the
``shm`` and ``zmq`` backends there, before the worker builds its transfer engine.

The ``omni_`` methods are the parts of a fenced update vLLM's protocol has no word
for: check a staged push on every replica before any loads it, drop a push the
client aborted, and load the last push into a replica that started after it.
"""

from __future__ import annotations

from typing import Any

from omni_engine.logits.worker_extension import LogitsWorkerExtension
from omni_engine.weights.expected import check_tensor
from omni_engine.weights.staging_engine import StagedWeightTransferEngine, register_backends

register_backends()


class WeightUpdateExtension(LogitsWorkerExtension):
    """Mixed into vLLM's worker (``self`` is the worker); vLLM takes one extension class, so
    the logits processors' methods come with it."""

    def _omni_staging_engine(self) -> StagedWeightTransferEngine:
        engine: Any = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, StagedWeightTransferEngine):
            raise RuntimeError(f"this stage's weight transfer backend is "
                               f"{type(engine).__name__ if engine is not None else 'not configured'}, "
                               "not one of omni_engine's staged backends (shm, zmq)")
        return engine

    def omni_check_staged(self) -> int:
        """Raise unless the push under way is complete and valid; the number of tensors staged."""
        return self._omni_staging_engine().check_staged()

    def omni_abort_weight_update(self) -> None:
        """Forget the push under way; the model keeps its weights."""
        engine = getattr(self, "weight_transfer_engine", None)
        if isinstance(engine, StagedWeightTransferEngine):
            engine.discard()
        if engine is not None:
            engine.reset_weight_update_target()
        self._weight_update_active = False

    def omni_load_weights_files(self, paths: list[str]) -> int:
        """Load a whole saved push (the pipeline's ``WeightStore`` chunks) into the model; tensors loaded."""
        from safetensors.torch import load_file

        engine = self._omni_staging_engine()
        expected, weights = engine.expected, {}
        for path in paths:
            for name, tensor in load_file(path).items():
                # Files from another model would load garbage: checked as a push is.
                check_tensor(expected.get(name), name, tensor.dtype, tuple(tensor.shape), f"restore from {path}",
                             len(expected))
                weights[name] = tensor
        missing = engine.required_names() - weights.keys()
        if missing:
            raise ValueError(f"restore: the saved push lacks {len(missing)} of the model's tensors "
                             f"(e.g. {sorted(missing)[:3]})")
        engine.load(weights.items())
        return len(weights)
