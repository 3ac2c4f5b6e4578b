"""Msgpack wire format between the client and stage processes (msgspec).

Modelled on vLLM's ``serial_utils.MsgpackEncoder``: ``encode`` returns a list
of buffers, the msgpack body first and then auxiliary buffers that ZMQ sends
as separate zero-copy frames. Foreign types travel as msgpack ext types with
fixed codes (``CustomType``), so fields typed ``Any`` still decode to the right
Python type. Tensor data travels one of three ways, by size:

* inline in the body (tiny tensors: a separate frame costs more than a copy);
* as its own ZMQ frame, sent and received without a copy;
* in a shared-memory slot leased from the producer's ``ShmPool``, sent as a
  handle. A tensor that already lives in a mapped segment (a slot the
  producer wrote into, or a view this process decoded) is sent as a handle
  to the same bytes, never copied: that is how a large output crosses from
  one stage to the next without the client touching it.

Pickle is off unless explicitly allowed on both ends; an unsupported type is a
``TypeError`` naming it.
"""

from __future__ import annotations

import logging
import pickle
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from msgspec.msgpack import Ext

from omni_engine.connectors.settings import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_SHM_THRESHOLD,
    ConnectorSettings,
)
from omni_engine.connectors.shm import SEGMENT_INDEX, ShmAttachments, ShmPool
from omni_engine.params import NeutralSamplingParams, SpeechParams
from omni_engine.stage_output import (
    OMNI_OUTPUT_FIELDS,
    OMNI_REQUIRED_FIELDS,
    REQUEST_OUTPUT_FIELDS,
    StageCompletionOutput,
    StageRequestOutput,
)
from omni_engine.wire.ext_types import (
    DATACLASS_CODES,
    DATACLASS_FIELDS,
    STRUCT_CODES,
    VLLM_CODES,
    CustomType,
    DataLocation,
    describe_type,
    ext_name,
    vllm_ext_types,
    vllm_types_if_imported,
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

logger = logging.getLogger(__name__)

# Frames arrive read-only; tensors decoded from them are views, as in vLLM.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

# Plain ints for the hot path (msgspec.msgpack.Ext requires int codes).
_CODE_OMNI_REQUEST_OUTPUT = int(CustomType.OMNI_REQUEST_OUTPUT)
_CODE_REQUEST_OUTPUT = int(CustomType.REQUEST_OUTPUT)
_CODE_TORCH_TENSOR = int(CustomType.TORCH_TENSOR)
_CODE_NDARRAY = int(CustomType.NDARRAY)
_CODE_PIL_IMAGE = int(CustomType.PIL_IMAGE)
_CODE_OMNI_STRUCT = int(CustomType.OMNI_STRUCT)
_CODE_PICKLE = int(CustomType.PICKLE)
_CODE_SAMPLING_PARAMS = int(CustomType.SAMPLING_PARAMS)
_CODE_COMPLETION_OUTPUT = int(CustomType.COMPLETION_OUTPUT)

_SCALARS = frozenset({int, float, str, bytes, bool, type(None)})

# Our own structs that may appear in Any fields (e.g. SpeechParams), by name.
_WIRE_STRUCTS: dict[str, type[msgspec.Struct]] = {}
_WIRE_STRUCT_NAMES: dict[type, str] = {}


def register_wire_struct(cls: type[msgspec.Struct]) -> type[msgspec.Struct]:
    """Let ``cls`` travel in ``Any`` fields with its type (ext 110). Decorator."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    _WIRE_STRUCTS[name] = cls
    _WIRE_STRUCT_NAMES[cls] = name
    return cls


register_wire_struct(SpeechParams)


class StageMsgpackEncoder:
    """Encodes messages into ``[body, *aux_frames]``. One per thread."""

    def __init__(
        self,
        *,
        shm_pool: ShmPool | None = None,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        shm_threshold: int = DEFAULT_SHM_THRESHOLD,
        allow_pickle: bool = False,
        share_memory: bool = True,
    ) -> None:
        """``share_memory`` False: no tensor leaves as a shared-memory handle, not even one
        already in a segment (a peer on another host could not map it)."""
        self.shm_pool = shm_pool if share_memory else None
        self.share_memory = share_memory
        self.inline_threshold = inline_threshold
        self.shm_threshold = shm_threshold
        self.allow_pickle = allow_pickle
        # One msgspec encoder per nesting depth: an ext's payload is encoded
        # while the outer encoder is mid-call.
        self._encoders = [msgspec.msgpack.Encoder(enc_hook=self._enc_hook)]
        self._depth = 0
        self._aux: list[Any] | None = None
        # The request that shared-memory slots leased now belong to; set while
        # an OmniRequestOutput's fields are encoded.
        self._owner: str | None = None

    @classmethod
    def from_settings(cls, settings: ConnectorSettings, shm_pool: ShmPool | None = None) -> StageMsgpackEncoder:
        """An encoder with a pipeline's connector settings (its pool only with shared memory on)."""
        return cls(shm_pool=shm_pool, inline_threshold=settings.inline_threshold,
                   shm_threshold=settings.shm_threshold, allow_pickle=settings.allow_pickle,
                   share_memory=settings.use_shm)

    def encode(self, obj: Any, owner: str | None = None) -> list[Any]:
        bufs: list[Any] = [b""]
        self._aux, self._owner = bufs, owner
        try:
            bufs[0] = self._encoders[0].encode(self._wrap_top(obj))
        finally:
            self._aux, self._owner = None, None
        return bufs

    def _wrap_top(self, obj: Any) -> Any:
        """Wrap known structs held directly in a message's fields."""
        if isinstance(obj, msgspec.Struct) and type(obj) not in STRUCT_CODES and type(obj) not in _WIRE_STRUCT_NAMES:
            changes = {}
            for name in obj.__struct_fields__:
                value = getattr(obj, name)
                wrapped = self._wrap(value)
                if wrapped is not value:
                    changes[name] = wrapped
            return msgspec.structs.replace(obj, **changes) if changes else obj
        return self._wrap(obj)

    def _wrap(self, value: Any) -> Any:
        """Turn Structs and dataclasses of known types into ext types.

        msgspec encodes those natively without calling ``enc_hook``, which
        would lose their type, so containers are walked for them; a list whose
        first item is a scalar (token ids, floats) is taken as all-scalar and
        not walked, to keep that cost off the hot path (a None first item
        does not count as a scalar).
        """
        cls = type(value)
        if cls in _SCALARS:
            return value
        code = STRUCT_CODES.get(cls)
        if code is not None:
            return Ext(int(code), self._nested(value))
        code = DATACLASS_CODES.get(cls)
        if code is not None:
            return Ext(int(code), self._nested(self._fields(value, DATACLASS_FIELDS[cls])))
        name = _WIRE_STRUCT_NAMES.get(cls)
        if name is not None:
            return Ext(_CODE_OMNI_STRUCT, self._nested((name, value)))
        if cls is list or cls is tuple:
            # None first is no sign of an all-scalar list: vLLM's prompt
            # logprobs are [None, {token: Logprob}, ...].
            if not value or (type(value[0]) in _SCALARS and value[0] is not None):
                return value
            return [self._wrap(v) for v in value]
        if cls is dict:
            return {k: self._wrap(v) for k, v in value.items()}
        if cls.__module__.startswith("vllm") and vllm_types_if_imported() is not None and (
                cls in STRUCT_CODES or cls in DATACLASS_CODES):
            # vLLM's classes join the tables when first seen (a process without vLLM has none to send).
            return self._wrap(value)
        return value

    def _nested(self, obj: Any) -> bytes:
        self._depth += 1
        try:
            if self._depth == len(self._encoders):
                self._encoders.append(msgspec.msgpack.Encoder(enc_hook=self._enc_hook))
            return self._encoders[self._depth].encode(obj)
        finally:
            self._depth -= 1

    def _fields(self, obj: Any, names: Sequence[str]) -> list[Any]:
        # Most fields of an output are None or scalars: skip the call to _wrap for them.
        wrap = self._wrap
        return [v if type(v := getattr(obj, name, None)) in _SCALARS else wrap(v) for name in names]

    def _enc_hook(self, obj: Any) -> Any:
        # torch, vLLM and PIL are looked up, never imported: an object of theirs exists only
        # where they are, and a stage that has none of them should not pay for their import.
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            return self._encode_tensor(obj)
        if isinstance(obj, np.ndarray):
            return self._encode_ndarray(obj)
        if isinstance(obj, StageRequestOutput):
            return self._encode_request_output(obj, omni=True)
        vllm_types = vllm_types_if_imported()
        if vllm_types is not None and isinstance(obj, vllm_types.request_output):
            return self._encode_request_output(obj, omni=isinstance(obj, vllm_types.omni_request_output))
        pil = sys.modules.get("PIL.Image")
        if pil is not None and isinstance(obj, pil.Image):
            return self._encode_image(obj)
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, NeutralSamplingParams):
            return Ext(_CODE_SAMPLING_PARAMS, self._nested(obj.fields))
        wrapped = self._wrap(obj)
        if wrapped is not obj:
            return wrapped
        if self.allow_pickle:
            return Ext(_CODE_PICKLE, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
        raise TypeError(
            f"cannot serialize an object of type {describe_type(obj)} "
            "for a stage message (pickle is disabled; set OMNI_ENGINE_ALLOW_PICKLE=1 to allow it)"
        )

    def _encode_request_output(self, obj: Any, omni: bool) -> Ext:
        """A vLLM ``RequestOutput`` (ext 108), or an ``OmniRequestOutput`` / ``StageRequestOutput``
        (ext 100: the same fields, then the stage's)."""
        if not omni:
            return Ext(_CODE_REQUEST_OUTPUT, self._nested(self._fields(obj, REQUEST_OUTPUT_FIELDS)))
        # The owner is set before the fields are wrapped: wrapping encodes
        # structs/dataclasses (and the tensors inside them) right away.
        outer_owner, self._owner = self._owner, obj.request_id
        try:
            values = self._fields(obj, REQUEST_OUTPUT_FIELDS)
            values += [obj.stage_id, obj.final_output_type, self._wrap(obj.multimodal_output),
                       getattr(obj, "stage_versions", None) or {}]
            return Ext(_CODE_OMNI_REQUEST_OUTPUT, self._nested(values))
        finally:
            self._owner = outer_owner

    def _encode_tensor(self, t: torch.Tensor) -> Ext:
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        # Conjugate/negative views are lazy bits, not data: materialize them
        # (no-ops otherwise), else view(uint8) refuses the tensor.
        t = t.resolve_conj().resolve_neg().contiguous()
        flat = t.reshape(-1)
        if flat.numel() <= 1:
            # Empty and one-element tensors count as contiguous whatever their
            # strides, but view(uint8) needs stride 1.
            flat = flat.as_strided((flat.numel(),), (1,))
        data = flat.view(torch.uint8).numpy()
        header = [str(t.dtype).removeprefix("torch."), list(t.shape)]
        return Ext(_CODE_TORCH_TENSOR, self._encode_data(header, data))

    def _encode_ndarray(self, a: np.ndarray) -> Ext:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise TypeError(f"cannot serialize a numpy array of dtype {a.dtype} (object/structured)")
        header = [a.dtype.str, list(a.shape)]  # before ascontiguousarray: it makes 0-d arrays 1-d
        a = np.ascontiguousarray(a)
        return Ext(_CODE_NDARRAY, self._encode_data(header, a.reshape(-1).view(np.uint8)))

    def _encode_image(self, img: Image.Image) -> Ext:
        data = np.frombuffer(img.tobytes(), dtype=np.uint8)
        return Ext(_CODE_PIL_IMAGE, self._encode_data([img.mode, list(img.size)], data))

    def _encode_data(self, header: list[Any], data: np.ndarray) -> bytes:
        """Append where the bytes of ``data`` (1-D uint8, contiguous) travel."""
        nbytes = data.nbytes
        if nbytes < self.inline_threshold:
            header += [DataLocation.INLINE, data.tobytes()]
            return msgspec.msgpack.encode(header)
        found = SEGMENT_INDEX.find(int(data.ctypes.data), nbytes) if self.share_memory else None
        if found is None and self.shm_pool is not None and nbytes >= self.shm_threshold:
            segment = self.shm_pool.lease(nbytes, self._owner or "")
            if segment is not None:
                segment.array[:nbytes] = data
                found = (segment.name, 0)
        elif found is not None and self.shm_pool is not None:
            self.shm_pool.mark_sent(found[0])  # a slot a model wrote its output into (empty_output)
        if found is not None:
            header += [DataLocation.SHM, found[0], found[1], nbytes, self._owner]
        else:
            assert self._aux is not None
            self._aux.append(data)
            header += [DataLocation.FRAME, len(self._aux) - 1]
        return msgspec.msgpack.encode(header)


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
        self._vllm_resolved = True

    def _decode_neutral_params(self, data: memoryview) -> NeutralSamplingParams:
        fields = self._any.decode(data)
        if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
            raise WireFormatError(f"malformed SamplingParams: a map of field names expected, got "
                                  f"{type(fields).__name__}")
        return NeutralSamplingParams(fields)

    def _decode_wire_struct(self, data: memoryview) -> Any:
        name, raw = msgspec.msgpack.decode(data, type=tuple[str, msgspec.Raw])
        cls = _WIRE_STRUCTS.get(name)
        if cls is None:
            raise WireFormatError(f"unknown wire struct {name!r} (not registered with register_wire_struct)")
        return self._typed_decoder(cls).decode(raw)

    def _decode_request_output(self, code: int, data: memoryview) -> Any:
        values = self._any.decode(data)
        if not isinstance(values, list) or len(values) < len(REQUEST_OUTPUT_FIELDS):
            raise WireFormatError("malformed RequestOutput on the wire: too few fields")
        if self.vllm_types:
            types = vllm_ext_types()
            cls = types.omni_request_output if code == CustomType.OMNI_REQUEST_OUTPUT else types.request_output
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
