"""Text-to-image with a ``diffusers`` pipeline the user brings (``engine_args.model``: its directory).

No text-to-image weights can be fetched on the machines this project is built on (no model hub),
so there is no recipe: the stage loads whatever ``DiffusionPipeline.from_pretrained(dir)`` loads
(Stable Diffusion and kin), offline (``local_files_only``). Tests build a tiny random pipeline.

A request's prompt is text; its params (a dict, or ``OmniDiffusionSamplingParams``) are ``n``,
``seed``, ``num_inference_steps``, ``guidance_scale``, ``height``/``width`` (multiples of the
VAE's scale factor) and ``negative_prompt``. Image ``i`` of a request is drawn from its own
generator, seeded from (``seed``, ``i``): the same seed gives the same images, and a request's
images do not depend on its batch mates. Requests that share steps, guidance and size run as one
pipeline call. The output is the GAN stages' (``{"images": uint8 [n, H, W, 3], "seed", "size"}``),
so ``POST /v1/images/generations`` serves it unchanged.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from omni_engine.engines.generation_model import GenerationRequest, ThreadedGenerationModel
from omni_engine.inputs import OmniDiffusionSamplingParams, prompt_text
from omni_engine.params import is_llm_sampling_params

DEFAULT_MAX_IMAGES = 4
DEFAULT_STEPS = 25
DEFAULT_GUIDANCE = 7.5
MAX_SIDE = 2048
MAX_STEPS = 1000
_SEED_MAX = 2**63 - 1
_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True, slots=True)
class DiffusionParams:
    """One request's params; None fields take the stage's defaults (``resolve``)."""

    n: int = 1
    seed: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    negative_prompt: str | None = None

    @classmethod
    def from_raw(cls, raw: Any, request_id: str) -> DiffusionParams:
        """Unchecked params from a dict, ``OmniDiffusionSamplingParams`` or nothing (vLLM's SamplingParams)."""
        if raw is None or is_llm_sampling_params(raw):
            return cls()
        if isinstance(raw, cls):
            return raw
        if isinstance(raw, OmniDiffusionSamplingParams):
            if raw.extra_args:
                raise ValueError(f"request {request_id}: params.extra_args {sorted(raw.extra_args)} are not supported")
            return cls(n=raw.num_outputs_per_prompt, seed=raw.seed, num_inference_steps=raw.num_inference_steps,
                       guidance_scale=raw.guidance_scale, height=raw.height, width=raw.width,
                       negative_prompt=raw.negative_prompt)
        if isinstance(raw, Mapping):
            known = [f.name for f in fields(cls)]
            unknown = sorted(set(raw) - set(known))
            if unknown:
                raise ValueError(f"request {request_id}: unknown image params {unknown}; known: {', '.join(known)}")
            return cls(**dict(raw))
        raise TypeError(f"request {request_id}: image params must be a dict, DiffusionParams or "
                        f"OmniDiffusionSamplingParams, got {type(raw).__name__}")

    def resolve(self, request_id: str, model: DiffusersImageModel) -> DiffusionParams:
        """Defaults filled in and every field checked; a ValueError names the field and the request."""
        p = replace(self, num_inference_steps=_default(self.num_inference_steps, model.default_steps),
                    guidance_scale=_default(self.guidance_scale, model.default_guidance),
                    height=_default(self.height, model.height), width=_default(self.width, model.width))

        def bad(name: str, want: str, got: Any) -> ValueError:
            return ValueError(f"request {request_id}: params.{name} must be {want}, got {got!r}")

        if not _is_int(p.n) or not 1 <= p.n <= model.max_images:
            raise bad("n", f"an integer in 1..{model.max_images}", p.n)
        if p.seed is not None and (not _is_int(p.seed) or not 0 <= p.seed <= _SEED_MAX):
            raise bad("seed", "an integer in 0..2**63-1", p.seed)
        if not _is_int(p.num_inference_steps) or not 1 <= p.num_inference_steps <= MAX_STEPS:
            raise bad("num_inference_steps", f"an integer in 1..{MAX_STEPS}", p.num_inference_steps)
        if isinstance(p.guidance_scale, bool) or not isinstance(p.guidance_scale, (int, float)) \
                or not 0 <= p.guidance_scale <= 100:
            raise bad("guidance_scale", "a number in 0..100", p.guidance_scale)
        step = model.scale_factor
        for name in ("height", "width"):
            side = getattr(p, name)
            if not _is_int(side) or not step <= side <= MAX_SIDE or side % step:
                raise bad(name, f"a multiple of {step} in {step}..{MAX_SIDE}", side)
        if p.negative_prompt is not None and not isinstance(p.negative_prompt, str):
            raise bad("negative_prompt", "a string", p.negative_prompt)
        return replace(p, guidance_scale=float(p.guidance_scale))


class DiffusersImageModel(ThreadedGenerationModel):
    """A diffusers text-to-image pipeline behind the generation-stage protocol (``output_type = "image"``)."""

    output_type = "image"

    def __init__(self, *, model: str, dtype: str = "float32", device: str = "cpu", threads: int = 1,
                 max_images: int = DEFAULT_MAX_IMAGES, default_steps: int = DEFAULT_STEPS,
                 default_guidance: float = DEFAULT_GUIDANCE, size: str | None = None) -> None:
        import torch
        from diffusers import DiffusionPipeline

        for name, value in (("threads", threads), ("max_images", max_images), ("default_steps", default_steps)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"engine_args.{name} must be an integer >= 1, got {value!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"engine_args.dtype must be one of {list(_DTYPES)}, got {dtype!r}")
        if device not in ("cpu", "cuda") and not str(device).startswith("cuda:"):
            raise ValueError(f"engine_args.device must be 'cpu' or 'cuda[:N]', got {device!r}")
        if device != "cpu" and not torch.cuda.is_available():
            raise ValueError(f"engine_args.device is {device!r} but torch sees no CUDA device")
        path = Path(model).expanduser()
        if not path.is_dir():
            raise ValueError(f"engine_args.model: no directory {str(path)!r}; set it to your own diffusers "
                             f"pipeline directory (none can be downloaded here)")
        if not (path / "model_index.json").is_file():
            raise ValueError(f"engine_args.model: {str(path)!r} is not a diffusers pipeline directory "
                             f"(no model_index.json there)")
        # One intra-op thread by default: on a small CPU box, threads that oversubscribe the cores (another
        # stage, or tests, beside this one) made a tiny pipeline ~40x slower, measured.
        torch.set_num_threads(threads)
        self._torch = torch
        self.pipe = DiffusionPipeline.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                      local_files_only=True).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.name, self.dtype, self.device = path.name, dtype, device
        self.max_images, self.default_steps = max_images, default_steps
        self.default_guidance = float(default_guidance)
        self.scale_factor = int(getattr(self.pipe, "vae_scale_factor", 8))
        self.width, self.height = _parse_size(size) if size is not None else self._native_size()
        for name, side in (("width", self.width), ("height", self.height)):
            if not self.scale_factor <= side <= MAX_SIDE or side % self.scale_factor:
                raise ValueError(f"engine_args.size: the {name}, {side}, must be a multiple of "
                                 f"{self.scale_factor} in {self.scale_factor}..{MAX_SIDE}")
        super().__init__("diffusers")

    def _native_size(self) -> tuple[int, int]:
        """The denoiser's training size in pixels (``sample_size`` latents x the VAE's scale factor)."""
        denoiser = getattr(self.pipe, "unet", None) or getattr(self.pipe, "transformer", None)
        sample = getattr(getattr(denoiser, "config", None), "sample_size", None)
        if sample is None:
            raise ValueError("engine_args.size: the pipeline does not say its native size; set size: WxH")
        h, w = (sample, sample) if isinstance(sample, int) else sample
        return w * self.scale_factor, h * self.scale_factor

    @property
    def size(self) -> str:
        """The default size, as OpenAI writes it (``"WxH"``)."""
        return f"{self.width}x{self.height}"

    renders_alone = False  # one pipeline call per group of alike requests

    def _render_batch(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        results: list[dict[str, Any] | Exception] = [{} for _ in requests]
        groups: dict[tuple[Any, ...], list[tuple[int, str, DiffusionParams, int]]] = {}
        for index, request in enumerate(requests):
            rid = request.request_id
            if request.aborted:
                results[index] = RuntimeError(f"request {rid}: aborted")
                continue
            try:
                params = DiffusionParams.from_raw(request.params, rid).resolve(rid, self)
                text = prompt_text(request.prompt)
            except (ValueError, TypeError) as exc:  # fails this request alone
                results[index] = exc
                continue
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            # One call per group: everything but prompt, negative prompt and latents is shared. None and
            # "" negative prompts differ in some pipelines (SDXL zeroes None), so they do not mix.
            key = (params.num_inference_steps, params.guidance_scale, params.height, params.width,
                   params.negative_prompt is None)
            groups.setdefault(key, []).append((index, text, params, seed))
        for jobs in groups.values():
            try:
                images = self._call(jobs)
            except Exception as exc:  # e.g. out of memory at a large size: fails this group's requests
                for index, *_ in jobs:
                    results[index] = exc
                continue
            start = 0
            for index, _, params, seed in jobs:
                results[index] = {"images": images[start:start + params.n], "seed": seed,
                                  "size": f"{params.width}x{params.height}",
                                  "num_inference_steps": params.num_inference_steps,
                                  "guidance_scale": params.guidance_scale}
                start += params.n
        return results

    def _call(self, jobs: list[tuple[int, str, DiffusionParams, int]]) -> np.ndarray:
        """One pipeline call for requests sharing steps, guidance and size: uint8 [sum(n), H, W, 3]."""
        torch = self._torch
        prompts, negatives, generators = [], [], []
        for _, text, params, seed in jobs:
            # Image i's generator is seeded from (seed, i) alone: n=1 gives the first image of n=4.
            for sub_seed in np.random.SeedSequence(seed).generate_state(params.n, np.uint64):
                generators.append(torch.Generator().manual_seed(int(sub_seed) >> 1))
            prompts += [text] * params.n
            negatives += [params.negative_prompt or ""] * params.n
        p = jobs[0][2]
        with torch.inference_mode():
            out = self.pipe(prompt=prompts, negative_prompt=None if p.negative_prompt is None else negatives,
                            num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                            height=p.height, width=p.width, generator=generators, output_type="np")
        pixels = np.asarray(out.images, dtype=np.float32)  # [N, H, W, 3] in [0, 1]
        return np.ascontiguousarray((pixels * 255).round().clip(0, 255).astype(np.uint8))

    def info(self) -> dict[str, Any]:
        """Backs the images route's checks. ``sizes`` is the default size alone: the route checks
        ``size`` against it but sends only n and seed, so another size would be ignored."""
        return {"engine": "diffusers", "pipeline": type(self.pipe).__name__, "model": self.name,
                "sizes": [self.size], "max_images": self.max_images, "default_steps": self.default_steps,
                "scale_factor": self.scale_factor, "dtype": self.dtype, "device": self.device}


def make_diffusers_image(**engine_args: Any) -> DiffusersImageModel:
    """Stage-config factory (``omni_engine.engines.diffusers_image:make_diffusers_image``)."""
    allowed = {"model", "dtype", "device", "threads", "max_images", "default_steps", "default_guidance", "size"}
    unknown = sorted(set(engine_args) - allowed)
    if unknown:
        raise TypeError(f"make_diffusers_image got unknown engine_args {unknown}; allowed: {sorted(allowed)}")
    if "model" not in engine_args:
        raise TypeError("make_diffusers_image needs engine_args.model (a diffusers pipeline directory)")
    return DiffusersImageModel(**engine_args)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _parse_size(size: Any) -> tuple[int, int]:
    """``"WxH"`` -> (W, H); a ValueError names the engine arg."""
    try:
        w, h = (int(side) for side in str(size).lower().split("x"))
    except ValueError:
        raise ValueError(f"engine_args.size must be 'WxH' (e.g. '512x512'), got {size!r}") from None
    return w, h
