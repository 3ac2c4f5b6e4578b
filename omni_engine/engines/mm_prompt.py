"""vLLM's shapes for a prompt's multimodal data, as they arrive over the wire.

msgpack has no tuple: an audio item ``(samples, sample_rate)`` (vLLM's form for audio at a rate
other than the model's) arrives as a two-item list, which vLLM would take as two items. The
llm stage gives vLLM back the tuples. A rendered multimodal input (the API process ran the model's
processor: ``entrypoints.mm_wire``) gets back its ``MultiModalKwargsItems`` and ``PlaceholderRange``s.
Everything else passes as it came.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

from omni_engine.inputs import WIRE_MM_KWARGS, OmniTextPrompt


def vllm_prompt(prompt: Any) -> Any:
    """``prompt`` as vLLM's ``generate`` takes it (a str, or a TextPrompt / TokensPrompt dict)."""
    if isinstance(prompt, OmniTextPrompt):
        prompt = prompt.to_vllm()
    if isinstance(prompt, dict) and isinstance(prompt.get("mm_kwargs"), dict) and WIRE_MM_KWARGS in prompt["mm_kwargs"]:
        return rendered_multimodal(prompt)
    if not isinstance(prompt, dict) or not isinstance(prompt.get("multi_modal_data"), dict):
        return prompt
    data = prompt["multi_modal_data"]
    if "audio" not in data:
        return prompt
    return {**prompt, "multi_modal_data": {**data, "audio": audio_items(data["audio"])}}


def audio_items(audio: Any) -> Any:
    """An audio entry with each ``[samples, rate]`` pair made the tuple vLLM expects."""
    if _is_pair(audio):
        return tuple(audio)
    if isinstance(audio, list):
        return [tuple(item) if _is_pair(item) else item for item in audio]
    return audio


def _is_pair(item: Any) -> bool:
    return (isinstance(item, (list, tuple)) and len(item) == 2 and hasattr(item[0], "shape")
            and isinstance(item[1], Real) and not isinstance(item[1], bool))


def rendered_multimodal(prompt: dict[str, Any]) -> dict[str, Any]:
    """A rendered ``MultiModalInput`` with its vLLM objects rebuilt from their wire form."""
    from vllm.multimodal.inputs import MultiModalKwargsItems, PlaceholderRange
    from vllm.v1.serial_utils import MsgpackDecoder

    wire = prompt["mm_kwargs"]
    # share_mem=False: the tensors outlive the request's shared memory (vLLM's EngineCore keeps them)
    items = MsgpackDecoder(MultiModalKwargsItems, share_mem=False).decode(
        [wire[WIRE_MM_KWARGS], *(memoryview(b) for b in wire["buffers"])])
    placeholders = {modality: [PlaceholderRange(offset=offset, length=length, is_embed=is_embed)
                               for offset, length, is_embed in ranges]
                    for modality, ranges in prompt["mm_placeholders"].items()}
    return {**prompt, "mm_kwargs": items, "mm_placeholders": placeholders}
