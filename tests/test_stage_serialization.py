"""The stage wire format: round trips, the three tensor paths, zero copy, errors.

Real encoders, decoders, ZMQ sockets and shared-memory segments; no mocks.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import tempfile
import warnings
from fractions import Fraction
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from msgspec.msgpack import Ext
from PIL import Image
from vllm import SamplingParams
from vllm.logprobs import FlatLogprobs, Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.metrics.stats import RequestStateStats

from omni_engine.connectors.shm import (
    SEGMENT_INDEX,
    ShmAttachments,
    ShmPool,
    list_segments,
    new_run_prefix,
    stage_prefix,
)
from omni_engine.params import SpeechParams
from omni_engine.inputs import OmniDiffusionSamplingParams, OmniTextPrompt
from omni_engine.outputs import REQUEST_OUTPUT_FIELDS, OmniRequestOutput
from omni_engine.wire.protocol import (
    REQUEST_STRUCTS,
    RESPONSE_STRUCTS,
    StageAbortRequest,
    StageDead,
    StageHeartbeat,
    StageError,
    StageGenerateRequest,
    StageHealth,
    StageHealthCheck,
    StageOutputs,
    StageReady,
    StageReleaseRequest,
    StageRequestType,
    StageResponseType,
    StageShutdown,
    StageUtilityRequest,
    StageUtilityResult,
)
from omni_engine.wire.stage_serialization import (
    CustomType,
    DataLocation,
    StageMsgpackDecoder,
    StageMsgpackEncoder,
    WireFormatError,
    register_wire_struct,
)

INLINE = 64
SHM = 4096

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


# ----------------------------------------------------------------- helpers
def rt(obj: Any, t: Any = Any) -> Any:
    """Round trip with default-configured (pool-less) codecs, pickle off."""
    return StageMsgpackDecoder(t, allow_pickle=False).decode(StageMsgpackEncoder(allow_pickle=False).encode(obj))


def data_headers(body: Any) -> list[list[Any]]:
    """Every tensor/ndarray/image data header in a message body, in order."""
    found: list[list[Any]] = []

    def hook(code: int, data: memoryview) -> Any:
        if code in (CustomType.TORCH_TENSOR, CustomType.NDARRAY, CustomType.PIL_IMAGE):
            found.append(msgspec.msgpack.decode(data))
            return None
        return msgspec.msgpack.decode(data, ext_hook=hook)

    msgspec.msgpack.decode(body, ext_hook=hook)
    return found


def address_of(buf: Any) -> tuple[int, int]:
    """(start, length) of the memory behind a buffer-protocol object."""
    arr = np.frombuffer(buf, dtype=np.uint8)
    return int(arr.ctypes.data), arr.nbytes


def inside(ptr: int, nbytes: int, region: tuple[int, int]) -> bool:
    start, length = region
    return start <= ptr and ptr + nbytes <= start + length


def tensor_bytes(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    try:  # a one-element tensor may be "contiguous" with stride 2; a fresh copy has stride 1
        t = t.clone(memory_format=torch.contiguous_format)
    except RuntimeError:  # opaque dtypes cannot be copied (the tests build them contiguous)
        pass
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_completion_equal(a: CompletionOutput, b: CompletionOutput) -> None:
    assert type(a) is type(b) is CompletionOutput
    assert a == b  # dataclass equality, field by field (Logprob is a dataclass too)


def assert_request_output_equal(a: RequestOutput, b: RequestOutput) -> None:
    assert type(a) is type(b)
    for name in REQUEST_OUTPUT_FIELDS:
        va, vb = getattr(a, name), getattr(b, name)
        if name == "outputs":
            assert len(va) == len(vb)
            for x, y in zip(va, vb):
                assert_completion_equal(x, y)
        elif isinstance(va, np.ndarray):
            assert isinstance(vb, np.ndarray) and va.dtype == vb.dtype and np.array_equal(va, vb)
        else:
            assert va == vb, name


@pytest.fixture(scope="module")
def run_prefix():
    prefix = new_run_prefix()
    yield prefix
    leftover = list_segments(prefix)
    assert not leftover, f"segments left behind: {leftover}"


@pytest.fixture
def shm_codec(run_prefix):
    """Producer encoder with a pool, consumer decoder with its own attachments."""
    prefix = stage_prefix(run_prefix, 7)
    pool = ShmPool(prefix, max_bytes=8 << 20, min_slot=SHM)
    views: list[tuple[str, str | None, Any]] = []
    attachments = ShmAttachments()
    enc = StageMsgpackEncoder(shm_pool=pool, inline_threshold=INLINE, shm_threshold=SHM, allow_pickle=False)
    dec = StageMsgpackDecoder(shm=attachments, on_shm_view=lambda n, o, v: views.append((n, o, v)), allow_pickle=False)
    yield pool, enc, dec, attachments, views
    views.clear()
    attachments.detach()
    pool.close()
    assert list_segments(prefix) == []
    assert len(attachments) == 0


# ------------------------------------------------------------ round trips
def test_encode_decode_omni_request_output():
    encoder = StageMsgpackEncoder()
    decoder = StageMsgpackDecoder()
    original = OmniRequestOutput(request_id="test-1", finished=True, stage_id=0, final_output_type="text")
    bufs = encoder.encode(original)
    decoded = decoder.decode(bufs)
    assert decoded.request_id == original.request_id and decoded.finished == original.finished
    assert isinstance(decoded, OmniRequestOutput)
    assert decoded.stage_id == 0 and decoded.final_output_type == "text" and decoded.multimodal_output == {}


def test_weight_version_spans_and_stage_versions_cross_the_wire():
    """vLLM's per-token version spans are a registered wire type (ext 115), and the pipeline's
    stage -> versions map travels on every OmniRequestOutput (int stage ids kept)."""
    from vllm.outputs import WeightVersionSpan

    completion = _completion(0, "stop")
    completion.weight_versions = [WeightVersionSpan("3", 0, 2), WeightVersionSpan("4", 2, 4)]
    original = OmniRequestOutput("v-1", outputs=[completion], finished=True, stage_versions={0: ["3", "4"], 2: ["4"]})
    decoded = StageMsgpackDecoder().decode(StageMsgpackEncoder().encode(original))
    spans = decoded.outputs[0].weight_versions
    assert all(type(span) is WeightVersionSpan for span in spans)
    assert [(s.version, s.start, s.end) for s in spans] == [("3", 0, 2), ("4", 2, 4)]
    assert decoded.stage_versions == {0: ["3", "4"], 2: ["4"]}
    plain = StageMsgpackDecoder().decode(StageMsgpackEncoder().encode(OmniRequestOutput("v-2", finished=True)))
    assert plain.stage_versions == {}


def _completion(index: int, finish_reason: str | None) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text=f"hello {index}",
        token_ids=[15, 2, 99, index],
        cumulative_logprob=-1.25,
        logprobs=[
            {15: Logprob(-0.5, rank=1, decoded_token="he"), 7: Logprob(-2.0, rank=2, decoded_token="x")},
            {2: Logprob(-0.1, rank=1, decoded_token="llo")},
            {99: Logprob(-0.25)},
            {index: Logprob(-0.4, 3, "!")},
        ],
        finish_reason=finish_reason,
        stop_reason="." if finish_reason == "stop" else None,
    )


def test_omni_request_output_with_completions_audio_and_images():
    rng = np.random.default_rng(0)
    audio = rng.standard_normal(22050).astype(np.float32)
    rgb = Image.fromarray(rng.integers(0, 256, (9, 17, 3), dtype=np.uint8), "RGB")
    gray = Image.fromarray(rng.integers(0, 256, (4, 5), dtype=np.uint8), "L")
    original = OmniRequestOutput(
        "req-7",
        prompt="say hi",
        prompt_token_ids=[1, 2, 3],
        outputs=[_completion(0, "stop"), _completion(1, "length")],
        finished=True,
        stage_id=2,
        final_output_type="audio",
        multimodal_output={
            "audio": audio,
            "sample_rate": 22050,
            "images": [rgb, gray],
            "latent": torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4),
        },
    )
    decoded = rt(original)
    assert isinstance(decoded, OmniRequestOutput)
    assert_request_output_equal(original, decoded)
    assert decoded.outputs[0].logprobs[0][7] == Logprob(-2.0, rank=2, decoded_token="x")
    assert set(decoded.outputs[1].logprobs[3]) == {1}  # int keys stay ints
    assert decoded.outputs[1].finish_reason == "length" and decoded.outputs[0].stop_reason == "."
    assert decoded.text == "hello 0"
    assert (decoded.stage_id, decoded.final_output_type) == (2, "audio")
    mm = decoded.multimodal_output
    assert mm["sample_rate"] == 22050
    assert mm["audio"].dtype == np.float32 and mm["audio"].shape == (22050,)
    assert np.array_equal(mm["audio"], audio)
    for got, want in zip(mm["images"], [rgb, gray]):
        assert isinstance(got, Image.Image)
        assert (got.mode, got.size, got.tobytes()) == (want.mode, want.size, want.tobytes())
    assert mm["latent"].dtype == torch.bfloat16 and torch.equal(mm["latent"], original.multimodal_output["latent"])


def test_plain_request_output_stays_plain():
    flat = FlatLogprobs()
    flat.append({1: Logprob(-0.5, 1, "a"), 4: Logprob(-1.5, 2, "b")})
    flat.append(None)
    original = RequestOutput(
        "plain",
        "p",
        [1, 2],
        [None, {2: Logprob(-0.3, 1, "x")}],
        [_completion(0, None)],
        False,
        metrics=RequestStateStats(num_generation_tokens=3, arrival_time=1.5, first_token_latency=0.25),
        lora_request=LoRARequest("adapter", 3, "/tmp/adapter"),
        num_cached_tokens=2,
        prompt_token_id_logprobs=np.array([[0.5, -1.0]], dtype=np.float32),
        kv_transfer_params={"remote": "host:1", "blocks": [1, 2]},
    )
    decoded = rt(original)
    assert type(decoded) is RequestOutput
    assert_request_output_equal(original, decoded)
    assert type(decoded.metrics) is RequestStateStats and type(decoded.lora_request) is LoRARequest
    assert rt(flat) == flat and type(rt(flat)) is FlatLogprobs


def test_completion_output_and_lora_request():
    co = _completion(3, "stop")
    assert_completion_equal(co, rt(co))
    lora = LoRARequest("my-lora", 7, "/models/lora", base_model_name="base", load_inplace=True)
    got = rt(lora)
    assert type(got) is LoRARequest and got == lora


def test_sampling_params_keep_type_and_fields():
    sp = SamplingParams(
        n=2,
        temperature=0.3,
        top_p=0.9,
        top_k=7,
        seed=1234,
        stop=["\n\n", "END"],
        stop_token_ids=[42],
        max_tokens=17,
        min_tokens=2,
        logprobs=3,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"voice": "de", "k": [1, 2]},
    )
    got = rt(sp)
    assert type(got) is SamplingParams
    assert got.output_kind is RequestOutputKind.DELTA
    for field in SamplingParams.__struct_fields__:
        assert getattr(got, field) == getattr(sp, field), field
    assert got.n == 2 and got.stop == ["\n\n", "END"] and got.seed == 1234 and got.max_tokens == 17


def test_inputs_and_speech_params():
    prompt = OmniTextPrompt(
        prompt="draw a cat",
        negative_prompt="dogs",
        multi_modal_data={"audio": np.arange(10, dtype=np.int16)},
        modalities=["image"],
    )
    got = rt(prompt)
    assert type(got) is OmniTextPrompt
    assert got.prompt == "draw a cat" and got.negative_prompt == "dogs" and got.modalities == ["image"]
    assert np.array_equal(got.multi_modal_data["audio"], np.arange(10, dtype=np.int16))

    dsp = OmniDiffusionSamplingParams(
        num_inference_steps=4, guidance_scale=2.0, height=64, width=32, seed=9,
        extra_args={"noise": torch.ones(2, 2), "tag": "x"},
    )
    got = rt(dsp)
    assert type(got) is OmniDiffusionSamplingParams
    assert (got.num_inference_steps, got.guidance_scale, got.height, got.width, got.seed) == (4, 2.0, 64, 32, 9)
    assert torch.equal(got.extra_args["noise"], torch.ones(2, 2)) and got.extra_args["tag"] == "x"

    speech = SpeechParams(voice="de", speed=1.5, pitch=30)
    got = rt(speech)
    assert type(got) is SpeechParams and got == speech
    # Inside containers of an Any field the types survive too.
    got = rt({"params": [speech, SamplingParams(seed=3)], "p": prompt})
    assert type(got["params"][0]) is SpeechParams and type(got["params"][1]) is SamplingParams
    assert got["params"][1].seed == 3 and type(got["p"]) is OmniTextPrompt


def _protocol_messages() -> list[msgspec.Struct]:
    sp = SamplingParams(n=2, seed=5, stop=["x"], output_kind=RequestOutputKind.DELTA)
    outs = [
        OmniRequestOutput("a", outputs=[_completion(0, None)], finished=False, stage_id=0),
        OmniRequestOutput("b", finished=True, stage_id=1, final_output_type="audio",
                          multimodal_output={"audio": np.ones(300, np.float32), "sample_rate": 16000}),
        RequestOutput("c", None, [1], None, [], True),
    ]
    return [
        StageGenerateRequest("r1", OmniTextPrompt(prompt="hi"), sp, 12.5),
        StageGenerateRequest("r2", "plain prompt", SpeechParams(voice="fr")),
        StageAbortRequest(["r1", "r2"]),
        StageHealthCheck(3),
        StageUtilityRequest(4, "collective_rpc", ["m", torch.arange(5)], {"timeout": 1.0}),
        StageShutdown("bye"),
        StageReleaseRequest(["omni_1_ab_s0_0"]),
        StageReady(0, 1234, "omni_1_ab_s0", {"kind": "llm", "max_model_len": 2048}, "node-b/boot/42"),
        StageOutputs(outs, 99.0),
        StageError("boom", "r1", "ValueError"),
        StageHealth(3, True, 2, 1234),
        StageUtilityResult(4, {"ok": [1, 2]}),
        StageUtilityResult(5, error="nope"),
        StageDead("died"),
        StageHeartbeat(1700000000.5),
    ]


def test_every_protocol_struct_is_covered():
    covered = {type(m) for m in _protocol_messages()}
    assert set(REQUEST_STRUCTS.values()) | set(RESPONSE_STRUCTS.values()) <= covered
    assert {t.value for t in StageRequestType}.isdisjoint({t.value for t in StageResponseType})


@pytest.mark.parametrize("msg", _protocol_messages(), ids=lambda m: type(m).__name__)
def test_protocol_structs_round_trip(msg):
    decoded = StageMsgpackDecoder(type(msg)).decode(StageMsgpackEncoder().encode(msg))
    assert type(decoded) is type(msg)
    for field in msg.__struct_fields__:
        want, got = getattr(msg, field), getattr(decoded, field)
        if isinstance(msg, StageOutputs) and field == "outputs":
            assert len(got) == len(want) == 3
            for a, b in zip(want, got):
                assert_request_output_equal(a, b)
                if isinstance(a, OmniRequestOutput):
                    assert (b.stage_id, b.final_output_type) == (a.stage_id, a.final_output_type)
            assert np.array_equal(got[1].multimodal_output["audio"], np.ones(300, np.float32))
            assert got[1].multimodal_output["sample_rate"] == 16000
        elif isinstance(msg, StageUtilityRequest) and field == "args":
            assert got[0] == "m" and torch.equal(got[1], torch.arange(5))
        else:
            assert type(got) is type(want) and got == want, field
    if isinstance(msg, StageGenerateRequest) and isinstance(msg.sampling_params, SamplingParams):
        assert type(decoded.sampling_params) is SamplingParams
        assert decoded.sampling_params.output_kind is RequestOutputKind.DELTA
        assert decoded.sampling_params.n == 2 and decoded.sampling_params.stop == ["x"]
        assert type(decoded.prompt) is OmniTextPrompt


# --------------------------------------------------- property: tensors, arrays
def _torch_value_dtypes() -> list[torch.dtype]:
    """Dtypes torch can build, fill, copy and compare on CPU."""
    out = []
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                x = torch.ones(4, 4).to(dtype)
            torch.equal(x.t().contiguous(), x)
        except (RuntimeError, TypeError):
            continue
        out.append(dtype)
    return out


def _torch_opaque_dtypes(value: list[torch.dtype]) -> list[torch.dtype]:
    """Dtypes torch can allocate but not fill or compare (bits, complex32, sub-byte ints, float4).

    Quantized dtypes are left out: their tensors are not plain storage.
    """
    out = []
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        if dtype in value or str(dtype).startswith("torch.q"):
            continue
        try:
            torch.empty(4, dtype=dtype)
            torch.zeros(16, dtype=torch.uint8).view(dtype).contiguous().reshape(-1).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        out.append(dtype)
    return out


TORCH_DTYPES = _torch_value_dtypes()
TORCH_OPAQUE_DTYPES = _torch_opaque_dtypes(TORCH_DTYPES)


def test_dtype_lists_cover_the_usual_dtypes():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool, torch.int8,
                  torch.int16, torch.int32, torch.int64, torch.uint8, torch.complex64, torch.complex128):
        assert dtype in TORCH_DTYPES
    assert torch.complex32 in TORCH_OPAQUE_DTYPES and torch.bits8 in TORCH_OPAQUE_DTYPES


def _make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex128).to(dtype)
    if dtype.is_floating_point:
        # positive, finite and representable in every float8 variant (e8m0 has no sign or zero)
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 8 + 0.25).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**62)), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _layout(make, shape: tuple[int, ...], layout: str):
    """A value of logical ``shape`` in the given memory layout."""
    if layout == "transposed" and len(shape) >= 2:
        base = make(tuple(reversed(shape)))
        dims = tuple(reversed(range(len(shape))))
        return base.permute(*dims) if isinstance(base, torch.Tensor) else base.transpose(dims)
    if layout == "strided" and len(shape) >= 1:
        base = make((shape[0] * 2 + 1, *shape[1:]))
        return base[1::2]
    if layout == "last-dim-strided" and len(shape) >= 1:
        base = make((*shape[:-1], shape[-1] * 3))
        return base[..., ::3]
    if layout == "broadcast" and len(shape) >= 1:
        base = make((1, *shape[1:]))
        return base.expand(*shape) if isinstance(base, torch.Tensor) else np.broadcast_to(base, shape)
    return make(shape)


shapes = st.lists(st.integers(0, 24), min_size=0, max_size=4).map(tuple).filter(lambda s: math.prod(s) <= 12000)
layouts = st.sampled_from(["contiguous", "transposed", "strided", "last-dim-strided", "broadcast"])


def _expected_location(nbytes: int) -> DataLocation:
    if nbytes < INLINE:
        return DataLocation.INLINE
    return DataLocation.FRAME if nbytes < SHM else DataLocation.SHM


def _check_paths(value_nbytes: int, bufs, decoded_ptr: int, pool: ShmPool, leased_before: int, views) -> None:
    """The bytes went the way their size says, and the decoded value is a view, not a copy."""
    headers = data_headers(bufs[0])
    assert len(headers) == 1
    location = DataLocation(headers[0][2])
    event(f"path: {location.name}")
    assert location is _expected_location(value_nbytes)
    if location is DataLocation.INLINE:
        assert len(bufs) == 1 and pool.num_leased() == leased_before and not views
    elif location is DataLocation.FRAME:
        assert len(bufs) == 2 and pool.num_leased() == leased_before and not views
        assert inside(decoded_ptr, value_nbytes, address_of(bufs[1]))
    else:
        assert len(bufs) == 1 and pool.num_leased() == leased_before + 1 and len(views) == 1
        name, _owner, view = views[0]
        assert headers[0][3] == name and headers[0][4] == 0 and headers[0][5] == value_nbytes
        assert decoded_ptr == address_of(view)[0]
        assert SEGMENT_INDEX.find(decoded_ptr, value_nbytes) == (name, 0)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(TORCH_DTYPES), shape=shapes, layout=layouts, seed=st.integers(0, 2**31))
@example(dtype=torch.float32, shape=(), layout="contiguous", seed=1)  # 0-d, inline
@example(dtype=torch.bfloat16, shape=(3, 0, 2), layout="transposed", seed=1)  # empty
@example(dtype=torch.int64, shape=(10, 10), layout="transposed", seed=2)  # frame
@example(dtype=torch.complex64, shape=(24, 24), layout="strided", seed=3)  # shm
@example(dtype=torch.bool, shape=(24, 24, 24), layout="broadcast", seed=4)  # shm, stride 0
def test_tensor_round_trip_property(shm_codec, dtype, shape, layout, seed):
    pool, enc, dec, _, views = shm_codec
    original = _layout(lambda s: _make_tensor(dtype, s, seed), shape, layout)
    assert tuple(original.shape) == shape
    before = pool.num_leased()
    views.clear()
    bufs = enc.encode({"t": original}, owner="prop")
    got = dec.decode(bufs)["t"]
    assert isinstance(got, torch.Tensor)
    assert got.dtype == dtype and tuple(got.shape) == shape
    assert got.is_contiguous()
    assert torch.equal(got, original)
    assert tensor_bytes(got) == tensor_bytes(original)
    nbytes = original.numel() * original.element_size()
    if nbytes:
        _check_paths(nbytes, bufs, got.data_ptr(), pool, before, views)
    if views:
        assert views[0][1] == "prop"
    pool.release(pool.leases_of("prop"))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(TORCH_OPAQUE_DTYPES), shape=shapes, seed=st.integers(0, 2**31))
def test_opaque_dtype_tensors_round_trip_bytes(shm_codec, dtype, shape, seed):
    """Dtypes torch cannot compute with still travel bit-exactly (compared as bytes)."""
    pool, enc, dec, _, _ = shm_codec
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    original = raw.view(dtype).reshape(shape)
    got = dec.decode(enc.encode(original, owner="opaque"))
    assert got.dtype == dtype and tuple(got.shape) == shape
    assert tensor_bytes(got) == raw.numpy().tobytes()
    pool.release(pool.leases_of("opaque"))


NP_DTYPES = [
    np.dtype(d)
    for d in ("?", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "g", "c8", "c16",
              ">i4", ">f8", ">c16", "<M8[ms]", "<m8[ns]", "<U3", "S5", "V3")
]


def _make_ndarray(dtype: np.dtype, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    if dtype.kind == "b":
        flat = rng.integers(0, 2, n).astype(bool)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        flat = rng.integers(info.min, info.max, n, dtype=dtype.newbyteorder("="), endpoint=True)
    elif dtype.kind == "f":
        flat = rng.standard_normal(n) * 100
    elif dtype.kind == "c":
        flat = rng.standard_normal(n) + 1j * rng.standard_normal(n)
    elif dtype.kind in "mM":
        flat = rng.integers(-(2**40), 2**40, n).astype(np.int64).view(dtype.newbyteorder("="))
    elif dtype.kind == "U":
        flat = np.array(["".join(rng.choice(list("aé字z"), rng.integers(0, 4))) for _ in range(n)], dtype="U3")
    else:  # S, V
        flat = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
    return np.asarray(flat).astype(dtype).reshape(shape)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(NP_DTYPES), shape=shapes,
       layout=st.sampled_from(["contiguous", "transposed", "strided", "last-dim-strided", "broadcast", "reversed"]),
       seed=st.integers(0, 2**31))
@example(dtype=np.dtype("f4"), shape=(), layout="contiguous", seed=0)  # 0-d array stays 0-d
@example(dtype=np.dtype(">f8"), shape=(0, 5), layout="transposed", seed=0)
@example(dtype=np.dtype("i2"), shape=(30, 30), layout="transposed", seed=0)  # frame
@example(dtype=np.dtype("c16"), shape=(20, 20), layout="reversed", seed=0)  # shm, negative strides
def test_ndarray_round_trip_property(shm_codec, dtype, shape, layout, seed):
    pool, enc, dec, _, views = shm_codec
    if layout == "reversed":
        original = _make_ndarray(dtype, shape, seed)[::-1] if shape else _make_ndarray(dtype, shape, seed)
    else:
        original = _layout(lambda s: _make_ndarray(dtype, s, seed), shape, layout)
    assert original.shape == shape
    before = pool.num_leased()
    views.clear()
    bufs = enc.encode([original], owner="nprop")
    got = dec.decode(bufs)[0]
    assert isinstance(got, np.ndarray)
    assert got.dtype == dtype and got.shape == shape
    assert np.array_equal(got, original)
    assert got.tobytes() == original.tobytes()
    if original.nbytes:
        _check_paths(original.nbytes, bufs, int(got.ctypes.data), pool, before, views)
    pool.release(pool.leases_of("nprop"))


def test_conjugate_and_negative_views_encode_their_values():
    z = torch.randn(6, dtype=torch.complex64)
    for t in (z.conj(), torch.randn(5)._neg_view()):
        assert t.is_conj() or t.is_neg()
        got = rt(t)
        assert torch.equal(got, t.resolve_conj().resolve_neg()) and not got.is_conj()


def test_numpy_scalars_become_python_scalars():
    got = rt({"a": np.float32(1.5), "b": np.int64(3), "c": np.bool_(True)})
    assert got == {"a": 1.5, "b": 3, "c": True}


# -------------------------------------------------------------- zero copy
@pytest.mark.parametrize("transport", ["inproc", "ipc"])
def test_frames_are_decoded_in_place_after_zmq(transport):
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp()
    address = f"inproc://ser-{os.getpid()}" if transport == "inproc" else f"ipc://{tmp}/s.sock"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind(address)
        push.connect(address)
        tensor = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
        array = np.arange(512, dtype=np.int64)
        enc = StageMsgpackEncoder(inline_threshold=INLINE, shm_threshold=1 << 30)
        bufs = enc.encode(StageOutputs([{"t": tensor, "a": array, "small": torch.ones(2)}], 1.0))
        assert len(bufs) == 3  # body + two frames; the small tensor is inline
        push.send_multipart(bufs, copy=False)
        assert pull.poll(5000)
        frames = pull.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        msg = StageMsgpackDecoder(StageOutputs).decode(frames)
        got = msg.outputs[0]
        assert torch.equal(got["t"], tensor) and np.array_equal(got["a"], array)
        assert torch.equal(got["small"], torch.ones(2))
        assert inside(got["t"].data_ptr(), tensor.nbytes, address_of(frames[1].buffer))
        assert inside(int(got["a"].ctypes.data), array.nbytes, address_of(frames[2].buffer))

    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
        shutil.rmtree(tmp, ignore_errors=True)


def test_shm_tensor_is_a_view_of_the_attached_segment(shm_codec):
    pool, enc, dec, attachments, views = shm_codec
    audio = torch.linspace(-1, 1, 8192)
    out = OmniRequestOutput("req-shm", finished=True, final_output_type="audio",
                            multimodal_output={"audio": audio, "sample_rate": 24000})
    bufs = enc.encode(out)
    assert len(bufs) == 1 and pool.num_leased() == 1
    got = dec.decode(bufs).multimodal_output["audio"]
    assert torch.equal(got, audio)
    [(name, owner, view)] = views
    assert owner == "req-shm" and pool.leases_of("req-shm") == [name]
    assert len(attachments) == 1
    mapping = attachments.segment(name)  # the consumer's own mapping of the segment
    assert inside(got.data_ptr(), audio.nbytes, (mapping.address, mapping.size))
    assert got.data_ptr() == address_of(view)[0]
    # Same bytes as the producer's slot, not a copy: a write there shows here.
    slot = pool.leased_segment(name)
    assert slot.address != mapping.address
    slot.array[:4] = np.frombuffer(np.float32(42.0).tobytes(), np.uint8)
    assert got[0].item() == 42.0


def test_re_encoding_a_decoded_shm_tensor_forwards_the_handle(run_prefix, shm_codec):
    pool, enc, dec, attachments, views = shm_codec
    forward_pool = ShmPool(stage_prefix(run_prefix, 8), max_bytes=1 << 22, min_slot=SHM)
    forwarder = StageMsgpackEncoder(shm_pool=forward_pool, inline_threshold=INLINE, shm_threshold=SHM)
    downstream = ShmAttachments()
    try:
        latent = torch.randn(64, 64)
        array = np.arange(2048, dtype=np.float64)
        bufs = enc.encode(OmniRequestOutput("req-fwd", multimodal_output={"latent": latent, "arr": array}))
        assert pool.num_leased() == 2
        got = dec.decode(bufs).multimodal_output
        [(name_t, _, _), (name_a, _, _)] = views
        assert name_t != name_a and len(attachments) == 2
        leased = pool.num_leased()

        # The client forwards the decoded values to the next stage.
        fwd = forwarder.encode(StageGenerateRequest("req-fwd", {"latent": got["latent"], "arr": got["arr"]}))
        assert pool.num_leased() == leased and forward_pool.num_leased() == 0 and len(fwd) == 1
        h_t, h_a = data_headers(fwd[0])
        assert h_t[2] == DataLocation.SHM and h_t[3:6] == [name_t, 0, latent.nbytes]
        assert h_a[2] == DataLocation.SHM and h_a[3:6] == [name_a, 0, array.nbytes]

        # A contiguous slice goes as a handle into the same segment at its offset,
        # even below the shm threshold (no copy is ever made of shared bytes).
        rows = got["latent"][8:12]
        part = got["arr"][100:300]
        fwd2 = forwarder.encode([rows, part, got["latent"][:, 3]], owner="req-fwd")
        h_rows, h_part, h_col = data_headers(fwd2[0])
        assert h_rows[2] == DataLocation.SHM and h_rows[3:6] == [name_t, 8 * 64 * 4, 4 * 64 * 4]
        assert h_part[2] == DataLocation.SHM and h_part[3:6] == [name_a, 100 * 8, 200 * 8]
        assert h_rows[6] == "req-fwd"
        # A non-contiguous column is copied: not a handle into the original segment.
        assert not (h_col[2] == DataLocation.SHM and h_col[3] == name_t)
        assert pool.num_leased() == leased

        # The next stage decodes the forwarded handles from its own mapping.
        stage2 = StageMsgpackDecoder(shm=downstream)
        a, b, c = stage2.decode(fwd2)
        assert torch.equal(a, latent[8:12]) and np.array_equal(b, array[100:300]) and torch.equal(c, latent[:, 3])
        m = downstream.segment(name_t)
        assert inside(a.data_ptr(), a.nbytes, (m.address, m.size))
        assert a.data_ptr() == m.address + 8 * 64 * 4
    finally:
        downstream.detach()
        forward_pool.close()


def test_no_handle_goes_to_or_comes_from_a_peer_on_another_host(shm_codec):
    """To a stage on another host (``share_memory=False``) even a tensor already in shared memory
    travels as a frame; from one, a handle is refused as a ``ForeignShmHandleError``."""
    from omni_engine.wire.stage_serialization import ForeignShmHandleError

    pool, enc, dec, attachments, views = shm_codec
    latent = torch.randn(64, 64)
    bufs = enc.encode(OmniRequestOutput("req-far", multimodal_output={"latent": latent}))
    got = dec.decode(bufs).multimodal_output["latent"]
    to_far = StageMsgpackEncoder(inline_threshold=INLINE, shm_threshold=SHM, share_memory=False)
    fwd = to_far.encode(StageGenerateRequest("req-far", {"latent": got}))
    (header,) = data_headers(fwd[0])
    assert header[2] == DataLocation.FRAME and len(fwd) == 2
    assert torch.equal(StageMsgpackDecoder(StageGenerateRequest).decode(fwd).prompt["latent"], latent)
    from_far = StageMsgpackDecoder(shm=attachments)
    from_far.foreign_host = "node-b/boot/1"
    with pytest.raises(ForeignShmHandleError, match=r"shared-memory segment .* another host \(node-b/boot/1\)"):
        from_far.decode(enc.encode(OmniRequestOutput("req-far-2", multimodal_output={"latent": latent})))


def test_tensor_written_into_a_leased_slot_is_sent_as_its_handle(shm_codec):
    pool, enc, dec, _, _ = shm_codec
    slot = pool.lease(4096 * 4, "req-direct")
    out = torch.from_numpy(slot.array[: 4096 * 4]).view(torch.float32)
    out.copy_(torch.arange(4096, dtype=torch.float32))
    bufs = enc.encode(OmniRequestOutput("req-direct", multimodal_output={"x": out}))
    assert pool.num_leased() == 1
    [h] = data_headers(bufs[0])
    assert h[2] == DataLocation.SHM and h[3:7] == [slot.name, 0, 4096 * 4, "req-direct"]
    assert torch.equal(dec.decode(bufs).multimodal_output["x"], torch.arange(4096, dtype=torch.float32))


def test_tensors_in_wire_structs_belong_to_the_request(shm_codec):
    """A tensor nested in a registered struct is leased for the output's request."""
    pool, enc, dec, _, views = shm_codec
    got = dec.decode(enc.encode(OmniRequestOutput("req-owned", multimodal_output={
        "lat": _Latent(torch.ones(2048)), "audio": np.ones(2048, np.float32)})))
    assert isinstance(got.multimodal_output["lat"], _Latent)
    assert torch.equal(got.multimodal_output["lat"].data, torch.ones(2048))
    assert sorted(o for _, o, _ in views) == ["req-owned", "req-owned"]
    assert len(pool.leases_of("req-owned")) == 2


class _Latent(msgspec.Struct):
    data: Any


register_wire_struct(_Latent)


def test_pool_limit_falls_back_to_frames(run_prefix):
    pool = ShmPool(stage_prefix(run_prefix, 9), max_bytes=SHM * 2, min_slot=SHM)
    attachments = ShmAttachments()
    try:
        enc = StageMsgpackEncoder(shm_pool=pool, inline_threshold=INLINE, shm_threshold=SHM)
        tensors = [torch.full((SHM // 4,), float(i)) for i in range(3)]
        bufs = enc.encode(tensors, owner="r")
        locations = [h[2] for h in data_headers(bufs[0])]
        assert locations == [DataLocation.SHM, DataLocation.SHM, DataLocation.FRAME]
        assert len(bufs) == 2 and pool.num_leased() == 2
        got = StageMsgpackDecoder(shm=attachments).decode(bufs)
        assert all(torch.equal(a, b) for a, b in zip(got, tensors))
    finally:
        attachments.detach()
        pool.close()


# ------------------------------------------------------------------ errors
class Unknown:
    pass


def test_unknown_type_is_a_type_error_naming_it():
    enc = StageMsgpackEncoder(allow_pickle=False)
    with pytest.raises(TypeError, match=r"test_stage_serialization\.Unknown"):
        enc.encode(Unknown())
    with pytest.raises(TypeError, match="Unknown"):
        enc.encode(OmniRequestOutput("x", multimodal_output={"thing": [Unknown()]}))
    with pytest.raises(TypeError, match="Fraction"):
        enc.encode(StageUtilityResult(1, Fraction(1, 3)))


def test_pickle_needs_both_ends():
    payload = Ext(int(CustomType.PICKLE), pickle.dumps(Fraction(1, 3)))
    body = msgspec.msgpack.encode({"v": payload})
    with pytest.raises(TypeError, match="Fraction"):
        StageMsgpackEncoder(allow_pickle=False).encode({"v": Fraction(1, 3)})
    with pytest.raises(ValueError, match="pickle"):
        StageMsgpackDecoder(allow_pickle=False).decode(body)
    assert StageMsgpackDecoder(allow_pickle=True).decode(body) == {"v": Fraction(1, 3)}
    bufs = StageMsgpackEncoder(allow_pickle=True).encode(StageUtilityResult(1, [Fraction(2, 7)]))
    with pytest.raises(ValueError, match="pickle"):
        StageMsgpackDecoder(StageUtilityResult, allow_pickle=False).decode(bufs)
    got = StageMsgpackDecoder(StageUtilityResult, allow_pickle=True).decode(bufs)
    assert got.result == [Fraction(2, 7)]


def test_pickle_env_switch_reaches_the_wire_through_connector_settings(monkeypatch):
    from omni_engine import envs

    monkeypatch.setenv("OMNI_ENGINE_ALLOW_PICKLE", "1")
    settings = envs.connector_settings()
    assert settings.allow_pickle
    bufs = StageMsgpackEncoder.from_settings(settings).encode(Fraction(5, 2))
    assert StageMsgpackDecoder(allow_pickle=settings.allow_pickle).decode(bufs) == Fraction(5, 2)
    monkeypatch.setenv("OMNI_ENGINE_ALLOW_PICKLE", "0")
    with pytest.raises(TypeError, match="Fraction"):
        StageMsgpackEncoder.from_settings(envs.connector_settings()).encode(Fraction(5, 2))


def test_unknown_ext_code_is_named():
    with pytest.raises(ValueError, match="99"):
        StageMsgpackDecoder().decode(msgspec.msgpack.encode([Ext(99, b"\x90")]))


def _tensor_ext(header: list[Any], code: int = CustomType.TORCH_TENSOR) -> bytes:
    return msgspec.msgpack.encode(Ext(int(code), msgspec.msgpack.encode(header)))


@pytest.mark.parametrize(
    "header, match",
    [
        (["float32", [3], DataLocation.INLINE, b"\0" * 8], "needs 12"),
        (["float32", [2, -1], DataLocation.INLINE, b"\0" * 8], "invalid shape"),
        (["float32", "2", DataLocation.INLINE, b"\0" * 8], "invalid shape"),
        (["nonsense", [2], DataLocation.INLINE, b"\0" * 8], "unknown torch dtype"),
        (["float32", [2], DataLocation.FRAME, 1], "frame"),
        (["float32", [2], DataLocation.FRAME, 0], "frame"),
        (["float32", [2], 7, b""], "malformed"),
        (["float32", [2], DataLocation.SHM, "omni_x"], "malformed"),
        (["float32", [2], DataLocation.SHM, "../etc/passwd", 0, 8, None], "invalid shared-memory segment name"),
    ],
)
def test_bad_tensor_headers_are_value_errors(header, match):
    with pytest.raises(ValueError, match=match):
        StageMsgpackDecoder().decode(_tensor_ext(header))


def test_bad_ndarray_headers():
    with pytest.raises(ValueError, match="needs 24"):
        StageMsgpackDecoder().decode(_tensor_ext(["<f8", [3], DataLocation.INLINE, b"\0" * 16], CustomType.NDARRAY))
    with pytest.raises(ValueError, match="object"):
        StageMsgpackDecoder().decode(_tensor_ext(["|O", [1], DataLocation.INLINE, b"\0" * 8], CustomType.NDARRAY))


def test_missing_shm_segment_is_a_wire_error_naming_it():
    header = ["float32", [2], DataLocation.SHM, "omni_1_00000000_s0_404", 0, 8, None]
    with pytest.raises(WireFormatError, match=r"omni_1_00000000_s0_404.*No such file"):
        StageMsgpackDecoder().decode(_tensor_ext(header))


def test_object_and_structured_arrays_are_refused():
    enc = StageMsgpackEncoder()
    with pytest.raises(TypeError, match="object"):
        enc.encode(np.array([1, "a", None], dtype=object))
    with pytest.raises(TypeError, match="structured"):
        enc.encode(np.zeros(3, dtype=[("a", "i4"), ("b", "f8")]))


def test_truncated_messages_raise():
    out = OmniRequestOutput("t", outputs=[_completion(0, "stop")], finished=True,
                            multimodal_output={"a": np.arange(8, dtype=np.float32)})
    body = StageMsgpackEncoder().encode(out)[0]
    dec = StageMsgpackDecoder()
    assert isinstance(dec.decode(body), OmniRequestOutput)
    for cut in range(len(body)):
        with pytest.raises((msgspec.DecodeError, ValueError, TypeError)):
            dec.decode(body[:cut])
    # A decoded request output missing fields is refused, not half-built.
    short = msgspec.msgpack.encode(Ext(int(CustomType.OMNI_REQUEST_OUTPUT), msgspec.msgpack.encode(["x", None])))
    with pytest.raises(ValueError, match="too few fields"):
        dec.decode(short)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_garbage_never_crashes(data):
    body = StageMsgpackEncoder().encode(StageOutputs([OmniRequestOutput(
        "g", outputs=[_completion(0, None)], multimodal_output={"a": torch.arange(6)})]))[0]
    mutated = bytearray(body)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(mutated) - 1))
        mutated[i] = data.draw(st.integers(0, 255))
    garbage = data.draw(st.sampled_from([bytes(mutated), data.draw(st.binary(max_size=64))]))
    for decoder in (StageMsgpackDecoder(), StageMsgpackDecoder(StageOutputs)):
        try:
            decoder.decode(garbage)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, OSError,
                IndexError, KeyError, AttributeError, OverflowError, RuntimeError):
            pass


# ----------------------------------------------------- hostile headers (no socket)
def test_huge_declared_image_is_refused_before_allocating():
    """A 40000x40000 RGBA header with one byte of data: refused at once, no 6.4 GB allocation."""
    header = ["RGBA", [40000, 40000], DataLocation.INLINE, b"x"]
    with pytest.raises(WireFormatError, match=r"ext PIL_IMAGE.*needs 6400000000"):
        StageMsgpackDecoder().decode(_tensor_ext(header, CustomType.PIL_IMAGE))
    with pytest.raises(WireFormatError, match="unsupported mode"):
        StageMsgpackDecoder().decode(_tensor_ext(["XYZ", [1, 1], DataLocation.INLINE, b"x"], CustomType.PIL_IMAGE))


@pytest.mark.parametrize("name", ["qint8", "__class__", "Tensor", 7, None])
def test_tensor_dtype_names_come_from_a_table(name):
    with pytest.raises(WireFormatError, match="unknown torch dtype"):
        StageMsgpackDecoder().decode(_tensor_ext([name, [1], DataLocation.INLINE, b"\0"]))


@pytest.mark.parametrize("dtype", [{"names": ["a"], "formats": ["u1"], "itemsize": 2**40}, "i4,i4", "V0", "|O"])
def test_ndarray_dtypes_must_be_plain(dtype):
    with pytest.raises(WireFormatError, match="ndarray"):
        StageMsgpackDecoder().decode(_tensor_ext([dtype, [0], DataLocation.INLINE, b""], CustomType.NDARRAY))


def test_shm_handles_of_other_runs_and_bad_ranges_are_refused(run_prefix):
    """A decoder attaches only its pipeline's segments, only inside their bounds."""
    pool = ShmPool(stage_prefix(run_prefix, 3), max_bytes=1 << 20, min_slot=SHM)
    foreign = ShmPool(stage_prefix(f"omni_1_{os.urandom(4).hex()}", 0), max_bytes=1 << 20, min_slot=SHM)
    mine, theirs = pool.lease(SHM, "r"), foreign.lease(SHM, "r")
    attachments = ShmAttachments(f"omni_{os.getpid()}_")
    decoder = StageMsgpackDecoder(shm=attachments)
    try:
        ok = decoder.decode(_tensor_ext(["uint8", [4], DataLocation.SHM, mine.name, 0, 4, None]))
        assert ok.shape == (4,)
        bad = {
            "not one of this pipeline's": [theirs.name, 0, 4, None],
            "outside segment": [mine.name, SHM - 2, 4, None],
            "is not \\[str name": [mine.name, -1.5, 4, None],
            "owner": [mine.name, 0, 4, ["not", "a", "str"]],
            "invalid shared-memory segment name": ["omni_\0x", 0, 4, None],
        }
        for match, handle in bad.items():
            with pytest.raises(WireFormatError, match=match):
                decoder.decode(_tensor_ext(["uint8", [4], DataLocation.SHM, *handle]))
        assert theirs.name not in attachments.names()
    finally:
        del ok
        attachments.detach()
        pool.close()
        foreign.close()


def test_failed_message_reports_no_shm_views(run_prefix):
    """A message that fails after a good shared-memory tensor leaves no view to track."""
    pool = ShmPool(stage_prefix(run_prefix, 4), max_bytes=1 << 20, min_slot=SHM)
    seg = pool.lease(SHM, "r")
    views = []
    attachments = ShmAttachments()
    decoder = StageMsgpackDecoder(shm=attachments, on_shm_view=lambda *v: views.append(v))
    good = Ext(int(CustomType.TORCH_TENSOR), msgspec.msgpack.encode(["uint8", [4], DataLocation.SHM, seg.name, 0, 4, "r"]))
    bad = Ext(int(CustomType.TORCH_TENSOR), msgspec.msgpack.encode(["uint8", [9], DataLocation.INLINE, b"\0"]))
    try:
        with pytest.raises(WireFormatError, match="needs 9"):
            decoder.decode(msgspec.msgpack.encode([good, bad]))
        assert views == []
        decoder.decode(msgspec.msgpack.encode([good]))
        assert [v[:2] for v in views] == [(seg.name, "r")]
    finally:
        views.clear()
        attachments.detach()
        pool.close()


def test_request_output_routing_fields_are_typed():
    values = ["id", None, None, None, [], True] + [None] * (len(REQUEST_OUTPUT_FIELDS) - 6) + [0, "text", {}]
    body = lambda v: msgspec.msgpack.encode(Ext(int(CustomType.OMNI_REQUEST_OUTPUT), msgspec.msgpack.encode(v)))
    assert StageMsgpackDecoder().decode(body(values)).request_id == "id"
    for index, wrong in ((0, ["unhashable"]), (5, "yes"), (4, 3)):
        broken = list(values)
        broken[index] = wrong
        with pytest.raises(WireFormatError, match="malformed RequestOutput"):
            StageMsgpackDecoder().decode(body(broken))
    with pytest.raises(WireFormatError, match="multimodal_output"):
        StageMsgpackDecoder().decode(body(values[:-1] + [[1, 2]]))


def test_deep_nesting_is_a_wire_error():
    nested = msgspec.msgpack.encode(["a"])
    for _ in range(3000):
        nested = msgspec.msgpack.encode(Ext(int(CustomType.REQUEST_OUTPUT), nested))
    with pytest.raises(WireFormatError, match="nested too deeply"):
        StageMsgpackDecoder().decode(nested)
    with pytest.raises(WireFormatError, match="nested too deeply"):
        StageMsgpackDecoder().decode(b"\x91" * 100_000 + b"\xc0")


# ------------------------------------------------- a stage that runs no vLLM
def test_the_stage_side_completion_fields_are_vllm_s_own_in_its_order():
    import dataclasses

    from omni_engine.stage_output import COMPLETION_OUTPUT_FIELDS

    assert COMPLETION_OUTPUT_FIELDS == tuple(f.name for f in dataclasses.fields(CompletionOutput))


def test_a_vllm_free_stage_output_is_the_same_message_as_an_omni_request_output():
    """What eSpeak answers without vLLM and what it answered as an OmniRequestOutput are the same bytes,
    and the client reads both as an OmniRequestOutput with vLLM's CompletionOutput."""
    from omni_engine.outputs import aborted_output
    from omni_engine.stage_output import StageCompletionOutput, StageRequestOutput, aborted_stage_output

    audio = np.linspace(-1, 1, 5000, dtype=np.float32)
    stage_side = [StageRequestOutput("a", finished=True, stage_id=2, final_output_type="audio",
                                     multimodal_output={"audio": audio, "sample_rate": 22050},
                                     stage_versions={0: ["v1"]}),
                  StageRequestOutput("t", outputs=[StageCompletionOutput(0, "hi", [1, 2], finish_reason="stop")],
                                     finished=True, stage_id=1, prompt="p"),
                  aborted_stage_output("x", 3, "image")]
    client_side = [OmniRequestOutput("a", finished=True, stage_id=2, final_output_type="audio",
                                     multimodal_output={"audio": audio, "sample_rate": 22050},
                                     stage_versions={0: ["v1"]}),
                   OmniRequestOutput("t", "p", None, None, [CompletionOutput(0, "hi", [1, 2], None, None,
                                                                            finish_reason="stop")],
                                     True, stage_id=1),
                   aborted_output("x", 3, "image")]
    enc = StageMsgpackEncoder()
    ours, theirs = enc.encode(StageOutputs(stage_side, 1.0)), enc.encode(StageOutputs(client_side, 1.0))
    assert [bytes(b) for b in ours] == [bytes(b) for b in theirs]
    got = StageMsgpackDecoder(StageOutputs).decode(ours).outputs
    assert [type(o) for o in got] == [OmniRequestOutput] * 3
    assert np.array_equal(got[0].multimodal_output["audio"], audio) and got[0].stage_versions == {0: ["v1"]}
    assert type(got[1].outputs[0]) is CompletionOutput and got[1].text == "hi" and got[1].prompt == "p"
    assert got[2].outputs[0].finish_reason == "abort" and got[2].final_output_type == "image"


def test_a_vllm_free_stage_reads_vllm_params_as_neutral_ones_and_sends_them_back_unchanged():
    from omni_engine.params import NeutralSamplingParams, is_llm_sampling_params, speech_params
    from omni_engine.stage_output import StageCompletionOutput, StageRequestOutput

    params = SamplingParams(max_tokens=9, temperature=0.25, stop=["."])
    enc = StageMsgpackEncoder()
    stage_dec = StageMsgpackDecoder(StageGenerateRequest, vllm_types=False)
    got = stage_dec.decode(enc.encode(StageGenerateRequest("n", "text", params)))
    neutral = got.sampling_params
    assert type(neutral) is NeutralSamplingParams and is_llm_sampling_params(neutral)
    assert neutral.get("max_tokens") == 9 and neutral.get("stop") == ["."] and neutral.get("n", 1) == 1
    assert speech_params(neutral, "en").voice == "en"  # to a speech model: no params of its own
    # Forwarded by that stage, the client reads vLLM's SamplingParams again.
    back = StageMsgpackDecoder(StageGenerateRequest).decode(enc.encode(StageGenerateRequest("n", "text", neutral)))
    assert back.sampling_params == params
    # Outputs, too, decode to the stage-side types there.
    out = OmniRequestOutput("o", None, None, None, [CompletionOutput(0, "t", [3], None, None)], True, stage_id=4)
    seen = StageMsgpackDecoder(StageOutputs, vllm_types=False).decode(enc.encode(StageOutputs([out], 1.0))).outputs[0]
    assert type(seen) is StageRequestOutput and type(seen.outputs[0]) is StageCompletionOutput
    assert seen.text == "t" and seen.stage_id == 4
    # A malformed neutral params payload is a WireFormatError naming the ext.
    bad = [msgspec.msgpack.encode(["n", "text", Ext(int(CustomType.SAMPLING_PARAMS), msgspec.msgpack.encode([1])), 0.0])]
    with pytest.raises(WireFormatError, match="SAMPLING_PARAMS"):
        stage_dec.decode(bad)
