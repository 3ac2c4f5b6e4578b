"""Wire header checks and the decoder's refusals, one edge at a time: what is refused, and that
the error names what was wrong and where (the mutation run's selection for
``omni_engine/wire/headers.py`` and ``omni_engine/wire/stage_decoder.py`` with
tests/test_stage_serialization.py; docs/mutation.md). No socket, no vLLM engine."""

from __future__ import annotations

import pickle
from fractions import Fraction
from typing import Any

import msgspec
import numpy as np
import pytest
from msgspec.msgpack import Ext

from omni_engine.stage_output import REQUEST_OUTPUT_FIELDS
from omni_engine.wire import stage_decoder
from omni_engine.wire.ext_types import CustomType, DataLocation
from omni_engine.wire.headers import (
    WireFormatError,
    check_header,
    check_image,
    check_shm_handle,
    numpy_dtype,
    torch_dtype,
)
from omni_engine.wire.stage_decoder import StageMsgpackDecoder

INLINE, FRAME, SHM = int(DataLocation.INLINE), int(DataLocation.FRAME), int(DataLocation.SHM)


def ext(code: int, payload: Any) -> Ext:
    return Ext(int(code), msgspec.msgpack.encode(payload))


def body(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def refused(data: Any, match: str, decoder: StageMsgpackDecoder | None = None) -> str:
    with pytest.raises(WireFormatError, match=match) as info:
        (decoder or StageMsgpackDecoder()).decode(data)
    return str(info.value)


# ------------------------------------------------------------------ headers.py
@pytest.mark.parametrize("name", [["float32"], {"a": 1}])
def test_an_unhashable_dtype_name_is_a_wire_error(name):
    with pytest.raises(WireFormatError, match="unknown torch dtype"):
        torch_dtype(name)


def test_an_invalid_numpy_dtype_is_named():
    with pytest.raises(WireFormatError, match="invalid dtype 'no-such-dtype'"):
        numpy_dtype("no-such-dtype")


def test_an_unhashable_image_mode_is_a_wire_error():
    with pytest.raises(WireFormatError, match="unsupported mode"):
        check_image(["L"], [1, 1], 1)


@pytest.mark.parametrize("size", [[2, 2, 5], ["2", 2], [2.0, 2], [2, -1], (2, 2), [2]])
def test_an_image_size_is_two_non_negative_ints(size):
    with pytest.raises(WireFormatError, match=r"image header has an invalid size"):
        check_image("L", size, 4)


def test_an_empty_image_is_a_valid_header():
    assert check_image("L", [0, 0], 0) == ("L", (0, 0))
    assert check_image("RGB", [0, 3], 0) == ("RGB", (0, 3))


@pytest.mark.parametrize("header", [["float32", [1], INLINE], "abcd", b"\x01\x02\x03\x04", 7])
def test_a_header_is_a_list_of_at_least_four(header):
    with pytest.raises(WireFormatError, match="malformed tensor header"):
        check_header(header, "tensor")


def test_a_bad_shared_memory_handle_is_shown_from_its_name_on():
    with pytest.raises(WireFormatError, match=r"got \['omni_seg', 0, 4\]"):
        check_shm_handle(["uint8", [4], SHM, "omni_seg", 0, 4], "tensor")
    with pytest.raises(WireFormatError, match=r"handle \['omni_seg', '0', 4, None\] is not"):
        check_shm_handle(["uint8", [4], SHM, "omni_seg", "0", 4, None], "tensor")


# ------------------------------------------------------------------ the decoder's refusals
def test_a_default_decoder_refuses_pickle_and_says_how_to_allow_it():
    data = body({"v": Ext(int(CustomType.PICKLE), pickle.dumps(Fraction(1, 3)))})
    refused(data, r"^ext PICKLE > received a pickled object \(ext 111\) but pickle is disabled; "
                  r"set OMNI_ENGINE_ALLOW_PICKLE=1 on both ends")


def test_a_truncated_message_keeps_msgspecs_reason():
    refused(b"\x92\x01", "truncated")


def test_an_unknown_ext_code_is_named():
    refused(body([Ext(99, b"\x90")]), "unknown msgpack ext type code 99 in stage message")


@pytest.mark.parametrize("code, kind", [(CustomType.TORCH_TENSOR, "tensor"), (CustomType.NDARRAY, "ndarray"),
                                        (CustomType.PIL_IMAGE, "image")])
def test_every_header_error_names_its_kind(code, kind):
    dtype = {"tensor": "uint8", "ndarray": "|u1", "image": "L"}[kind]
    name = f"ext {CustomType(code).name}"
    refused(body(ext(code, [dtype, [2]])), f"^{name} > malformed {kind} header")
    refused(body(ext(code, [dtype, [2, 1], INLINE, "not bytes"])),
            f"^{name} > malformed {kind} header: inline data is str, not bin")
    refused(body(ext(code, [dtype, [2, 1], FRAME, 3])), f"malformed {kind} header: {kind} refers to frame 3")
    refused(body(ext(code, [dtype, [2, 1], SHM, "omni_x"])), f"malformed {kind} header: a shared-memory handle")
    if kind != "image":
        refused(body(ext(code, [dtype, [3], INLINE, b"\0\0"])), f"^{name} > {kind} data is 2 bytes")


def test_a_header_that_is_not_msgpack_names_its_ext():
    refused(body([Ext(int(CustomType.TORCH_TENSOR), b"\xc1")]), "^ext TORCH_TENSOR: ")


def test_a_value_a_constructor_rejects_names_the_ext_and_the_error():
    decoder = StageMsgpackDecoder(vllm_types=False)
    refused(body([ext(CustomType.COMPLETION_OUTPUT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16])]),
            "^ext COMPLETION_OUTPUT: TypeError: ", decoder)


def test_the_path_to_a_failing_ext_is_named_three_levels_deep_at_most():
    bad = ext(CustomType.TORCH_TENSOR, ["uint8", [2]])
    two = refused(body(ext(CustomType.REQUEST_OUTPUT, [bad])), "malformed tensor header")
    assert two.startswith("ext REQUEST_OUTPUT > ext TORCH_TENSOR > ")
    deep = bad
    for _ in range(5):
        deep = ext(CustomType.REQUEST_OUTPUT, [deep])
    message = refused(body(deep), "malformed tensor header")
    assert message.count(" > ") == 3 and message.startswith("ext REQUEST_OUTPUT > ext REQUEST_OUTPUT > ")


@pytest.mark.parametrize("fields, got", [({1: 2}, "dict"), (["temperature"], "list"), (3, "int")])
def test_neutral_sampling_params_are_a_map_of_field_names(fields, got):
    refused(body(ext(CustomType.SAMPLING_PARAMS, fields)),
            f"malformed SamplingParams: a map of field names expected, got {got}", StageMsgpackDecoder(vllm_types=False))


def test_a_decoder_without_vllm_types_never_looks_vllm_up_for_its_own_exts(monkeypatch):
    def no_vllm():
        raise AssertionError("vLLM's types were looked up")

    monkeypatch.setattr(stage_decoder, "vllm_ext_types", no_vllm)
    decoder = StageMsgpackDecoder(vllm_types=False)
    image = decoder.decode(body(ext(CustomType.PIL_IMAGE, ["L", [1, 1], INLINE, b"\x07"])))
    assert image.size == (1, 1)
    refused(body([Ext(int(CustomType.PICKLE), b"x")]), "pickle is disabled", decoder)
    refused(body([ext(CustomType.OMNI_STRUCT, ["NoSuchStruct", None])]), "unknown wire struct 'NoSuchStruct'", decoder)


def _output(values_after: list[Any] | None = None, **changes: Any) -> list[Any]:
    values = dict.fromkeys(REQUEST_OUTPUT_FIELDS)
    values.update(request_id="r", outputs=[], finished=True)
    values.update(changes)
    return [values[name] for name in REQUEST_OUTPUT_FIELDS] + (values_after or [])


def test_a_plain_request_output_without_vllm_is_a_text_output_of_no_stage():
    out = StageMsgpackDecoder(vllm_types=False).decode(body(ext(CustomType.REQUEST_OUTPUT, _output())))
    assert (out.request_id, out.stage_id, out.final_output_type, out.multimodal_output, out.stage_versions) == (
        "r", 0, "text", {}, {})


def test_request_output_errors_name_the_wrong_types():
    refused(body(ext(CustomType.REQUEST_OUTPUT, ["r"])), "malformed RequestOutput on the wire: too few fields")
    refused(body(ext(CustomType.REQUEST_OUTPUT, _output(request_id=1, finished="yes", outputs={}))),
            "request_id int, finished str, outputs dict")
    refused(body(ext(CustomType.OMNI_REQUEST_OUTPUT, _output([0, "text"]))),
            "malformed OmniRequestOutput on the wire: missing stage fields")
    refused(body(ext(CustomType.OMNI_REQUEST_OUTPUT, _output([0, "text", [1]]))), "multimodal_output is list")


def test_an_omni_output_without_multimodal_output_or_versions_gets_empty_ones():
    for decoder in (StageMsgpackDecoder(vllm_types=False), StageMsgpackDecoder()):
        out = decoder.decode(body(ext(CustomType.OMNI_REQUEST_OUTPUT, _output([2, "audio", None]))))
        assert (out.stage_id, out.final_output_type, out.multimodal_output, out.stage_versions) == (2, "audio", {}, {})
        out = decoder.decode(body(ext(CustomType.OMNI_REQUEST_OUTPUT, _output([2, "audio", None, "v1"]))))
        assert out.stage_versions == {}


def test_frames_decode_to_their_bytes():
    arr = StageMsgpackDecoder().decode([body(ext(CustomType.NDARRAY, ["|u1", [2], FRAME, 1])), b"\xff\x01"])
    assert arr.tolist() == [255, 1] and arr.dtype == np.uint8
