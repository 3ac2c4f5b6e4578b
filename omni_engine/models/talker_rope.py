"""A talker's multimodal rope: vLLM runs a talker with 1-D positions; it places its rows itself.

A Qwen-Omni talker's prompt rows sit where the thinker's did (an image's tokens at their grid's
T/H/W), its later rows one past the last, in each of three channels; vLLM's scheduler knows only
1-D positions for a model without multimodal inputs. ``talker_rope_channels`` turns a flat batch's
positions into the channels from each request's own (``rope_prompt``, ``rope_from``), and
``multimodal_rope`` makes each decoder layer's rope vLLM's multimodal one with the same
frequencies (equal channels are ordinary rope). Imports vLLM.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.rotary_embedding import MRotaryEmbedding


def talker_rope_channels(positions: torch.Tensor,
                         segments: list[tuple[int, int, torch.Tensor, int]]) -> torch.Tensor:
    """A flat batch's 1-D ``positions`` as three rope channels: in each request's rows ``[begin, end)``,
    a prompt position ``p < L`` takes ``rope_prompt[:, p]`` (``[3, L]``), a later one ``rope_from + p - L``
    in every channel; other rows keep their position in every channel."""
    channels = positions.unsqueeze(0).expand(3, -1).clone()
    for begin, end, prompt, following in segments:
        rows, view = positions[begin:end], channels[:, begin:end]
        length = prompt.shape[1]
        in_prompt = rows < length
        view[:, in_prompt] = prompt[:, rows[in_prompt]].to(channels.dtype)
        view[:, ~in_prompt] = (rows[~in_prompt] - length + following).to(channels.dtype)
    return channels


def multimodal_rope(rope: Any, section: list[int], interleaved: bool = False) -> MRotaryEmbedding:
    """``rope`` (a layer's plain rotary embedding) as vLLM's multimodal one, same frequencies
    (``interleaved``: Qwen3's layout, T/H/W frequencies taking turns, else Qwen2.5's sections)."""
    if 2 * sum(section) != rope.rotary_dim:
        raise ValueError(f"talker_config.rope_parameters.mrope_section {section} sums to {sum(section)}, "
                         f"not half the talker's rotary dim {rope.rotary_dim}")
    return MRotaryEmbedding(rope.head_size, rope.rotary_dim, rope.max_position_embeddings, rope.base,
                            rope.is_neox_style, rope.dtype, mrope_section=list(section),
                            mrope_interleaved=interleaved)
