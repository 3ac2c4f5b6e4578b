"""Which input frames a convolutional decoder's output samples read: its receptive field, measured.

Streaming vocoders (Qwen2.5-Omni's BigVGAN, Qwen3-Omni's code2wav convolutions) render a piece from
its own frames plus context; the context that makes a piece's samples equal a whole pass's is the
decoder's receptive field. It follows from the layout (kernels, dilations, strides), so rather than
derive it from each module's padding conventions, it is read off the gradient: the gradient of the
samples with respect to every input frame is zero exactly outside the frames they read (in float64,
so no real dependency underflows to zero).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def frames_read(forward: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
                samples: Sequence[int]) -> tuple[int, int]:
    """The first and last frame (``inputs``' last axis) that samples ``samples`` of ``forward(inputs)``
    (flattened) depend on."""
    inputs = inputs.detach().requires_grad_()
    with torch.enable_grad():
        out = forward(inputs).reshape(-1)
        (grad,) = torch.autograd.grad(out[list(samples)].sum(), inputs)
    read = (grad.abs().sum(dim=tuple(range(grad.ndim - 1))) != 0).nonzero().reshape(-1)
    if not len(read):
        raise ValueError(f"samples {list(samples)} depend on no input frame")
    return int(read[0]), int(read[-1])
