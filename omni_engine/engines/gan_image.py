"""Image generation stages: the two DCGANs of ``omni_engine.models.dcgan`` as ``GenerationModel``s.

* ``make_face_gan`` (``model``: ``gan-faces`` or its directory): unconditional faces, 64x64;
* ``make_eye_gan`` (``model``: ``gan-eyes``): an eye of one of 8 colours, 128x128. The colour
  comes from the prompt (``{"colour": "green"}``, what the colour-picker stage outputs) or
  from the params' ``colour``;
* ``make_colour_picker``: text (the LLM's answer) -> ``{"colour", "label"}``, the stage
  between SmolLM2 and the eye GAN in ``stage_configs/smollm2_eyes.yaml``.

A request's params are ``n`` (images, 1..``max_images``) and ``seed`` (the same seed gives
the same images; none: a random one, returned in the output). A batch is one forward pass:
every request's latents (drawn from its own seeded generator, so a request's images do not
depend on its batch mates) are stacked, run once, and split. The output is
``{"images": uint8 [n, H, W, 3], "seed", "size": "WxH", ...}``; the array crosses stage
boundaries as a wire tensor.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_engine.engines.generation_model import GenerationRequest, ThreadedGenerationModel
from omni_engine.inputs import prompt_text
from omni_engine.params import is_llm_sampling_params

DEFAULT_MAX_IMAGES = 8
_SEED_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class ImageParams:
    """One request's image params, checked: ``from_raw`` names the bad field and the request."""

    n: int = 1
    seed: int | None = None
    colour: str | None = None

    @classmethod
    def from_raw(cls, raw: Any, request_id: str, max_images: int) -> ImageParams:
        # A vLLM SamplingParams (what a stage without params of its own may get) says nothing about images.
        if raw is None or is_llm_sampling_params(raw):
            return cls()
        if isinstance(raw, ImageParams):
            params = raw
        elif isinstance(raw, Mapping):
            unknown = sorted(set(raw) - {"n", "seed", "colour"})
            if unknown:
                raise ValueError(f"request {request_id}: unknown image params {unknown}; known: n, seed, colour")
            params = cls(**dict(raw))
        else:
            raise TypeError(f"request {request_id}: image params must be a dict or ImageParams, "
                            f"got {type(raw).__name__}")
        n, seed = params.n, params.seed
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= max_images:
            raise ValueError(f"request {request_id}: params.n must be an integer in 1..{max_images}, got {n!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _SEED_MAX):
            raise ValueError(f"request {request_id}: params.seed must be an integer in 0..2**63-1, got {seed!r}")
        return params


class GanImageModel(ThreadedGenerationModel):
    """A DCGAN generator behind the generation-stage protocol (``output_type = "image"``)."""

    output_type = "image"

    def __init__(self, *, kind: str, model: str, threads: int = 1, max_images: int = DEFAULT_MAX_IMAGES) -> None:
        import torch

        from omni_engine.models import dcgan

        loaders: dict[str, Callable[[str], dcgan.LoadedGan]] = {
            "faces": dcgan.load_face_generator, "eyes": dcgan.load_eye_generator}
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"engine_args.threads must be an integer >= 1, got {threads!r}")
        if isinstance(max_images, bool) or not isinstance(max_images, int) or max_images < 1:
            raise ValueError(f"engine_args.max_images must be an integer >= 1, got {max_images!r}")
        # One intra-op thread by default: an LLM stage beside this one wants the cores, and
        # oversubscribed threads slow both. Per process: each stage is a process of its own.
        torch.set_num_threads(threads)
        self._torch = torch
        self.kind = kind
        self.gan = loaders[kind](model)
        self.max_images = max_images
        super().__init__(f"gan-{kind}")

    @property
    def size(self) -> str:
        """The one size this generator makes, as OpenAI writes it (``"WxH"``)."""
        return f"{self.gan.width}x{self.gan.height}"

    def _colour(self, request: GenerationRequest, params: ImageParams) -> str | None:
        """The eye colour: the prompt's (the picker stage's output) over the params'; None for faces."""
        if not self.gan.labels:
            if params.colour is not None:
                raise ValueError(f"request {request.request_id}: params.colour: the {self.kind} GAN is unconditional")
            return None
        colour = request.prompt.get("colour") if isinstance(request.prompt, Mapping) else None
        colour = colour if colour is not None else params.colour
        if colour not in self.gan.labels:
            raise ValueError(f"request {request.request_id}: colour {colour!r} (from the prompt's 'colour', else "
                             f"params.colour) is not one of the eye GAN's labels {list(self.gan.labels)}")
        return str(colour)

    def _latents(self, params: ImageParams, seed: int) -> Any:
        generator = self._torch.Generator().manual_seed(seed)
        return self._torch.randn(params.n, 100, generator=generator)

    renders_alone = False  # one GAN forward for the whole batch

    def _render_batch(self, requests: list[GenerationRequest]) -> list[dict[str, Any] | Exception]:
        results: list[dict[str, Any] | Exception] = []
        jobs: list[tuple[int, ImageParams, int, str | None]] = []
        for request in requests:
            if request.aborted:
                results.append(RuntimeError(f"request {request.request_id}: aborted"))
                continue
            try:
                params = ImageParams.from_raw(request.params, request.request_id, self.max_images)
                colour = self._colour(request, params)
            except (ValueError, TypeError) as exc:  # fails this request alone
                results.append(exc)
                continue
            seed = params.seed if params.seed is not None else secrets.randbits(63)
            jobs.append((len(results), params, seed, colour))
            results.append({})
        if jobs:
            images = self._forward(jobs)
            start = 0
            for index, params, seed, colour in jobs:
                out: dict[str, Any] = {"images": images[start:start + params.n], "seed": seed, "size": self.size}
                if colour is not None:
                    out.update(colour=colour, label=self.gan.labels.index(colour))
                results[index] = out
                start += params.n
        return results

    def _forward(self, jobs: list[tuple[int, ImageParams, int, str | None]]) -> np.ndarray:
        """One forward pass for the whole batch: uint8 [sum(n), H, W, 3]."""
        torch = self._torch
        noise = torch.cat([self._latents(params, seed) for _, params, seed, _ in jobs])
        with torch.inference_mode():
            if self.gan.labels:
                labels = torch.tensor([self.gan.labels.index(colour) for _, params, _, colour in jobs
                                       for _ in range(params.n)])
                x = self.gan.module(noise, torch.nn.functional.one_hot(labels, len(self.gan.labels)).float())
            else:
                x = self.gan.module(noise)
            # tanh output [-1, 1] -> [0, 255]
            pixels = ((x + 1) * 127.5).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
        return np.ascontiguousarray(pixels.numpy())

    def info(self) -> dict[str, Any]:
        """Backs the images route's checks (sizes, n) without a round trip to the stage."""
        return {"engine": f"dcgan-{self.kind}", "sizes": [self.size], "max_images": self.max_images,
                "labels": list(self.gan.labels)}


class ColourPicker(ThreadedGenerationModel):
    """The LLM's answer -> the eye GAN's label: ``{"colour": "green", "label": 5}``.

    The first accepted word in the answer wins (SmolLM2 answers with the word, sometimes in a
    sentence); an answer naming none fails the request, listing the words accepted.
    """

    output_type = "tensor"

    # Words that mean a label (the labels themselves, plus spellings the LLM uses).
    SYNONYMS = {"grey": "gray", "black and white": "grayscale", "monochrome": "grayscale"}

    def __init__(self) -> None:
        from omni_engine.models.gan_labels import EYE_COLOURS

        self.labels = EYE_COLOURS
        words = {**{c: c for c in EYE_COLOURS}, **self.SYNONYMS}
        # Longest first, so "grayscale" is not read as "gray".
        self._words = dict(sorted(words.items(), key=lambda kv: -len(kv[0])))
        self._pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in self._words) + r")\b", re.IGNORECASE)
        super().__init__("colour-picker")

    def pick(self, text: str, request_id: str = "?") -> str:
        match = self._pattern.search(text)
        if match is None:
            raise ValueError(f"request {request_id}: the answer {text.strip()[:200]!r} names no eye colour; "
                             f"accepted words: {sorted(self._words)}")
        return self._words[match.group(1).lower()]

    def _render(self, request: GenerationRequest) -> dict[str, Any]:
        colour = self.pick(prompt_text(request.prompt), request.request_id)
        return {"colour": colour, "label": self.labels.index(colour)}

    def info(self) -> dict[str, Any]:
        return {"engine": "colour-picker", "labels": list(self.labels)}


def colour_question(text: str) -> str:
    """The question the eyes pipeline's LLM answers (put into the chat template by the caller).

    Worded for SmolLM2-135M, measured greedy on six requests: asked to choose from the list
    of 8 colours it answers "Amber" (the first) every time; asked for the colour word it
    answers 'The colour word in this request is "green".' for each. So it extracts the
    colour named; it does not map descriptions ("the colour of grass") to a colour.
    """
    return f"Which colour word appears in this request: {text}? Reply with just the colour word."


def make_face_gan(**engine_args: Any) -> GanImageModel:
    """Stage-config factory (``omni_engine.engines.gan_image:make_face_gan``)."""
    _check_args("make_face_gan", engine_args, {"model", "threads", "max_images"}, "gan-faces")
    return GanImageModel(kind="faces", **engine_args)


def make_eye_gan(**engine_args: Any) -> GanImageModel:
    """Stage-config factory (``omni_engine.engines.gan_image:make_eye_gan``)."""
    _check_args("make_eye_gan", engine_args, {"model", "threads", "max_images"}, "gan-eyes")
    return GanImageModel(kind="eyes", **engine_args)


def make_colour_picker(**engine_args: Any) -> ColourPicker:
    """Stage-config factory (``omni_engine.engines.gan_image:make_colour_picker``); takes no args."""
    if engine_args:
        raise TypeError(f"make_colour_picker got unknown engine_args {sorted(engine_args)}; it takes none")
    return ColourPicker()


def _check_args(factory: str, engine_args: dict[str, Any], allowed: set[str], recipe: str) -> None:
    unknown = sorted(set(engine_args) - allowed)
    if unknown:
        raise TypeError(f"{factory} got unknown engine_args {unknown}; allowed: {sorted(allowed)}")
    if "model" not in engine_args:
        raise TypeError(f"{factory} needs engine_args.model (`{recipe}`, or the directory it prepares)")
