"""The parts of a weight push that need no model: chunking, the two data planes, the store,
the checks against a checkpoint, version order."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_engine.connectors.shm import list_segments
from omni_engine.pipeline.weight_sync import WeightUpdateError, check_version_order
from omni_engine.stage_engine.security import KeyPair
from omni_engine.weights.chunk_reader import ChunkReader
from omni_engine.weights.expected import check_tensor, expected_tensors
from omni_engine.weights.layout import dtype_from_name, parse_init_info, parse_update_info
from omni_engine.weights.sender import WeightSender
from omni_engine.weights.store import WeightStore
from omni_engine.weights.zmq_transport import ChunkFetcher


def state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(64, 32), "b.weight": torch.randn(128, 32).to(torch.bfloat16),
            "c.bias": torch.arange(10, dtype=torch.int32), "d.empty": torch.empty(0, 4)}


def read_back(reader: ChunkReader, info: dict) -> dict[str, torch.Tensor]:
    parsed = parse_update_info(info)
    dtypes = [dtype_from_name(d, n) for n, d in zip(parsed.names, parsed.dtype_names)]
    out = {}
    for name, dtype, shape, buf in zip(parsed.names, dtypes, parsed.shapes, reader.buffers(parsed, dtypes)):
        n = memoryview(buf).nbytes // dtype.itemsize
        out[name] = torch.frombuffer(bytearray(buf), dtype=dtype, count=n).view(shape) if n else torch.empty(
            shape, dtype=dtype)
    return out


@pytest.mark.parametrize("backend", ["shm", "zmq"])
def test_every_tensor_arrives_intact_in_chunks_no_larger_than_asked(backend):
    weights = state()
    reader = ChunkReader()
    with WeightSender(backend, chunk_bytes=10_000) as sender:
        init = parse_init_info(sender.init_info())
        if backend == "zmq":
            reader.connect(init)
        got, chunks = {}, 0
        for info in sender.update_infos(weights):
            chunks += 1
            sizes = [torch.Size(s).numel() * dtype_from_name(d, n).itemsize
                     for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"])]
            assert len(sizes) == 1 or sum(sizes) <= 10_000  # a larger tensor goes alone
            got.update(read_back(reader, info))
    reader.close()
    assert chunks == 2
    assert got.keys() == weights.keys()
    for name, tensor in weights.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    assert not [s for s in list_segments() if s.startswith(sender._prefix)]  # unlinked on close


def test_a_zmq_chunk_is_refused_to_a_peer_without_the_handed_out_key_and_when_no_longer_offered():
    with WeightSender("zmq", timeout_s=1.0, chunk_bytes=10_000) as sender:
        init = sender.init_info()
        infos = sender.update_infos(state())
        first = next(infos)
        stranger = KeyPair.generate()
        intruder = ChunkFetcher(init["address"], init["server_public_key"], 1.0, stranger.public.decode(),
                                stranger.secret.decode())
        with pytest.raises(ValueError, match="did not send chunk 0"):
            intruder.fetch(first["push_id"], 0)
        intruder.close()
        with pytest.raises(ValueError, match="a zmq init_info with server_public_key needs the client"):
            ChunkFetcher(init["address"], init["server_public_key"], 1.0)
        friend = ChunkReader()
        friend.connect(parse_init_info(init))
        assert read_back(friend, first).keys() == set(first["names"])
        second = next(infos)
        with pytest.raises(ValueError, match="chunk 0 of push .* is not offered"):
            read_back(friend, first)
        assert read_back(friend, second).keys() == set(second["names"])
        assert sender._server.fetches == 2
        friend.close()


def test_the_store_keeps_the_committed_push_and_drops_an_aborted_one(tmp_path):
    weights = state()
    store = WeightStore(tmp_path / "store")
    with WeightSender("shm", chunk_bytes=10_000) as sender:
        store.begin()
        for info in sender.update_infos(weights):
            store.write_chunk(info, None)
        assert store.files() == []  # nothing committed yet
        store.commit()
        files = store.files()
        loaded = {k: v for path in files for k, v in load_file(path).items()}
        assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)
        store.begin()
        store.write_chunk(next(iter(sender.update_infos({"a.weight": torch.zeros(64, 32)}))), None)
        store.abort()
    assert store.files() == files and not (tmp_path / "store" / "pending").exists()
    store.close()
    assert (tmp_path / "store").exists()  # a directory it was given is the owner's
    own = WeightStore()
    root = own.root
    own.close()
    assert not root.exists()


def test_a_dead_processs_store_is_removed_when_the_next_one_starts():
    import subprocess
    import sys

    from omni_engine.weights.store import STORE_PREFIX

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    own = WeightStore()
    stale = own.root.parent / f"{STORE_PREFIX}{int(dead.stdout)}-abc"
    stale.mkdir()
    (stale / "chunk00000.safetensors").write_bytes(b"x")
    other = WeightStore()
    assert not stale.exists() and own.root.exists()  # a live process's store stays
    own.close()
    other.close()


def test_pushed_tensors_are_checked_against_the_checkpoint(tmp_path):
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.zeros(4, dtype=torch.bfloat16),
               "model.rotary_emb.inv_freq": torch.zeros(2)}, tmp_path / "model.safetensors")
    specs = expected_tensors(tmp_path, torch.float32, tie_word_embeddings=True)
    assert set(specs) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    check_tensor(specs["model.norm.weight"], "model.norm.weight", torch.float32, (4,), "here", 3)
    check_tensor(specs["model.norm.weight"], "model.norm.weight", torch.bfloat16, (4,), "here", 3)
    with pytest.raises(ValueError, match=r"here: weight 'model.norm.weight' has shape \[5\], the model's is \[4\]"):
        check_tensor(specs["model.norm.weight"], "model.norm.weight", torch.float32, (5,), "here", 3)
    with pytest.raises(ValueError, match="has dtype float16, the model takes float32 or bfloat16"):
        check_tensor(specs["model.norm.weight"], "model.norm.weight", torch.float16, (4,), "here", 3)
    with pytest.raises(ValueError, match="unknown weight 'x'"):
        check_tensor(specs.get("x"), "x", torch.float32, (4,), "here", 3)
    with pytest.raises(ValueError, match="has no \\*.safetensors checkpoint"):
        expected_tensors(tmp_path / "nothing", torch.float32)


def test_update_infos_are_told_apart_and_malformed_ones_named():
    assert type(parse_init_info({})).__name__ == "ShmInitInfo"
    assert type(parse_init_info({"address": "tcp://h:1"})).__name__ == "ZmqInitInfo"
    with pytest.raises(ValueError, match="invalid init_info for the zmq backend"):
        parse_init_info({"address": "tcp://h:1", "port": 3})
    with pytest.raises(ValueError, match="neither a shm chunk .* nor a zmq chunk"):
        parse_update_info({"names": []})
    with pytest.raises(ValueError, match="update_info must be a JSON object"):
        parse_update_info([1, 2])


@pytest.mark.parametrize("current, new, ok", [
    ("default", "1", True), ("3", "4", True), ("3", "10", True), ("10", "9", False), ("4", "4", False),
    ("step-a", "step-b", True), ("step-a", "step-a", False), ("3", "", False),
])
def test_versions_only_move_forward(current, new, ok):
    if ok:
        check_version_order(current, new)
    else:
        with pytest.raises(WeightUpdateError):
            check_version_order(current, new)
