"""Typed inputs that cross stage boundaries (ext codes 101 and 102)."""

from __future__ import annotations

from typing import Any

import msgspec


# A rendered multimodal input (vLLM's ``MultiModalInput``: the API process ran the model's processor)
# carries its ``mm_kwargs`` over the wire under this key: vLLM's own msgpack of them, whose tensor
# buffers travel as wire tensors (``entrypoints.mm_wire`` writes it, ``engines.mm_prompt`` reads it).
WIRE_MM_KWARGS = "vllm_msgpack"


class OmniTextPrompt(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A text prompt with optional multimodal data.

    Plain ``str`` and vLLM ``TextPrompt`` dicts are accepted everywhere too;
    this typed form is what input processors between stages produce, so a
    stage knows exactly which keys it can rely on.
    """

    prompt: str
    negative_prompt: str | None = None
    multi_modal_data: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None

    def to_vllm(self) -> dict[str, Any]:
        """The vLLM ``TextPrompt`` dict for this prompt."""
        out: dict[str, Any] = {"prompt": self.prompt}
        if self.multi_modal_data:
            out["multi_modal_data"] = self.multi_modal_data
        if self.mm_processor_kwargs:
            out["mm_processor_kwargs"] = self.mm_processor_kwargs
        return out


class OmniDiffusionSamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Sampling parameters of a diffusion stage."""

    num_inference_steps: int = 50
    guidance_scale: float = 7.5
    height: int | None = None
    width: int | None = None
    seed: int | None = None
    num_outputs_per_prompt: int = 1
    negative_prompt: str | None = None
    extra_args: dict[str, Any] = msgspec.field(default_factory=dict)


def prompt_text(prompt: Any) -> str:
    """The text of a prompt in any accepted form; TypeError names the form."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, OmniTextPrompt):
        return prompt.prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise TypeError(
        f"prompt must be a str, an OmniTextPrompt or a dict with a 'prompt' str, "
        f"got {type(prompt).__name__}"
    )
