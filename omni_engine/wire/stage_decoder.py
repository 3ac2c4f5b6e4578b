"""Decoding the msgpack wire format between the client and stage processes (msgspec).

The counterpart of ``stage_serialization.StageMsgpackEncoder``: ``[body, *aux_frames]``
back into messages. Input comes off a socket, so every header is checked before use
and anything wrong is a ``WireFormatError`` naming the ext type and the field. Tensors
and arrays are views of the frames or shared-memory segments they arrived in.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from omni_engine.connectors.shm import ShmAttachments
from omni_engine.params import NeutralSamplingParams
from omni_engine.stage_output import (
    OMNI_OUTPUT_FIELDS,
    OMNI_REQUIRED_FIELDS,
    REQUEST_OUTPUT_FIELDS,
    StageCompletionOutput,
    StageRequestOutput,
)
from omni_engine.wire.ext_types import (
    STRUCT_CODES,
    VLLM_CODES,
    WIRE_STRUCTS,
    CustomType,
    DataLocation,
    ext_name,
    vllm_ext_types,
)
from omni_engine.wire.headers import (
    WireFormatError,
    check_header,
    check_image,
    check_shape,
    check_shm_handle,
    numpy_dtype,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch
    from PIL import Image

_CODE_SAMPLING_PARAMS = int(CustomType.SAMPLING_PARAMS)
_CODE_COMPLETION_OUTPUT = int(CustomType.COMPLETION_OUTPUT)

ShmViewCallback = Callable[[str, "str | None", np.ndarray], None]


class ForeignShmHandleError(WireFormatError):
    """A peer on another host sent a shared-memory handle: a protocol violation, not noise."""


class StageMsgpackDecoder:
    """Decodes ``[body, *aux_frames]``. One per thread.

    Input comes off a socket, so every header is checked before it is used;
    anything wrong is a ``WireFormatError`` naming the ext type and the field.
    Shared-memory handles attach only segments ``shm`` allows.

    ``on_shm_view(segment, owner_request, view)`` is called for every
    shared-memory view handed out (a uint8 array that every tensor/array
    decoded from it references), so the owner of the views (the client)
    can tell the producer when a slot is free again. It is called once the
    whole message decoded: a message that fails half-way leaves no views behind.

    ``vllm_types`` False (a stage that runs no vLLM): vLLM's types decode to the
    project's neutral ones (``NeutralSamplingParams``, ``StageRequestOutput``,
    ``StageCompletionOutput``), so vLLM is never imported for them; the rarer ones
    (LoRA requests, logprobs, ...) still decode to vLLM's, importing it then.
    True: vLLM's own classes, vLLM imported at the first of them.
    """

    def __init__(
        self,
        t: Any = Any,
        *,
        shm: ShmAttachments | None = None,
        on_shm_view: ShmViewCallback | None = None,
        allow_pickle: bool = False,
        vllm_types: bool = True,
    ) -> None:
        self.vllm_types = vllm_types
        # Code -> class of the struct and dataclass exts known so far (vLLM's join on first need).
        self._structs: dict[int, type] = {int(code): cls for cls, code in STRUCT_CODES.items()
                                          if code not in VLLM_CODES}
        self._dataclasses: dict[int, type] = {} if vllm_types else {_CODE_COMPLETION_OUTPUT: StageCompletionOutput}
        self._vllm_resolved = False
        # (vLLM's RequestOutput, OmniRequestOutput) once resolved: looked up once, not per output.
        self._output_classes: tuple[type, type] | None = None
        self.shm = shm if shm is not None else ShmAttachments()
        self.on_shm_view = on_shm_view
        self.allow_pickle = allow_pickle
        # The peer's host when it is not ours (set at its READY): every handle is then refused.
        self.foreign_host: str | None = None
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook)
        self._any = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._typed: dict[type, msgspec.msgpack.Decoder] = {}
        self._aux: Sequence[Any] | None = None
        self._views: list[tuple[str, str | None, np.ndarray]] = []

    def decode(self, bufs: Any) -> Any:
        if not isinstance(bufs, (list, tuple)):
            bufs = [bufs]
        self._aux = bufs
        try:
            obj = self._decoder.decode(bufs[0])
        except msgspec.DecodeError as exc:
            raise WireFormatError(str(exc)) from None
        except RecursionError:
            raise WireFormatError("message is nested too deeply") from None
        finally:
            self._aux = None
            views, self._views = self._views, []
        if self.on_shm_view is not None:
            for name, owner, view in views:
                self.on_shm_view(name, owner, view)
        return obj

    def _typed_decoder(self, cls: type) -> msgspec.msgpack.Decoder:
        decoder = self._typed.get(cls)
        if decoder is None:
            decoder = self._typed[cls] = msgspec.msgpack.Decoder(cls, ext_hook=self._ext_hook)
        return decoder

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        try:
            return self._decode_ext(code, data)
        except WireFormatError as exc:
            # Name the path to the failing ext, a few levels deep (nesting is attacker-chosen).
            inner = str(exc)
            raise type(exc)(inner if inner.count(" > ") >= 3 else f"{ext_name(code)} > {inner}") from None
        except msgspec.DecodeError as exc:
            raise WireFormatError(f"{ext_name(code)}: {exc}") from None
        except RecursionError:
            raise WireFormatError(f"{ext_name(code)}: nested too deeply") from None
        except Exception as exc:  # noqa: BLE001 - foreign constructors (vLLM's __post_init__) reject bad values with any type
            raise WireFormatError(f"{ext_name(code)}: {type(exc).__name__}: {exc}") from exc

    def _decode_ext(self, code: int, data: memoryview) -> Any:
        if code == CustomType.TORCH_TENSOR:
            return self._decode_tensor(data)
        if code == CustomType.NDARRAY:
            return self._decode_ndarray(data)
        if code in (CustomType.OMNI_REQUEST_OUTPUT, CustomType.REQUEST_OUTPUT):
            return self._decode_request_output(code, data)
        if code == _CODE_SAMPLING_PARAMS and not self.vllm_types:
            return self._decode_neutral_params(data)
        cls = self._dataclasses.get(code)
        if cls is not None:
            return cls(*self._any.decode(data))
        cls = self._structs.get(code)
        if cls is not None:
            return self._typed_decoder(cls).decode(data)
        if code in VLLM_CODES and not self._vllm_resolved:
            self._resolve_vllm_types()
            return self._decode_ext(code, data)
        if code == CustomType.OMNI_STRUCT:
            return self._decode_wire_struct(data)
        if code == CustomType.PIL_IMAGE:
            return self._decode_image(data)
        if code == CustomType.PICKLE:
            if not self.allow_pickle:
                raise WireFormatError(
                    "received a pickled object (ext 111) but pickle is disabled; "
                    "set OMNI_ENGINE_ALLOW_PICKLE=1 on both ends to allow it"
                )
            return pickle.loads(data)
        raise WireFormatError(f"unknown msgpack ext type code {code} in stage message")

    def _resolve_vllm_types(self) -> None:
        """Add vLLM's classes (importing vLLM if it is not yet); neutral ones already chosen stay."""
        types = vllm_ext_types()
        for code, cls in types.structs.items():
            self._structs.setdefault(int(code), cls)
        for code, cls in types.dataclasses.items():
            self._dataclasses.setdefault(int(code), cls)
        self._output_classes = (types.request_output, types.omni_request_output)
        self._vllm_resolved = True

    def _decode_neutral_params(self, data: memoryview) -> NeutralSamplingParams:
        fields = self._any.decode(data)
        if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
            raise WireFormatError(f"malformed SamplingParams: a map of field names expected, got "
                                  f"{type(fields).__name__}")
        return NeutralSamplingParams(fields)

    def _decode_wire_struct(self, data: memoryview) -> Any:
        name, raw = msgspec.msgpack.decode(data, type=tuple[str, msgspec.Raw])
        cls = WIRE_STRUCTS.get(name)
        if cls is None:
            raise WireFormatError(f"unknown wire struct {name!r} (not registered with register_wire_struct)")
        return self._typed_decoder(cls).decode(raw)

    def _decode_request_output(self, code: int, data: memoryview) -> Any:
        values = self._any.decode(data)
        if not isinstance(values, list) or len(values) < len(REQUEST_OUTPUT_FIELDS):
            raise WireFormatError("malformed RequestOutput on the wire: too few fields")
        if self.vllm_types:
            if self._output_classes is None:
                self._resolve_vllm_types()
            cls = self._output_classes[code == CustomType.OMNI_REQUEST_OUTPUT]
        else:
            cls = StageRequestOutput
        out = cls.__new__(cls)
        out.__dict__.update(zip(REQUEST_OUTPUT_FIELDS, values))
        # The fields the client routes by; the rest is the consumer's to read.
        if not isinstance(out.request_id, str) or type(out.finished) is not bool or not isinstance(out.outputs, list):
            raise WireFormatError(
                f"malformed RequestOutput on the wire: request_id {type(out.request_id).__name__}, finished "
                f"{type(out.finished).__name__}, outputs {type(out.outputs).__name__} (expected str, bool, list)")
        if code == CustomType.OMNI_REQUEST_OUTPUT:
            extra = values[len(REQUEST_OUTPUT_FIELDS):]
            if len(extra) < OMNI_REQUIRED_FIELDS:
                raise WireFormatError("malformed OmniRequestOutput on the wire: missing stage fields")
            out.__dict__.update(zip(OMNI_OUTPUT_FIELDS, extra))
            if not isinstance(out.__dict__.get("stage_versions"), dict):
                out.stage_versions = {}
            if out.multimodal_output is None:
                out.multimodal_output = {}
            elif not isinstance(out.multimodal_output, dict):
                raise WireFormatError(f"malformed OmniRequestOutput {out.request_id!r}: multimodal_output is "
                                      f"{type(out.multimodal_output).__name__}, expected a dict")
        elif not self.vllm_types:  # a plain RequestOutput, read as a StageRequestOutput of no stage
            out.stage_id, out.final_output_type, out.multimodal_output, out.stage_versions = 0, "text", {}, {}
        return out

    def _decode_data(self, header: list[Any], what: str) -> memoryview | np.ndarray:
        """The bytes a tensor header points at (header[2:] is the location)."""
        location = header[2]
        if location == DataLocation.INLINE:
            if not isinstance(header[3], bytes):
                raise WireFormatError(f"malformed {what} header: inline data is {type(header[3]).__name__}, not bin")
            return memoryview(header[3])
        if location == DataLocation.FRAME:
            index, num_aux = header[3], len(self._aux or ()) - 1
            if type(index) is not int or not 0 < index <= num_aux:
                raise WireFormatError(f"malformed {what} header: {what} refers to frame {index!r}, "
                                      f"message has {num_aux} data frame(s)")
            return memoryview(self._aux[index]).cast("B")
        if location != DataLocation.SHM:
            raise WireFormatError(f"malformed {what} header: unknown data location {location!r}")
        return self._shm_view(header, what)

    def _shm_view(self, header: list[Any], what: str) -> np.ndarray:
        name, offset, nbytes, owner = check_shm_handle(header, what)
        if self.foreign_host is not None:
            raise ForeignShmHandleError(f"{what} arrived as a handle to shared-memory segment {name!r}, but the "
                                        f"peer runs on another host ({self.foreign_host}): its segments cannot "
                                        "be mapped here, so it must send ZMQ frames")
        try:
            mapped = self.shm.view(name, offset, nbytes)
        except (OSError, ValueError) as exc:
            raise WireFormatError(f"{what} in shared-memory segment {name!r} [{offset}, +{nbytes}) "
                                  f"cannot be mapped: {exc}") from None
        # numpy re-exports a buffer from its underlying object, so an array
        # built on a memoryview does not keep that memoryview alive: hand out
        # (and let on_shm_view track) an array that decoded values reference.
        view = np.frombuffer(mapped, dtype=np.uint8)
        self._views.append((name, owner, view))
        return view

    def _decode_tensor(self, data: memoryview) -> torch.Tensor:
        import torch

        header = check_header(msgspec.msgpack.decode(data), "tensor")
        dtype, itemsize = torch_dtype(header[0])
        buf = self._decode_data(header, "tensor")
        shape = check_shape(header[1], itemsize, len(buf), "tensor")
        if len(buf) == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8)).view(dtype).view(shape)

    def _decode_ndarray(self, data: memoryview) -> np.ndarray:
        header = check_header(msgspec.msgpack.decode(data), "ndarray")
        dtype = numpy_dtype(header[0])
        buf = self._decode_data(header, "ndarray")
        shape = check_shape(header[1], dtype.itemsize, len(buf), "ndarray")
        return np.frombuffer(buf, dtype=dtype).reshape(shape)

    def _decode_image(self, data: memoryview) -> Image.Image:
        from PIL import Image

        header = check_header(msgspec.msgpack.decode(data), "image")
        buf = self._decode_data(header, "image")
        mode, size = check_image(header[0], header[1], len(buf))
        return Image.frombytes(mode, size, bytes(buf))
