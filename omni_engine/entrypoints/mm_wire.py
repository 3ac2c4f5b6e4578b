"""A rendered multimodal input as the wire carries it to the text stage (client side).

vLLM's OpenAI server renders a chat with media in the API process: the model's processor has run
there, and the input is a ``MultiModalInput`` (``type: "multimodal"``) whose ``mm_kwargs`` are
vLLM objects (``MultiModalKwargsItems``: the audio features, the image patches) and whose
placeholders are ``PlaceholderRange`` dataclasses. The stage's vLLM takes that input as it is, so
the work is not done twice; only its vLLM types are made wire-safe here: ``mm_kwargs`` as vLLM's own
msgpack of them (its encoder knows every field kind), the tensors' buffers as wire tensors (shared
memory above the threshold, never copied through a pickle), the placeholders as lists. The llm stage
restores them (``omni_engine.engines.mm_prompt``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.exceptions import VLLMValidationError

from omni_engine.inputs import WIRE_MM_KWARGS


def wire_multimodal_input(prompt: dict[str, Any], request_id: str) -> dict[str, Any]:
    """``prompt`` (a rendered ``MultiModalInput``) with its vLLM objects in wire form."""
    from vllm.v1.serial_utils import MsgpackEncoder

    items = prompt["mm_kwargs"]
    cached = sorted({modality for modality, group in items.items() for item in group if item is None})
    if cached:
        # The frontend's processor cache held them back for an engine that has them: ours do not.
        raise VLLMValidationError(f"request {request_id!r}: the rendered {', '.join(cached)} input has items without "
                                  "data (the API process's multimodal processor cache must be off)",
                                  parameter="messages")
    buffers = MsgpackEncoder().encode(items)
    placeholders = {modality: [[p.offset, p.length, p.is_embed] for p in ranges]
                    for modality, ranges in prompt["mm_placeholders"].items()}
    return {**prompt, "mm_placeholders": placeholders,
            "mm_kwargs": {WIRE_MM_KWARGS: bytes(buffers[0]),
                          "buffers": [np.frombuffer(b, dtype=np.uint8) for b in buffers[1:]]}}
