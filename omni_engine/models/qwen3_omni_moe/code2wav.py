"""Qwen3-Omni's code2wav (a causal ConvNet decoder after a sliding-window transformer) as a generation stage.

transformers' ``Qwen3OmniMoeCode2Wav`` with the checkpoint's ``code2wav.*`` weights, in float32. A
request's prompt is ``{"codes": int64 [G, frames]}``: the talker's frames (all of them, or a piece
of a stream with ``left_context`` frames before its own; ``code2wav_chunks``). Its audio is float32
at 24 kHz, 1,920 samples a frame.

The decoder is causal but for one frame of look-ahead: a pass over ``F`` frames gives the first
``F * 1920 - 555`` samples of the answer exactly (the last 555 need the next frame). A piece's
audio therefore starts 555 samples before its own first frame (those its predecessor could not
give; vLLM-Omni trims so too) and ends where the pass does, so the pieces of a stream join into the
length of one whole pass; they equal it where ``left_context`` frames cover what the transformer's
window and the convolutions see (within a small tolerance otherwise).

The convolutions (upsampling and decoder) are nearly all of the cost (on the tiny checkpoint 35 of
36 ms for 41 frames; the transformer ~1 ms), grow with the frames they are given and gain nothing
from batching on a CPU. So a piece's transformer sees all its left context (its window reaches
72 frames), but the convolutions see only the frames their receptive field needs before the
piece's first kept sample (``decoder_context``, measured from the module at load: 10 frames on
the tiny checkpoint), and each piece is decoded at its own length, in one pass with the batch's
pieces of the same length and context (padded to a batch's longest, a 4-frame first piece would
cost as much as the 41-frame piece beside it). The samples kept are the ones a pass over every
frame gives.

Shapes. oneDNN builds its convolution kernels for each input shape on the first pass of that shape
and caches them: a first pass costs ~2.2x a later one (one 35-frame piece 104 ms, then 46). A
stream's pieces come in many lengths (a last piece, or one sent early for its listener, is any
length), and batch size is part of the shape, so a server's first rounds paid it again and again,
all streams at once. So the convolutions take a piece's frames right-padded to a multiple of
``LENGTH_STEP`` (the padding is after every kept sample: the convolutions are causal but for the
one-frame tail already cut), in passes of 1, 2, 4 or 8 pieces, and ``warm_up`` makes each such
shape once at start, up to the default plan's longest piece. On a CPU a pass of several long
pieces is slower than the pieces one by one (their activations outgrow the caches: 4 pieces of 32
frames 190 ms together, 156 alone): a pass holds at most ``pass_frames`` frames, and a piece too
long to pair goes alone (``batch_key``).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_engine.engines.generation_model import (
    GenerationRequest,
    ThreadedGenerationModel,
)
from omni_engine.models.checkpoint_files import load_submodule
from omni_engine.models.qwen3_omni_moe.code2wav_chunks import CodecChunks
from omni_engine.models.qwen3_omni_moe.talker_requests import DEFAULT_VOICE
from omni_engine.models.receptive_field import frames_read

SAMPLE_RATE = 24000
PREFIX = "code2wav."
LENGTH_STEP = 4  # the convolutions' input is padded to a multiple of this many frames (module docstring)
_ARGS = {"model", "threads", "pass_frames", "warm_up"}


class Code2Wav(ThreadedGenerationModel):
    output_type = "audio"
    renders_alone = False  # one pass for a batch's pieces of one key (``batch_key``)

    def __init__(self, *, model: str, threads: int = 1, pass_frames: int = 48, warm_up: bool = True) -> None:
        super().__init__("code2wav")
        if pass_frames < LENGTH_STEP:
            raise ValueError(f"code2wav: pass_frames {pass_frames} must be >= {LENGTH_STEP}")
        torch.set_num_threads(threads)
        self.model_dir = model
        self.code2wav = load_code2wav(model)
        # The voices are the talker's (its codec speaker ids); said here, the speech stage, where a
        # server lists and checks a request's voice before the talker refuses it.
        talker = json.loads((Path(model) / "config.json").read_text()).get("talker_config") or {}
        self.voices = sorted(talker.get("speaker_id") or {})
        config = self.code2wav.config
        self.groups, self.codebook = int(config.num_quantizers), int(config.codebook_size)
        self.frame = int(math.prod(list(config.upsample_rates) + list(config.upsampling_ratios)))
        self.tail = self.frame - self.pass_length(1)  # samples a pass cannot give without the next frame
        self.decoder_context = decoder_context(self.code2wav, self.frame, self.tail)
        self.pass_frames = pass_frames  # the most frames (pieces x padded length) one convolution pass takes
        self.shapes: set[tuple[int, int]] = set()  # (pieces, padded frames) the convolutions have run
        if warm_up:
            self.warm_up(CodecChunks().size + self.decoder_context)

    @torch.no_grad()
    def pass_length(self, frames: int) -> int:
        return int(self.code2wav(torch.zeros(1, self.groups, frames, dtype=torch.long)).shape[-1])

    def _render_batch(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        results: list[dict[str, Any] | Exception] = [RuntimeError("not rendered")] * len(requests)
        pieces = []
        for i, request in enumerate(requests):
            try:
                pieces.append((i, *self.piece_of(request)))
            except Exception as exc:  # noqa: BLE001 - the protocol fails this request alone
                results[i] = exc
        for i, codes, _ in pieces:
            if not codes.shape[1]:
                results[i] = {"audio": np.zeros(0, np.float32), "sample_rate": SAMPLE_RATE}
        pieces = [piece for piece in pieces if piece[1].shape[1]]
        if pieces:
            try:
                for (i, _, _), audio in zip(pieces, self.render([(codes, context) for _, codes, context in pieces])):
                    results[i] = {"audio": audio, "sample_rate": SAMPLE_RATE}
            except Exception as exc:  # noqa: BLE001 - the batch's pass failed: each of its requests
                for i, _, _ in pieces:
                    results[i] = exc
        return results

    def batch_key(self, request: GenerationRequest) -> tuple[Any, ...]:
        """What pieces must share to go through one pass: their frames and left context (``render``'s
        groups); a piece too long to share a pass (``pass_frames``) is keyed alone. The engine then
        hands the model, with the earliest-deadline piece, only those of its key: a batch of several
        passes answers after its last, so a stream's 4-frame first piece taken with seven 41-frame
        pieces waited ~300 ms for their passes (a 41-frame pass ~37 ms each here)."""
        prompt = request.prompt
        frames, context = int(np.shape(prompt["codes"])[-1]), int(prompt.get("left_context", 0))
        if 2 * self.padded(self.conv_frames(frames, context)) > self.pass_frames:
            return frames, context, request.request_id
        return frames, context

    def piece_of(self, request: GenerationRequest) -> tuple[torch.Tensor, int]:
        """The request's codes ``[G, frames]`` and left context, checked; errors name the request and field."""
        prompt, rid = request.prompt, request.request_id
        if request.aborted:
            raise RuntimeError("aborted")
        if not isinstance(prompt, dict) or "codes" not in prompt:
            raise ValueError(f"request {rid!r}: code2wav takes {{'codes': int64 [{self.groups}, frames]}}, "
                             f"got {type(prompt).__name__}")
        codes = torch.as_tensor(np.asarray(prompt["codes"]), dtype=torch.long)
        if codes.ndim != 2 or codes.shape[0] != self.groups:
            raise ValueError(f"request {rid!r}: codes of shape {tuple(codes.shape)}; Qwen3-Omni's code2wav takes "
                             f"[{self.groups} code groups, frames]")
        if codes.numel() and (int(codes.max()) >= self.codebook or int(codes.min()) < 0):
            raise ValueError(f"request {rid!r}: codes must be in [0, {self.codebook}), "
                             f"got {int(codes.min())}..{int(codes.max())}")
        context = int(prompt.get("left_context", 0))
        if not 0 <= context <= codes.shape[1]:
            raise ValueError(f"request {rid!r}: left_context {context} outside the piece's {codes.shape[1]} frames")
        return codes, context

    @torch.no_grad()
    def render(self, pieces: list[tuple[torch.Tensor, int]]) -> list[np.ndarray]:
        """Pieces of the same frames and context in shared passes (4 first pieces: 14 ms together, 24
        one by one) of 1, 2, 4 or 8 pieces (``pass_sizes``); a short piece never pays for a long one."""
        out: list[np.ndarray | None] = [None] * len(pieces)
        groups: dict[tuple[int, int], list[int]] = {}
        for i, (codes, context) in enumerate(pieces):
            groups.setdefault((codes.shape[1], context), []).append(i)
        for (frames, context), rows in groups.items():
            for size in pass_sizes(len(rows), self.pass_frames // self.padded(self.conv_frames(frames, context))):
                batch, rows = rows[:size], rows[size:]
                for i, audio in zip(batch, self.decode(torch.stack([pieces[i][0] for i in batch]), context)):
                    out[i] = audio
        return out  # type: ignore[return-value]

    def conv_frames(self, frames: int, context: int) -> int:
        """Frames of a piece (``frames`` with ``context`` of them left context) its convolutions see."""
        return frames - max(context - self.decoder_context, 0)

    @staticmethod
    def padded(frames: int) -> int:
        return -(-frames // LENGTH_STEP) * LENGTH_STEP

    @torch.no_grad()
    def warm_up(self, longest: int) -> None:
        """Run each convolution shape ``render`` makes for pieces of up to ``longest`` frames once, so
        no served piece pays oneDNN's first pass (module docstring): ~1 s on the tiny checkpoint."""
        for frames in range(LENGTH_STEP, self.padded(longest) + 1, LENGTH_STEP):
            fit = self.pass_frames // frames
            for size in sorted({1, *(2 ** k for k in range(4) if 2 ** k <= fit)}):
                self.decode(torch.zeros(size, self.groups, frames, dtype=torch.long), 0)

    def decode(self, codes: torch.Tensor, context: int) -> list[np.ndarray]:
        """Pieces' audio (codes ``[B, G, frames]``, each with ``context`` frames of left context):
        transformers' ``Qwen3OmniMoeCode2Wav.forward`` in its two parts, the convolutions started
        ``decoder_context`` frames before the pieces' own (module docstring)."""
        model = self.code2wav
        hidden = model.code_embedding(codes + model.code_offset).mean(1)
        hidden = model.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
        skip = max(context - self.decoder_context, 0)
        hidden = hidden[..., skip:]
        padded = self.padded(hidden.shape[-1])
        self.shapes.add((hidden.shape[0], padded))
        # Right padding changes no kept sample: every one of them is before the last frame's tail.
        wavs = convolutions(model, torch.nn.functional.pad(hidden, (0, padded - hidden.shape[-1])))[:, 0]
        end = (codes.shape[-1] - skip) * self.frame - self.tail
        start = max((context - skip) * self.frame - self.tail, 0)
        return [wav[start:end].float().numpy() for wav in wavs]

    def info(self) -> dict[str, Any]:
        # input_kind: it speaks the talker's codes; a server does not send it text to read
        return {"model": self.model_dir, "sample_rate": SAMPLE_RATE, "input_kind": "codes",
                "voices": self.voices, "default_voice": DEFAULT_VOICE if DEFAULT_VOICE in self.voices else
                (self.voices or [None])[0], "code_groups": self.groups, "samples_per_frame": self.frame}


def pass_sizes(pieces: int, fit: int) -> list[int]:
    """``pieces`` split into passes of 1, 2, 4 or 8 (the shapes ``warm_up`` makes), none over ``fit``."""
    largest = 1 << (min(max(fit, 1), 8).bit_length() - 1)
    sizes = []
    while pieces:
        size = min(largest, 1 << (pieces.bit_length() - 1))
        sizes.append(size)
        pieces -= size
    return sizes


def convolutions(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The upsampling and decoder convolutions of ``model`` on the transformer's output ``[B, H, frames]``."""
    for blocks in model.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in model.decoder:
        hidden = block(hidden)
    return hidden.clamp(min=-1, max=1)


def decoder_context(model: Any, frame: int, tail: int, probe: int = 32) -> int:
    """Frames of the transformer's output the convolutions read before a piece's first kept sample
    (``context * frame - tail``, deep inside a probe of ``probe`` frames): ``receptive_field.frames_read``
    on a narrow float64 twin. The field is the layout's (the rates; kernels and dilations are the
    class's), not the weights' or the widths': the twin has the fewest channels and one transformer
    layer (the published widths cost 13.6 s here, the twin 0.1 s)."""
    config = copy.deepcopy(model.config)
    config.hidden_size = config.intermediate_size = 32
    config.decoder_dim = 2 ** (len(config.upsample_rates) + 1)  # halved at each decoder block
    config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads = 1, 2, 2
    with torch.random.fork_rng(devices=[]):  # the twin's random weights leave the process's RNG alone
        torch.manual_seed(0)
        twin = type(model)(config).double().eval()
    hidden = torch.randn(1, config.hidden_size, probe, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    context = probe - 2
    first, _ = frames_read(lambda h: convolutions(twin, h), hidden, (context * frame - tail,))
    if first == 0:
        raise ValueError(f"Qwen3-Omni's code2wav convolutions read more than {probe} frames back")
    return context - first


def load_code2wav(model_dir: str) -> Any:
    """transformers' code2wav with the checkpoint's ``code2wav.*`` weights (float32, eval)."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeCode2Wav,
    )

    config = Qwen3OmniMoeConfig.from_pretrained(model_dir).code2wav_config
    return load_submodule(Qwen3OmniMoeCode2Wav(config), model_dir, PREFIX, "Qwen3-Omni's code2wav")


def make_code2wav(**engine_args: Any) -> Code2Wav:
    """Stage-config factory (``omni_engine.models.qwen3_omni_moe.code2wav:make_code2wav``)."""
    unknown = sorted(set(engine_args) - _ARGS)
    if unknown:
        raise TypeError(f"make_code2wav got unknown engine_args {unknown}; allowed: {sorted(_ARGS)}")
    return Code2Wav(**engine_args)
