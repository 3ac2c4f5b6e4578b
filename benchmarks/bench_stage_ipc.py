#!/usr/bin/env python
"""Client <-> stage-process IPC benchmark, each number beside a same-run bound.

    python benchmarks/bench_stage_ipc.py [--quick] [--json out.json]

Starts real stage processes through ``StageEngineCoreClient`` (generation
stages running the do-nothing models of ``benchmarks/bench_models.py``) and
measures:

1. latency: round trip of a tiny request (submit -> output), p50/p90/p99 over
   sequential requests, beside a bare ZMQ ping-pong of the same message sizes
   over the same socket pattern (ROUTER->DEALER requests, PUSH->PULL replies)
   to a second process, with a blocking and with an asyncio client;
2. outputs/s through one client with many concurrent requests, and the mean
   number of outputs per ``get_outputs_async()`` batch;
3. GB/s of tensors (1 KiB .. 64 MiB) sent stage -> client, with shared memory
   (default) and with ZMQ frames (forced by a huge shm threshold in
   the stage's env), beside in-process memcpy of the same bytes and, for
   frames, a bare ZMQ transfer of the same bytes.

Results print as a table and go to JSON (default
benchmarks/results/bench_stage_ipc.json). Heavy imports (torch, vLLM via
omni_engine) happen inside functions: the bare-ZMQ peer is a spawned process
that re-imports this module and must start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import secrets
import statistics
import struct
import sys
import tempfile
import itertools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import (  # noqa: E402
    REPO,
    KiB,
    MiB,
    fmt_size,
    machine_info,
    memcpy_gbps,
    num,
    pct,
    progress,
)

TENSOR_SIZES = [1 * KiB, 16 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
ECHO_FACTORY = "benchmarks.bench_models:make_echo"
TENSOR_FACTORY = "benchmarks.bench_models:make_tensor_source"
FRAMES_SHM_THRESHOLD = 1 << 62

# Bare-ZMQ peer protocol: request [type, body]; body starts with <QQ (reply
# header bytes, reply data bytes) and is padded to the size of our request.
_RAW_REQ, _RAW_STOP, _RAW_READY, _RAW_REPLY = b"\x00", b"\x04", b"\x10", b"\x11"
_RUNS = itertools.count()  # request ids of each throughput run are its own


def lat_summary(ns: list[int]) -> dict[str, float]:
    us = [v / 1e3 for v in ns]
    return {"n": len(us), "p50_us": pct(us, 50), "p90_us": pct(us, 90), "p99_us": pct(us, 99),
            "mean_us": statistics.fmean(us), "min_us": min(us)}


# --------------------------------------------------------------------------- bare ZMQ
def _raw_peer(in_addr: str, out_addr: str) -> None:
    """The bare-ZMQ stand-in for a stage process: DEALER in, PUSH out, no work."""
    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.connect(out_addr)
    req.send_multipart([_RAW_READY, b"ready"])
    headers: dict[int, bytes] = {}
    blobs: dict[int, np.ndarray] = {}
    try:
        while True:
            frames = req.recv_multipart(copy=False)
            if frames[0].bytes == _RAW_STOP:
                break
            hdr_n, data_n = struct.unpack_from("<QQ", frames[1].buffer)
            hdr = headers.get(hdr_n) or headers.setdefault(hdr_n, b"h" * hdr_n)
            if data_n:
                blob = blobs.get(data_n)
                if blob is None:
                    blob = blobs[data_n] = np.full(data_n, data_n % 251, dtype=np.uint8)
                out.send_multipart([_RAW_REPLY, hdr, blob], copy=False)
            else:
                out.send_multipart([_RAW_REPLY, hdr], copy=False)
    finally:
        req.close()
        out.close()
        ctx.term()


class RawZmq:
    """Client half of the bare-ZMQ bound: ROUTER + PULL bound here, peer process connects."""

    def __init__(self) -> None:
        base = Path(tempfile.gettempdir()) / f"omni-bench-raw-{secrets.token_hex(4)}"
        self.paths = [f"{base}-in", f"{base}-out"]
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"ipc://{self.paths[0]}")
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(f"ipc://{self.paths[1]}")
        self.proc = multiprocessing.get_context("spawn").Process(
            target=_raw_peer, args=(f"ipc://{self.paths[0]}", f"ipc://{self.paths[1]}"), name="bench-raw-peer")
        self.proc.start()
        if not self.router.poll(60_000):
            self.close()
            raise RuntimeError("bare-ZMQ peer did not connect within 60 s")
        self.identity = self.router.recv_multipart()[0]

    @staticmethod
    def body(req_size: int, hdr_n: int, data_n: int = 0) -> bytes:
        return struct.pack("<QQ", hdr_n, data_n).ljust(req_size, b"\0")

    def latency(self, n: int, warmup: int, req_size: int, resp_size: int) -> list[int]:
        body, ident = self.body(req_size, resp_size), self.identity
        send, recv, clock = self.router.send_multipart, self.pull.recv_multipart, time.perf_counter_ns
        times = []
        for i in range(warmup + n):
            t0 = clock()
            send([ident, _RAW_REQ, body])
            recv(copy=False)
            if i >= warmup:
                times.append(clock() - t0)
        return times

    async def latency_async(self, n: int, warmup: int, req_size: int, resp_size: int) -> list[int]:
        import zmq.asyncio

        router = zmq.asyncio.Socket.from_socket(self.router)
        pull = zmq.asyncio.Socket.from_socket(self.pull)
        body, ident, clock = self.body(req_size, resp_size), self.identity, time.perf_counter_ns
        times = []
        try:
            for i in range(warmup + n):
                t0 = clock()
                await router.send_multipart([ident, _RAW_REQ, body])
                await pull.recv_multipart(copy=False)
                if i >= warmup:
                    times.append(clock() - t0)
        finally:
            # The shadows registered the sockets' fds with the loop; unregister
            # before the sockets close, or a later socket that reuses the fd
            # number is never woken (uvloop keeps the stale watcher).
            loop = asyncio.get_running_loop()
            for sock in (router, pull):
                loop.remove_reader(sock.getsockopt(zmq.FD))
        return times

    def bulk(self, size: int, reps: int, window: int, req_size: int, hdr_n: int) -> float:
        """Seconds to receive ``reps`` replies carrying ``size`` bytes each, ``window`` in flight."""
        body, ident = self.body(req_size, hdr_n, size), self.identity
        send, recv = self.router.send_multipart, self.pull.recv_multipart
        t0 = time.perf_counter()
        sent = 0
        for _ in range(min(window, reps)):
            send([ident, _RAW_REQ, body])
            sent += 1
        for _ in range(reps):
            frames = recv(copy=False)
            assert len(frames[-1]) == (size or hdr_n)
            del frames
            if sent < reps:
                send([ident, _RAW_REQ, body])
                sent += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.proc.is_alive() and hasattr(self, "identity"):
            self.router.send_multipart([self.identity, _RAW_STOP, b""])
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.ctx.destroy(linger=0)
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- stage helpers
def stage_client(factory: str, shm_threshold: int | None = None, max_batch_size: int = 256,
                 in_process: str | None = None, io: str = "loop"):
    """``in_process``: None (a stage process), "own" or "client" (``runtime.event_loop``);
    ``io``: a stage process's ``runtime.io``."""
    from omni_engine.connectors.settings import ConnectorSettings
    from omni_engine.stage_engine.in_process import ClientLoopStageClient, InProcessStageClient
    from omni_engine.stage_engine.stage_core_client import StageEngineCoreClient
    from omni_engine.stage_engine.stage_spec import StageProcessSpec

    connectors = ConnectorSettings() if shm_threshold is None else ConnectorSettings(shm_threshold=shm_threshold)
    spec = StageProcessSpec("generation", {"model_factory": factory}, max_batch_size=max_batch_size,
                            connectors=connectors, log_level="WARNING", io=io)
    if in_process == "own":  # runtime.process: false: a thread of this process, over inproc://
        return InProcessStageClient(0, spec)
    if in_process == "client":  # ... with event_loop: client: on this loop, no thread
        return ClientLoopStageClient(0, spec)
    return StageEngineCoreClient(0, process=spec, transport="ipc")


async def echo_latency(client, cfg: dict, tag: str = "") -> list[int]:
    """Round trips (ns) of one tiny request at a time, after a warm-up."""
    clock = time.perf_counter_ns
    times: list[int] = []
    for i in range(cfg["lat_warmup"] + cfg["lat_n"]):
        t0 = clock()
        await client.submit_request(f"l{tag}{i}", "ping", None)
        out = await client.get_output_async()
        t1 = clock()
        assert out.finished and out.multimodal_output["echo"] == "ping", out
        if i >= cfg["lat_warmup"]:
            times.append(t1 - t0)
    return times


async def interleaved_latency(paths: dict[str, Callable[[dict, str], Awaitable[list[int]]]], cfg: dict,
                              blocks: int = 5) -> dict[str, list[int]]:
    """Round trips (ns) of every path, in alternating blocks of the same size, so that the
    machine's noise (these are shared machines) hits all of them alike."""
    times: dict[str, list[int]] = {name: [] for name in paths}
    block = dict(cfg, lat_n=cfg["lat_n"] // blocks)
    for i in range(blocks):
        block["lat_warmup"] = cfg["lat_warmup"] if i == 0 else 10
        for name, measure in paths.items():
            times[name] += await measure(block, f"{name}{i}-")
    return times


async def replica_set_latency(client, cfg: dict, tag: str) -> list[int]:
    """Round trips through a one-replica ``StageReplicaSet`` over ``client`` (the layer every
    pipeline stage has); the client is on its own again afterwards."""
    from omni_engine.pipeline.replica_set import StageReplicaSet

    try:
        return await echo_latency(StageReplicaSet(0, [client]), cfg, tag)
    finally:
        client.sink = client.on_dead = None


async def started(client, what: str, log: dict) -> Any:
    t0 = time.perf_counter()
    await client.start()
    log.setdefault("stage_startup_s", {})[what] = round(time.perf_counter() - t0, 2)
    paths = log.setdefault("_paths", [])
    paths += [a[len("ipc://"):] for a in (client.input_address, client.output_address) if a.startswith("ipc://")]
    if getattr(client, "runtime_dir", None) is not None:
        paths.append(str(client.runtime_dir))
    return client


def wire_sizes() -> dict[str, int]:
    """Bytes on the wire of our echo request / output and of a frames-mode tensor output header."""
    import torch

    from omni_engine.outputs import OmniRequestOutput
    from omni_engine.wire.protocol import StageGenerateRequest, StageOutputs
    from omni_engine.wire.stage_serialization import StageMsgpackEncoder

    enc = StageMsgpackEncoder(shm_threshold=1 << 62)
    req = enc.encode(StageGenerateRequest("l12345", "ping", None, time.monotonic()))
    tensor_req = enc.encode(StageGenerateRequest("frames-67108864-0-123", {"nbytes": 64 * MiB}, None, time.monotonic()))
    out = OmniRequestOutput("l12345", finished=True, stage_id=0, final_output_type="echo",
                            multimodal_output={"echo": "ping"})
    resp = enc.encode(StageOutputs([out], time.time()))
    out.multimodal_output = {"tensor": torch.zeros(MiB, dtype=torch.uint8)}
    tensor_resp = enc.encode(StageOutputs([out], time.time()))
    return {"request_body": len(req[0]), "output_body": len(resp[0]),
            "tensor_request_body": len(tensor_req[0]), "tensor_output_header": len(tensor_resp[0])}


# --------------------------------------------------------------------------- phase 1+2
async def phase_echo(cfg: dict, res: dict) -> None:
    sizes = res["wire_sizes"]
    req_n, resp_n = sizes["request_body"], sizes["output_body"]
    # The stage process with its socket I/O on its event loop (the default) and in threads
    # (runtime.io: threads), and the bound: bare ZMQ, same sizes, same socket pattern, second process.
    clients = {io: stage_client(ECHO_FACTORY, max_batch_size=cfg["max_batch_size"], io=io)
               for io in ("loop", "threads")}
    raw = None
    try:
        for io, client in clients.items():
            await started(client, "echo" if io == "loop" else f"echo_{io}", res)
        raw = RawZmq()

        async def blocking(block: dict, tag: str) -> list[int]:
            return raw.latency(block["lat_n"], block["lat_warmup"], req_n, resp_n)

        async def asyncio_client(block: dict, tag: str) -> list[int]:
            return await raw.latency_async(block["lat_n"], block["lat_warmup"], req_n, resp_n)

        # 1. latency, one request at a time, every path in alternating blocks.
        times = await interleaved_latency({
            "stage": lambda block, tag: echo_latency(clients["loop"], block, tag),
            "replica_set": lambda block, tag: replica_set_latency(clients["loop"], block, tag),
            "stage_threads": lambda block, tag: echo_latency(clients["threads"], block, tag),
            "zmq_asyncio": asyncio_client,
            "zmq_blocking": blocking,
        }, cfg)
        res["latency"] = {name: lat_summary(ns) for name, ns in times.items()}
        # 2. outputs/s with many requests in flight, best of alternating rounds.
        res["throughput"] = []
        for window in cfg["tput_windows"]:
            row: dict[str, Any] = {"window": window}
            raw.bulk(0, min(1000, cfg["tput_n"]), window, req_n, resp_n)
            for _ in range(cfg["tput_rounds"]):
                for io, client in clients.items():
                    run = await outputs_per_second(client, cfg["tput_n"], window)
                    if run["outputs_per_s"] > row.get(io, {}).get("outputs_per_s", 0):
                        row[io] = run
                row["zmq_raw_per_s"] = max(row.get("zmq_raw_per_s", 0.0),
                                           cfg["tput_n"] / raw.bulk(0, cfg["tput_n"], window, req_n, resp_n))
            res["throughput"].append(row)
    finally:
        for client in clients.values():
            await client.shutdown()
        if raw is not None:
            raw.close()
    # The same stage in this process (runtime.process: false): in a thread, and on this loop.
    for event_loop, key in (("own", "in_process"), ("client", "in_process_client_loop")):
        client = stage_client(ECHO_FACTORY, max_batch_size=cfg["max_batch_size"], in_process=event_loop)
        try:
            await started(client, f"echo_{key}", res)
            res["latency"][key] = lat_summary(await echo_latency(client, cfg))
        finally:
            await client.shutdown()


async def outputs_per_second(client, total: int, window: int) -> dict[str, Any]:
    """Keep ``window`` requests in flight until ``total`` outputs came back."""
    slots = asyncio.Semaphore(window)
    prefix = f"w{window}-{next(_RUNS)}-"

    async def submit_all() -> None:
        for i in range(total):
            await slots.acquire()
            await client.submit_request(f"{prefix}{i}", "x", None)

    batches = received = 0
    t0 = time.perf_counter()
    producer = asyncio.create_task(submit_all())
    try:
        while received < total:
            items = await client.get_outputs_async()
            batches += 1
            received += len(items)
            for _ in items:
                slots.release()
        elapsed = time.perf_counter() - t0
        await producer
    finally:
        producer.cancel()
    return {"window": window, "outputs": received, "seconds": elapsed, "outputs_per_s": received / elapsed,
            "batches": batches, "mean_batch": received / batches}


# --------------------------------------------------------------------------- phase 3
def reps_for(size: int, cfg: dict) -> int:
    return int(max(cfg["tensor_min_reps"], min(cfg["tensor_max_reps"], cfg["tensor_bytes"] // size)))


async def stream_tensors(client, size: int, reps: int, window: int, tag: str) -> dict[str, float]:
    """Request ``reps`` tensors of ``size`` bytes, ``window`` in flight; each output is
    spot-checked and dropped at once (as a consumer would), so its slot can recycle."""
    prompt, expect = {"nbytes": size}, size % 251
    clock = time.perf_counter_ns
    starts: dict[str, int] = {}
    lat: list[int] = []
    sent = done = 0

    async def submit() -> None:
        nonlocal sent
        rid = f"{tag}-{sent}"
        sent += 1
        starts[rid] = clock()
        await client.submit_request(rid, prompt, None)

    t0 = time.perf_counter()
    while sent < min(window, reps):
        await submit()
    while done < reps:
        try:
            async with asyncio.timeout(60):
                out = await client.get_output_async()
        except TimeoutError:
            raise RuntimeError(f"{tag}: no output within 60 s ({done}/{reps} done, {sent} sent)") from None
        lat.append(clock() - starts.pop(out.request_id))
        t = out.multimodal_output["tensor"]
        if t.numel() != size or int(t[0]) != expect or int(t[-1]) != expect:
            raise AssertionError(f"{tag}: bad tensor for {out.request_id}: {t.shape} {t[:4]}")
        del t, out
        done += 1
        if sent < reps:
            await submit()
    elapsed = time.perf_counter() - t0
    return {"reps": reps, "seconds": elapsed, "gbps": size * reps / elapsed / 1e9,
            "p50_us": pct([v / 1e3 for v in lat], 50)}


def shm_segments(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


async def phase_tensors(cfg: dict, res: dict, mode: str) -> None:
    client = stage_client(TENSOR_FACTORY, shm_threshold=FRAMES_SHM_THRESHOLD if mode == "frames" else None)
    rows = res.setdefault("tensors", {})
    try:
        await started(client, f"tensor-{mode}", res)
        for size in cfg["sizes"]:
            reps = reps_for(size, cfg)
            warm = max(2, min(20, reps // 5))
            # Warm-up also fills the stage's pool with enough slots for the window.
            await stream_tensors(client, size, warm, cfg["window"], f"{mode}-{size}-w")
            trials = [await stream_tensors(client, size, reps, cfg["window"], f"{mode}-{size}-{i}")
                      for i in range(cfg["trials"])]
            r = dict(max(trials, key=lambda t: t["gbps"]))
            r["trials_gbps"] = [t["gbps"] for t in trials]
            progress(f"  {mode:>6} {fmt_size(size):>4}: {r['gbps']:.2f} GB/s")
            r["shm_segments_after"] = len(shm_segments(client.shm_prefix + "_"))
            rows.setdefault(str(size), {})[mode] = r
    finally:
        await client.shutdown()


def phase_bounds(cfg: dict, res: dict) -> None:
    rows = res.setdefault("tensors", {})
    hdr_n = res["wire_sizes"]["tensor_output_header"]
    req_n = res["wire_sizes"]["tensor_request_body"]
    raw = RawZmq()
    try:
        for size in cfg["sizes"]:
            row = rows.setdefault(str(size), {})
            row["memcpy"] = memcpy_gbps(size, cfg["tensor_bytes"])
            reps = reps_for(size, cfg)
            raw.bulk(size, max(2, min(20, reps // 5)), cfg["window"], req_n, hdr_n)
            secs = [raw.bulk(size, reps, cfg["window"], req_n, hdr_n) for _ in range(cfg["trials"])]
            row["zmq_raw"] = {"reps": reps, "seconds": min(secs), "gbps": size * reps / min(secs) / 1e9,
                              "trials_gbps": [size * reps / t / 1e9 for t in secs]}
            progress(f"  bounds {fmt_size(size):>4}: memcpy {row['memcpy']['numpy']:.2f} GB/s, "
                     f"zmq {row['zmq_raw']['gbps']:.2f} GB/s")
    finally:
        raw.close()


# --------------------------------------------------------------------------- report
def print_report(res: dict) -> None:
    cfg = res["config"]
    print()
    print(f"== stage IPC benchmark ({res['machine']['cpus']} CPUs, {res['machine']['platform']}, "
          f"loop={cfg['loop']}, {'quick' if cfg['quick'] else 'full'}) ==")
    ws = res["wire_sizes"]
    lat = res["latency"]
    print(f"\n1. Round trip of a tiny request, sequential (request body {ws['request_body']} B, "
          f"output body {ws['output_body']} B; the generation stage sends one output, so first = final)")
    print(f"{'path':<44}{'n':>7}{'p50 us':>10}{'p90 us':>10}{'p99 us':>10}{'x async':>9}{'x block':>9}")
    asyncio_base, base = lat["zmq_asyncio"]["p50_us"], lat["zmq_blocking"]["p50_us"]
    for key, label in (("stage", "stage process (io: loop, the default)"),
                       ("replica_set", "... behind a 1-replica StageReplicaSet"),
                       ("stage_threads", "stage process (io: threads)"),
                       ("in_process", "in-process stage (thread, inproc://)"),
                       ("in_process_client_loop", "in-process stage (client's loop)"),
                       ("zmq_asyncio", "bare ZMQ, asyncio client"),
                       ("zmq_blocking", "bare ZMQ, blocking client")):
        s = lat[key]
        print(f"{label:<44}{s['n']:>7}{s['p50_us']:>10.1f}{s['p90_us']:>10.1f}{s['p99_us']:>10.1f}"
              f"{s['p50_us'] / asyncio_base:>9.2f}{s['p50_us'] / base:>9.2f}")
    print("x async / x block: p50 over bare ZMQ's with an asyncio / a blocking client; the process paths and "
          "bare ZMQ ran in alternating blocks, the in-process ones after them")
    print(f"io: loop / io: threads p50: {lat['stage']['p50_us'] / lat['stage_threads']['p50_us']:.2f}")
    for key, label in (("in_process", "thread"), ("in_process_client_loop", "client's loop")):
        print(f"in-process ({label}) / process p50: {lat[key]['p50_us'] / lat['stage']['p50_us']:.2f}")
    print(f"replica set / client alone p50: {lat['replica_set']['p50_us'] / lat['stage']['p50_us']:.3f} "
          f"({lat['replica_set']['p50_us'] - lat['stage']['p50_us']:+.1f} us)")

    print("\n2. Outputs per second through one client (tiny outputs, one per request; "
          f"stage max_batch_size={cfg['max_batch_size']}; best of {cfg['tput_rounds']} alternating rounds)")
    print(f"{'in flight':>10}{'io':>9}{'outputs':>9}{'outputs/s':>11}{'batches':>9}{'mean batch':>12}"
          f"{'bare zmq/s':>12}{'x zmq':>8}")
    for t in res["throughput"]:
        for io in ("loop", "threads"):
            r = t[io]
            print(f"{t['window']:>10}{io:>9}{r['outputs']:>9}{r['outputs_per_s']:>11.0f}{r['batches']:>9}"
                  f"{r['mean_batch']:>12.1f}{t['zmq_raw_per_s']:>12.0f}{r['outputs_per_s'] / t['zmq_raw_per_s']:>8.2f}")
    print("mean batch: outputs per get_outputs_async() call; bare zmq/s: same sockets and window, "
          "one reply message per request, blocking client")

    print(f"\n3. Tensors stage -> client, {cfg['window']} request(s) in flight, output dropped on receipt; "
          f"GB/s (1e9 B/s), best of {cfg['trials']} runs of 'reps' requests;\n"
          "   x = ratio to memcpy of the same bytes; p50 = submit -> output with the window in flight")
    print(f"{'size':>6}{'reps':>6}{'memcpy':>8} |{'shm':>8}{'x':>8}{'p50 us':>8} |{'frames':>8}{'x':>8}"
          f"{'p50 us':>8} |{'zmq raw':>8}{'x':>8} |{'shm/frm':>8}")
    for size in cfg["sizes"]:
        row = res["tensors"][str(size)]
        mc = row["memcpy"]["numpy"]
        shm, frm, rawz = row.get("shm"), row.get("frames"), row.get("zmq_raw")

        def cell(r: dict | None, lat: bool = True) -> str:
            if r is None:
                return f"{'-':>8}{'-':>8}" + (f"{'-':>8}" if lat else "")
            return f"{num(r['gbps']):>8}{num(r['gbps'] / mc):>8}" + (f"{r['p50_us']:>8.0f}" if lat else "")

        ratio = f"{shm['gbps'] / frm['gbps']:>8.2f}" if shm and frm else f"{'-':>8}"
        print(f"{fmt_size(size):>6}{reps_for(size, cfg):>6}{num(mc):>8} |{cell(shm)} |{cell(frm)} |"
              f"{cell(rawz, lat=False)} |{ratio}")
    print("memcpy: np.copyto into a touched buffer, best of 5, one thread (below ~64K it measures the ~0.35 us "
          "Python call, not bandwidth);\nzmq raw: bare ZMQ to a second process, same sockets and window, data as "
          "one zero-copy frame (the bound for 'frames'); shm/frm: shm GB/s over frames GB/s")


def leftovers(res: dict) -> list[str]:
    """Anything of ours that should be gone: child processes, shm segments, socket files."""
    problems = []
    me = os.getpid()
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[1]) != me or fields[0] == "Z":
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                cmdline = "?"
            if "resource_tracker" in cmdline:  # multiprocessing's own helper, exits with us
                continue
            kids.append(f"{entry} ({cmdline[:80]})")
    if kids:
        problems.append(f"child processes still running: {kids}")
    segs = shm_segments(f"omni_{me}_")
    if segs:
        problems.append(f"/dev/shm segments left: {segs[:10]}{' ...' if len(segs) > 10 else ''}")
    paths = [p for p in res.get("_paths", []) if os.path.exists(p)]
    if paths:
        problems.append(f"socket files / runtime dirs left: {paths}")
    return problems


async def main_async(cfg: dict) -> dict:
    res: dict[str, Any] = {"config": cfg, "machine": machine_info(), "wire_sizes": wire_sizes()}
    t0 = time.perf_counter()
    progress("phase 1+2: echo stage (latency, outputs/s) ...")
    await phase_echo(cfg, res)
    progress("phase 3: tensor bounds (memcpy, bare ZMQ) ...")
    phase_bounds(cfg, res)
    for mode in ("shm", "frames"):
        progress(f"phase 3: tensors through a stage, {mode} ...")
        await phase_tensors(cfg, res, mode)
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "bench_stage_ipc.json"),
                    help="where to write the results")
    ap.add_argument("--window", type=int, default=2, help="tensor requests in flight (default 2)")
    ap.add_argument("--no-uvloop", action="store_true", help="client on the default asyncio loop")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    quick = args.quick
    cfg = {
        "quick": quick,
        "lat_n": 500 if quick else 3000,
        "lat_warmup": 50 if quick else 200,
        "tput_n": 5000 if quick else 30000,
        "tput_windows": [16, 256],
        "tput_rounds": 2 if quick else 3,
        "max_batch_size": 256,
        "sizes": TENSOR_SIZES,
        "window": args.window,
        # Per size and run: tensor_bytes worth of tensors, within [min, max] requests.
        "tensor_bytes": (128 if quick else 512) * MiB,
        "tensor_min_reps": 8 if quick else 16,
        "tensor_max_reps": 200 if quick else 1000,
        "trials": 2 if quick else 3,  # per size and path; the table shows the best
        "loop": "asyncio" if args.no_uvloop else "uvloop",
    }
    if args.no_uvloop:
        res = asyncio.run(main_async(cfg))
    else:
        import uvloop

        res = uvloop.run(main_async(cfg))
    print_report(res)
    problems = leftovers(res)
    res["leftovers"] = problems
    res.pop("_paths", None)
    for p in problems:
        print(f"WARNING: {p}")
    if not problems:
        print("clean: no leftover stage processes, /dev/shm segments or socket files")
    print(f"total {res['total_seconds']} s (stage startups: {res['stage_startup_s']})")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
