"""vLLM's shapes for a prompt's multimodal data, as they arrive over the wire.

msgpack has no tuple: an audio item ``(samples, sample_rate)`` (vLLM's form for audio at a rate
other than the model's) arrives as a two-item list, which vLLM would take as two items. The
llm stage gives vLLM back the tuples; everything else passes as it came.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

from omni_engine.inputs import OmniTextPrompt


def vllm_prompt(prompt: Any) -> Any:
    """``prompt`` as vLLM's ``generate`` takes it (a str, or a TextPrompt / TokensPrompt dict)."""
    if isinstance(prompt, OmniTextPrompt):
        prompt = prompt.to_vllm()
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
