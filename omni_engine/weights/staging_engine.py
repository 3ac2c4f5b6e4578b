"""Stage-side weight transfer backends that run everywhere: ``shm`` (same host) and ``zmq`` (any host).

They plug into vLLM's own weight-transfer machinery (``WeightTransferEngineFactory``,
the worker's ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update``), so the stage serves vLLM's protocol
unchanged; vLLM's own backends (nccl, ipc) are CUDA-only.

A push is *staged*, not loaded, as it arrives: every chunk is checked against the
model's checkpoint (name, shape, dtype) and copied out of the sender's buffer.
Nothing touches the model until ``finish_weight_update``, and that refuses a push
that does not cover every tensor. So a bad chunk, a sender that vanishes, or a
replica that refuses leaves the model serving its old weights, and the pipeline
client can check every replica before any of them loads (``omni_check_staged``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from omni_engine.weights.chunk_reader import ChunkReader, numel
from omni_engine.weights.expected import check_tensor, expected_tensors
from omni_engine.weights.layout import (
    ShmInitInfo,
    ShmUpdateInfo,
    TensorSpec,
    ZmqInitInfo,
    check_lists,
    dtype_from_name,
    parse_init_info,
    parse_update_info,
)

logger = logging.getLogger(__name__)

BACKENDS = ("shm", "zmq")


class StagedWeightTransferEngine(WeightTransferEngine):
    """Checks and stages every pushed chunk; loads the whole push at ``finish_weight_update``."""

    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self._expected: dict[str, TensorSpec] | None = None
        self._staged: dict[str, torch.Tensor] | None = None
        # Staging buffers, one per tensor, kept from push to push: copying into memory already
        # touched runs at memcpy speed, a fresh allocation pays a page fault per 4 KiB (measured
        # here: 540 MB in 0.05 s vs 0.9 s).
        self._buffers: dict[str, torch.Tensor] = {}

    # ----------------------------------------------------------- what fits
    @property
    def expected(self) -> dict[str, TensorSpec]:
        if self._expected is None:
            hf_config = self.model_config.hf_config
            tied = bool(getattr(hf_config, "tie_word_embeddings", False))
            self._expected = expected_tensors(self.model_config.model, self.model_config.dtype, tied)
        return self._expected

    def required_names(self) -> set[str]:
        """What a push must cover (a tied ``lm_head.weight`` is optional: it is the embeddings)."""
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        return {n for n in self.expected if not (tied and n == "lm_head.weight")}

    # ------------------------------------------------------------ lifecycle
    def start_weight_update(self) -> None:
        self._staged = {}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes the accelerator here, which raises on a CPU build; staging
        # copies on the host and loads nothing, so there is nothing to wait for.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: Any) -> None:
        if self._staged is None:
            raise RuntimeError("update_weights: no weight update is active; call start_weight_update first")
        where = "update_weights"
        check_lists(update_info, where)
        dtypes = [dtype_from_name(d, f"{where}: tensor {n!r}")
                  for n, d in zip(update_info.names, update_info.dtype_names)]
        expected = self.expected
        for name, dtype, shape in zip(update_info.names, dtypes, update_info.shapes):
            check_tensor(expected.get(name), name, dtype, tuple(shape), where, len(expected))
        staged = {}
        for name, tensor in zip(update_info.names, self.read_chunk(update_info, dtypes)):
            # A copy: the sender reuses its buffer for the next chunk, and may vanish.
            buffer = self._buffers.get(name)
            if buffer is None or buffer.dtype != tensor.dtype or buffer.shape != tensor.shape:
                buffer = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype)
            staged[name] = buffer.copy_(tensor)
        self._staged.update(staged)

    def read_chunk(self, update_info: Any, dtypes: list[torch.dtype]) -> Iterable[torch.Tensor]:
        """The chunk's tensors (views of the sender's buffer are fine: they are copied)."""
        raise NotImplementedError

    def check_staged(self) -> int:
        """ValueError unless the staged push covers every tensor of the model; the number staged."""
        if self._staged is None:
            raise RuntimeError("no weight update is active; call start_weight_update first")
        missing = sorted(self.required_names() - self._staged.keys())
        if missing:
            raise ValueError(f"finish_weight_update: the push is incomplete: {len(missing)} of the model's "
                             f"{len(self.required_names())} tensors were not sent (e.g. {missing[:3]}); a push "
                             "must send every weight, nothing was loaded")
        return len(self._staged)

    def finish_weight_update(self) -> None:
        self.check_staged()
        staged, self._staged = self._staged, None
        assert staged is not None
        self.load(staged.items())

    def discard(self) -> None:
        """Drop a push under way (the client aborts it): the model is untouched."""
        self._staged = None

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load checkpoint-format tensors into the running model.

        Through vLLM's layerwise reload: the CPU build repacks linear weights for oneDNN
        after loading (dropping the plain ones), and quantized models process theirs, so
        a plain ``load_weights`` would not reach what the model computes with.
        """
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                self.model.load_weights(weights)
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        self._refresh_tied_heads()

    def _refresh_tied_heads(self) -> None:
        """Re-process an output head that shares the input embeddings' weight.

        Checkpoints of tied models have no ``lm_head.weight`` and loaders skip it, so the
        reload never processes the head; on CPUs its processing packs the weight for the
        logits GEMM (a copy), which would go on computing logits with the old weights.
        """
        if not getattr(self.model_config.hf_config, "tie_word_embeddings", False):
            return
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
        )

        for module in self.model.modules():
            if isinstance(module, ParallelLMHead) and isinstance(module.quant_method, UnquantizedEmbeddingMethod):
                module.quant_method.process_weights_after_loading(module)

    def shutdown(self) -> None:
        self._staged = None


class OmniWeightTransferEngine(StagedWeightTransferEngine):
    """Both of omni_engine's data planes, told apart by what each chunk's ``update_info`` holds:

    * ``shm``: the sender wrote the chunk into a shared-memory segment (``segment``, ``offsets``);
    * ``zmq``: the stage fetches the chunk from the sender's socket (``push_id``, ``chunk``), whose
      address and CURVE keys came in ``init_info``.

    One class serves both names, so a stage takes a push from a trainer on its host and from
    one elsewhere alike; ``weights.backend`` only says which the pipeline expects.
    """

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._reader = ChunkReader()

    def parse_init_info(self, init_dict: dict[str, Any]) -> Any:
        return parse_init_info(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        return parse_update_info(update_dict)

    def init_transfer_engine(self, init_info: Any) -> None:
        if isinstance(init_info, ZmqInitInfo):
            self._reader.connect(init_info)

    def read_chunk(self, update_info: Any, dtypes: list[torch.dtype]) -> Iterable[torch.Tensor]:
        buffers = self._reader.buffers(update_info, dtypes)
        for dtype, shape, buf in zip(dtypes, update_info.shapes, buffers):
            count = numel(shape)
            yield torch.frombuffer(buf, dtype=dtype, count=count).view(shape) if count else torch.empty(
                shape, dtype=dtype)

    def finish_weight_update(self) -> None:
        super().finish_weight_update()
        self._reader.close_segment()

    def discard(self) -> None:
        super().discard()
        self._reader.close_segment()

    def shutdown(self) -> None:
        super().shutdown()
        self._reader.close()


def register_backends() -> None:
    """Register ``shm`` and ``zmq`` with vLLM's ``WeightTransferEngineFactory`` (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name in BACKENDS:
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, OmniWeightTransferEngine)
