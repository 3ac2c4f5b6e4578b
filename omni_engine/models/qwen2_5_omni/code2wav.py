"""Qwen2.5-Omni's code2wav (token2wav: DiT flow matching, then BigVGAN) as a generation stage.

transformers' ``Qwen2_5OmniToken2WavModel`` with the checkpoint's ``token2wav.*`` weights, in
float32 as transformers runs it, one request at a time in the stage's worker thread (the DiT's
noise is drawn per request, so a batch would not reproduce what each request gives alone, which
transformers keeps too). A request's prompt is ``{"codes": int64 [n], "voice": name}`` (the talker's
codes, from ``talker2code2wav``); its audio is float32 at 24 kHz.

The DiT starts from Gaussian noise: with ``seed`` (the factory's, or a request's
``params["seed"]``) the same codes give the same samples, as ``torch.manual_seed(seed)`` before
transformers' token2wav gives them (the noise is drawn from torch's global generator; the stage's
thread is the only user of it in its process). ``num_steps``, ``guidance_scale`` and
``sway_coefficient`` are the ODE solver's steps (each costs four DiT passes), the classifier-free
guidance weight (0 halves the cost) and the time-grid sway, transformers' defaults 10, 0.5, -1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from omni_engine.engines.generation_model import (
    GenerationRequest,
    ThreadedGenerationModel,
)
from omni_engine.models.qwen2_5_omni.speakers import load_speakers, pick_voice

SAMPLE_RATE = 24000
PREFIX = "token2wav."
_ARGS = {"model", "threads", "seed", "num_steps", "guidance_scale", "sway_coefficient", "default_voice"}


class Code2Wav(ThreadedGenerationModel):
    output_type = "audio"

    def __init__(self, *, model: str, threads: int = 1, seed: int | None = 0, num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, default_voice: str = "Chelsie") -> None:
        super().__init__("code2wav")
        import torch

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
        self.num_codes = self.token2wav.config.dit_config.num_embeds

    def _render(self, request: GenerationRequest) -> dict[str, Any]:
        import torch

        prompt, params = request.prompt, request.params or {}
        if not isinstance(prompt, dict) or "codes" not in prompt:
            raise ValueError(f"request {request.request_id!r}: code2wav takes {{'codes': int64 [n], 'voice': name}}, "
                             f"got {type(prompt).__name__}")
        codes = torch.as_tensor(np.asarray(prompt["codes"]), dtype=torch.long).view(1, -1)
        if codes.numel() == 0:
            return {"audio": np.zeros(0, np.float32), "sample_rate": SAMPLE_RATE}
        if int(codes.max()) >= self.num_codes or int(codes.min()) < 0:
            raise ValueError(f"request {request.request_id!r}: codes must be in [0, {self.num_codes}), "
                             f"got {int(codes.min())}..{int(codes.max())}")
        try:
            speaker = pick_voice(self.speakers, prompt.get("voice") or self.default_voice)
        except ValueError as exc:
            raise ValueError(f"request {request.request_id!r}: {exc}") from None
        seed = params.get("seed", self.seed) if isinstance(params, dict) else self.seed
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            if seed is not None:
                torch.manual_seed(int(seed))
            wav = self.token2wav(codes, conditioning=speaker["cond"].float()[None],
                                 reference_mel=speaker["ref_mel"].float(), **self.settings)
        return {"audio": wav.reshape(-1).float().numpy(), "sample_rate": SAMPLE_RATE}

    def info(self) -> dict[str, Any]:
        # input_kind: it speaks the talker's codes; a server does not send it text to read
        return {"model": self.model_dir, "sample_rate": SAMPLE_RATE, "voices": sorted(self.speakers),
                "default_voice": self.default_voice, "input_kind": "codes", **self.settings}


def load_token2wav(model_dir: str) -> Any:
    """transformers' token2wav with the checkpoint's ``token2wav.*`` weights (float32, eval)."""
    from safetensors import safe_open
    from transformers import Qwen2_5OmniConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniToken2WavModel,
    )

    config = Qwen2_5OmniConfig.from_pretrained(model_dir).token2wav_config
    model = Qwen2_5OmniToken2WavModel(config).float().eval()
    state = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(PREFIX):
                    state[name[len(PREFIX):]] = f.get_tensor(name).float()
    if not state:
        raise ValueError(f"{model_dir}: no {PREFIX}* weights (Qwen2.5-Omni's code2wav)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{model_dir}: token2wav weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def make_code2wav(**engine_args: Any) -> Code2Wav:
    """Stage-config factory (``omni_engine.models.qwen2_5_omni.code2wav:make_code2wav``)."""
    unknown = sorted(set(engine_args) - _ARGS)
    if unknown:
        raise TypeError(f"make_code2wav got unknown engine_args {unknown}; allowed: {sorted(_ARGS)}")
    return Code2Wav(**engine_args)
