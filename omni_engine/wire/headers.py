"""Checks on the headers of tensors, arrays and images that come off the wire.

A header is attacker-controlled: every dtype, shape and size is checked
against a table or the bytes actually received *before* torch, numpy or PIL
sees it (PIL allocates a declared image size before reading its data).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


class WireFormatError(ValueError):
    """A message that does not decode: says what was wrong and where in the message.

    The only error a decoder raises for bad input, whatever the input: a
    receiver catches exactly this, logs or answers it, and carries on.
    """


@functools.cache
def _wire_dtypes() -> dict[str, tuple[torch.dtype, int]]:
    """Tensor dtypes a header may name (by torch attribute name), with their item sizes.

    Built once from torch's own dtypes, so a name off the wire is looked up in
    a table and never reaches ``getattr(torch, ...)``. Quantized dtypes are
    left out: their tensors are not plain storage and cannot be rebuilt by ``view``.
    Built at the first tensor: a process that never sees one never imports torch.
    """
    import torch

    table = {}
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype) and not str(value).startswith("torch.q"):
            table[name] = (value, value.itemsize)
    return table


# Bits per pixel of the PIL modes an image may arrive in: the byte count is
# checked against the declared size *before* PIL allocates the image.
_IMAGE_MODE_BITS = {
    "1": 1, "L": 8, "P": 8, "LA": 16, "PA": 16, "La": 16, "I;16": 16, "I;16B": 16, "I;16L": 16,
    "I;16N": 16, "RGB": 24, "YCbCr": 24, "LAB": 24, "HSV": 24, "RGBA": 32, "RGBa": 32, "RGBX": 32,
    "CMYK": 32, "I": 32, "F": 32,
}


def torch_dtype(name: Any) -> tuple[torch.dtype, int]:
    found = _wire_dtypes().get(name) if isinstance(name, str) else None
    if found is None:
        raise WireFormatError(f"unknown torch dtype {name!r} in tensor header")
    return found


def numpy_dtype(name: Any) -> np.dtype:
    if not isinstance(name, str):
        raise WireFormatError(f"ndarray header has dtype {name!r}, expected a dtype string")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise WireFormatError(f"ndarray header has an invalid dtype {name!r}: {exc}") from None
    if dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
        raise WireFormatError(f"refusing ndarray of dtype {dtype} (object, structured or empty items)")
    return dtype


def check_image(mode: Any, size: Any, nbytes: int) -> tuple[str, tuple[int, int]]:
    """(mode, size) of an image header, checked against its byte count before PIL allocates it."""
    bits = _IMAGE_MODE_BITS.get(mode) if isinstance(mode, str) else None
    if bits is None:
        raise WireFormatError(f"image header has an unsupported mode {mode!r}")
    if not (isinstance(size, list) and len(size) == 2 and all(type(d) is int and d >= 0 for d in size)):
        raise WireFormatError(f"image header has an invalid size {size!r}")
    need = (size[0] * bits + 7) // 8 * size[1]
    if need != nbytes:
        raise WireFormatError(f"image data is {nbytes} bytes but a {mode} image of {size} needs {need}")
    return mode, (size[0], size[1])


def check_shape(shape: Any, itemsize: int, nbytes: int, what: str) -> tuple[int, ...]:
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WireFormatError(f"{what} header has an invalid shape {shape!r}")
    need = math.prod(shape) * itemsize
    if need != nbytes:
        raise WireFormatError(f"{what} data is {nbytes} bytes but shape {shape} needs {need}")
    return tuple(shape)


def check_header(header: Any, what: str) -> list[Any]:
    """A tensor/array/image header: ``[type, shape, location, *where]``."""
    if not isinstance(header, list) or len(header) < 4:
        raise WireFormatError(f"malformed {what} header {header!r:.80}: expected [type, shape, location, ...]")
    return header


def check_shm_handle(header: list[Any], what: str) -> tuple[str, int, int, str | None]:
    """(segment, offset, nbytes, owner) of a shared-memory location; bounds are the segment's to check."""
    if len(header) != 7:
        raise WireFormatError(f"malformed {what} header: a shared-memory handle is "
                              f"[name, offset, nbytes, owner], got {header[3:]!r:.80}")
    name, offset, nbytes, owner = header[3:7]
    if (not isinstance(name, str) or type(offset) is not int or type(nbytes) is not int
            or not (owner is None or isinstance(owner, str))):
        raise WireFormatError(f"malformed {what} header: shared-memory handle {header[3:]!r:.120} is not "
                              "[str name, int offset, int nbytes, str|None owner]")
    return name, offset, nbytes, owner
