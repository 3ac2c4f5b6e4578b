"""The tensors a model accepts in a weight push: names, shapes, dtypes from its own checkpoint.

vLLM's ``load_weights`` takes checkpoint names (``model.layers.0.self_attn.q_proj.weight``)
and fuses them into its own parameters (``qkv_proj``) as it loads, so checking a push
against the model's parameters would need every model's fusing rules. The checkpoint's
safetensors headers already say what the model was loaded from: a pushed tensor must be
one of those, with the same shape, so a push is checked in full before anything loads.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from omni_engine.weights.layout import TensorSpec, dtype_name

# safetensors dtype names -> torch dtypes
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Tensors checkpoints carry that models recompute and vLLM's loaders skip.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def read_safetensors_header(path: Path) -> dict[str, dict]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def expected_tensors(model_dir: str | Path, serving_dtype: torch.dtype,
                     tie_word_embeddings: bool = False) -> dict[str, TensorSpec]:
    """Every tensor of the model's checkpoint: name -> shape and the dtypes accepted for it.

    A floating tensor may come in the dtype the stage serves in or the checkpoint's own;
    integer tensors only as stored. With tied embeddings a trainer's ``state_dict`` holds
    ``lm_head.weight`` too (the same tensor as the input embeddings): it is accepted and,
    as when vLLM loads a checkpoint, not loaded separately.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"weights: the model at {model_dir} has no *.safetensors checkpoint to check pushed "
                         "names, shapes and dtypes against; weight updates need a safetensors checkpoint")
    specs: dict[str, TensorSpec] = {}
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            stored = _SAFETENSORS_DTYPES.get(entry["dtype"])
            if stored is None:
                continue  # a quantization scale format we cannot check: not pushable
            dtypes = (serving_dtype, stored) if stored.is_floating_point and stored != serving_dtype else (stored,)
            specs[name] = TensorSpec(name, tuple(entry["shape"]), dtypes)
    if tie_word_embeddings and "lm_head.weight" not in specs:
        embed = next((s for n, s in specs.items() if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            specs["lm_head.weight"] = TensorSpec("lm_head.weight", embed.shape, embed.dtypes)
    return specs


def check_tensor(spec: TensorSpec | None, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                 where: str, known: int) -> None:
    """ValueError naming the tensor and what is wrong with it (unknown name, shape, dtype)."""
    if spec is None:
        raise ValueError(f"{where}: unknown weight {name!r}: the model's checkpoint has no tensor of that name "
                         f"({known} names are pushable; they are the checkpoint's names, e.g. "
                         "'model.layers.0.self_attn.q_proj.weight')")
    if tuple(shape) != spec.shape:
        raise ValueError(f"{where}: weight {name!r} has shape {list(shape)}, the model's is {list(spec.shape)}")
    if dtype not in spec.dtypes:
        accepted = " or ".join(dtype_name(d) for d in spec.dtypes)
        raise ValueError(f"{where}: weight {name!r} has dtype {dtype_name(dtype)}, the model "
                         f"takes {accepted}; cast it before sending")
