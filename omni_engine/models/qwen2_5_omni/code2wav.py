"""Qwen2.5-Omni's code2wav (token2wav: DiT flow matching, then BigVGAN) as a generation stage.

transformers' ``Qwen2_5OmniToken2WavModel`` with the checkpoint's ``token2wav.*`` weights, in
float32 as transformers runs it. A request's prompt is ``{"codes": int64 [n], "voice": name}`` (the
talker's codes, from ``talker2code2wav``), or a streamed piece of a request's speech
(``code2wav_chunks``): a window of its codes from ``offset`` and the codes ``emit: [start, end)``
whose audio it gives. Its audio is float32 at 24 kHz.

The DiT starts from Gaussian noise: with ``seed`` (the factory's, or a request's ``params["seed"]``)
frame ``t`` of a request starts from row ``t`` of ``torch.randn`` drawn from a generator seeded so,
which is what ``torch.manual_seed(seed)`` before transformers' token2wav gives the whole request; a
window's frames start from the same rows, so pieces agree with the whole where their context
allows. Without a seed every window draws its own.

A batch's windows of equal length and speaker-reference length go through the DiT together (one
ODE for all: the DiT's per-evaluation overhead is shared; ``batch_key`` has the engine batch only
those), and spans of equal length through BigVGAN together. ``num_steps``, ``guidance_scale`` and
``sway_coefficient`` are the ODE solver's steps (each costs four DiT passes), the classifier-free
guidance weight (0 halves the cost) and the time-grid sway, transformers' defaults 10, 0.5, -1.
The DiT's velocity and BigVGAN run as ``code2wav_dit`` and ``code2wav_vocoder`` compute them (the
checkpoint's modules, with what transformers recomputes at every call computed once).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_engine.engines.generation_model import (
    GenerationRequest,
    ThreadedGenerationModel,
)
from omni_engine.models.checkpoint_files import load_submodule
from omni_engine.models.qwen2_5_omni.code2wav_dit import sample_mel
from omni_engine.models.qwen2_5_omni.code2wav_vocoder import Vocoder
from omni_engine.models.qwen2_5_omni.speakers import load_speakers, pick_voice
from omni_engine.models.receptive_field import frames_read

SAMPLE_RATE = 24000
PREFIX = "token2wav."
_ARGS = {"model", "threads", "seed", "num_steps", "guidance_scale", "sway_coefficient", "default_voice"}


@dataclass(slots=True)
class Window:
    """One request's codes to render, as ``_render_batch`` groups them."""

    index: int  # in the batch
    request_id: str
    codes: torch.Tensor  # [n] int64
    offset: int  # the first code's position in the request
    emit: tuple[int, int]  # the codes (positions in the request) whose audio is given
    speaker: dict[str, Any]
    seed: int | None


class Code2Wav(ThreadedGenerationModel):
    output_type = "audio"
    renders_alone = False  # windows of equal length share one DiT pass

    def __init__(self, *, model: str, threads: int = 1, seed: int | None = 0, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, default_voice: str = "Chelsie") -> None:
        super().__init__("code2wav")
        torch.set_num_threads(threads)
        self.model_dir = model
        self.seed, self.default_voice = seed, default_voice
        self.settings = {"num_steps": num_steps, "guidance_scale": guidance_scale,
                         "sway_coefficient": sway_coefficient}
        self.speakers = load_speakers(model)
        try:
            pick_voice(self.speakers, default_voice)
        except ValueError as exc:
            raise ValueError(f"engine_args.default_voice: {exc}") from None
        self.token2wav = load_token2wav(model)
        self.dit, bigvgan = self.token2wav.code2wav_dit_model, self.token2wav.code2wav_bigvgan_model
        self.vocoder = Vocoder(bigvgan)
        self.num_codes = self.token2wav.config.dit_config.num_embeds
        self.repeats = self.dit.repeats
        self.codes_per_block = self.dit.block_size // self.repeats
        self.hop = math.prod(bigvgan.config.upsample_rates)  # samples per mel frame
        self.vocoder_context = vocoder_context(bigvgan, self.hop)

    def _render_batch(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        results: list[dict[str, Any] | Exception] = [RuntimeError("not rendered")] * len(requests)
        groups: dict[tuple[int, tuple[int, ...]], list[Window]] = {}
        for i, request in enumerate(requests):
            try:
                window = self.window_of(i, request)
            except Exception as exc:  # noqa: BLE001 - the protocol fails this request alone
                results[i] = exc
                continue
            if window.codes.numel() == 0:
                results[i] = {"audio": np.zeros(0, np.float32), "sample_rate": SAMPLE_RATE}
                continue
            groups.setdefault(pass_key(window.codes.numel(), window.speaker), []).append(window)
        for windows in groups.values():
            try:
                for window, audio in zip(windows, self.render(windows)):
                    results[window.index] = {"audio": audio, "sample_rate": SAMPLE_RATE}
            except Exception as exc:  # noqa: BLE001 - the group fails, not the batch
                for window in windows:
                    results[window.index] = exc
        return results

    def batch_key(self, request: GenerationRequest) -> tuple[int, tuple[int, ...]]:
        """What windows must share to go through one DiT pass: their length and their speaker
        reference's (the groups of ``_render_batch``); the engine batches by it."""
        prompt = request.prompt
        return pass_key(np.asarray(prompt["codes"]).size,
                        pick_voice(self.speakers, prompt.get("voice") or self.default_voice))

    def window_of(self, index: int, request: GenerationRequest) -> Window:
        """The request's window, checked; every error names the request and the field."""
        prompt, params, rid = request.prompt, request.params or {}, request.request_id
        if request.aborted:
            raise RuntimeError("aborted")
        if not isinstance(prompt, dict) or "codes" not in prompt:
            raise ValueError(f"request {rid!r}: code2wav takes {{'codes': int64 [n], 'voice': name}}, "
                             f"got {type(prompt).__name__}")
        codes = torch.as_tensor(np.asarray(prompt["codes"]), dtype=torch.long).reshape(-1)
        if codes.numel() and (int(codes.max()) >= self.num_codes or int(codes.min()) < 0):
            raise ValueError(f"request {rid!r}: codes must be in [0, {self.num_codes}), "
                             f"got {int(codes.min())}..{int(codes.max())}")
        offset = int(prompt.get("offset", 0))
        start, end = (int(v) for v in prompt.get("emit", (offset, offset + codes.numel())))
        if offset % self.codes_per_block or not offset <= start <= end <= offset + codes.numel():
            raise ValueError(f"request {rid!r}: offset {offset} and emit [{start}, {end}) do not fit "
                             f"{codes.numel()} codes (offset must be a multiple of the DiT block, "
                             f"{self.codes_per_block} codes, and emit within the window)")
        try:
            speaker = pick_voice(self.speakers, prompt.get("voice") or self.default_voice)
        except ValueError as exc:
            raise ValueError(f"request {rid!r}: {exc}") from None
        seed = params.get("seed", self.seed) if isinstance(params, dict) else self.seed
        return Window(index, rid, codes, offset, (start, end), speaker, None if seed is None else int(seed))

    def window_noise(self, window: Window) -> torch.Tensor:
        """The starting noise of the window's frames: rows ``[offset, end)`` of the request's (see above)."""
        mel_dim, first = self.dit.mel_dim, window.offset * self.repeats
        last = first + window.codes.numel() * self.repeats
        if window.seed is None:
            return torch.randn(1, last - first, mel_dim)
        generator = torch.Generator().manual_seed(window.seed)
        return torch.randn(1, last, mel_dim, generator=generator)[:, first:]

    @torch.no_grad()
    def render(self, windows: list[Window]) -> list[np.ndarray]:
        """The DiT for the windows together, then each one's audio for its ``emit`` codes."""
        mels = sample_mel(
            self.dit,
            torch.stack([w.speaker["cond"].float() for w in windows]),
            torch.cat([w.speaker["ref_mel"].float() for w in windows]),
            torch.stack([w.codes for w in windows]),
            torch.cat([self.window_noise(w) for w in windows]),
            **self.settings,
        )
        return self.vocode(mels, windows)

    def vocode(self, mels: torch.Tensor, windows: list[Window]) -> list[np.ndarray]:
        """BigVGAN on each window's mel around its ``emit`` frames (``vocoder_context`` frames each
        side, where the window has them), the emitted frames' samples kept. Spans of one length go
        through BigVGAN together: its late layers are a few channels over long time axes, which a
        batch fills better (8 first pieces: 125 ms together, 8 x 33 alone)."""
        spans = [self.vocoder_span(mels.shape[-1], window) for window in windows]
        audio: list[np.ndarray] = [np.zeros(0, np.float32)] * len(windows)
        by_length: dict[int, list[int]] = {}
        for i, (lo, hi, _, _) in enumerate(spans):
            by_length.setdefault(hi - lo, []).append(i)
        for members in by_length.values():
            batch = torch.stack([mels[i, :, spans[i][0]:spans[i][1]] for i in members])
            samples = self.vocoder(batch)
            for row, i in enumerate(members):
                lo, _, first, last = spans[i]
                audio[i] = samples[row, (first - lo) * self.hop:(last - lo) * self.hop].float().numpy()
        return audio

    def vocoder_span(self, frames: int, window: Window) -> tuple[int, int, int, int]:
        """The mel frames ``[lo, hi)`` BigVGAN reads for the window's ``emit`` frames ``[first, last)``."""
        first, last = ((p - window.offset) * self.repeats for p in window.emit)
        return max(first - self.vocoder_context, 0), min(last + self.vocoder_context, frames), first, last

    def info(self) -> dict[str, Any]:
        # input_kind: it speaks the talker's codes; a server does not send it text to read
        return {"model": self.model_dir, "sample_rate": SAMPLE_RATE, "voices": sorted(self.speakers),
                "default_voice": self.default_voice, "input_kind": "codes",
                "codes_per_block": self.codes_per_block, "vocoder_context": self.vocoder_context, **self.settings}


def pass_key(codes: int, speaker: dict[str, Any]) -> tuple[int, tuple[int, ...]]:
    """Windows go through one DiT pass when they share this: their number of codes and their
    speaker reference's shape (``batch_key`` before the batch, ``_render_batch``'s groups in it)."""
    return codes, tuple(speaker["ref_mel"].shape)


def vocoder_context(vocoder: Any, hop: int, probe: int = 96) -> int:
    """Mel frames BigVGAN reads on either side of a frame's samples: its receptive field
    (``receptive_field.frames_read`` of a frame's first and last sample, on a narrow twin). The tiny checkpoint's vocoder reads 18; the
    published layout's (resblock kernels 3, 7 and 11) 34, where Qwen's own streaming overlaps 20, so
    its pieces' borders there differ from the whole's.

    The field is the layout's (kernels, dilations, strides), not the weights': the twin is the same
    class and config with the fewest channels it takes (the published width costs ~20 s here)."""
    config = copy.deepcopy(vocoder.config)
    config.upsample_initial_channel = 2 ** (len(config.upsample_rates) + 1)  # halved at each upsampling
    with torch.random.fork_rng(devices=[]):  # the twin's random weights leave the process's RNG alone
        torch.manual_seed(0)
        model = type(vocoder)(config).double().eval()
    mel = torch.randn(1, config.mel_dim, probe, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mid = probe // 2
    # a frame's first sample reads furthest back, its last furthest on
    first, last = frames_read(model, mel, (mid * hop, (mid + 1) * hop - 1))
    reach = max(mid - first, last - mid)
    if reach >= mid:
        raise ValueError(f"Qwen2.5-Omni's BigVGAN reads more than {mid} mel frames around a frame")
    return reach


def load_token2wav(model_dir: str) -> Any:
    """transformers' token2wav with the checkpoint's ``token2wav.*`` weights (float32, eval)."""
    from transformers import Qwen2_5OmniConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniToken2WavModel,
    )

    config = Qwen2_5OmniConfig.from_pretrained(model_dir).token2wav_config
    return load_submodule(Qwen2_5OmniToken2WavModel(config), model_dir, PREFIX, "Qwen2.5-Omni's code2wav")


def make_code2wav(**engine_args: Any) -> Code2Wav:
    """Stage-config factory (``omni_engine.models.qwen2_5_omni.code2wav:make_code2wav``)."""
    unknown = sorted(set(engine_args) - _ARGS)
    if unknown:
        raise TypeError(f"make_code2wav got unknown engine_args {unknown}; allowed: {sorted(_ARGS)}")
    return Code2Wav(**engine_args)
