#!/usr/bin/env python
"""TransferQueue benchmark: write throughput (HTTP vs RPC, durability on and off), the wake-up
latency of a blocked read, and recovery time per million logged trajectories.

    python benchmarks/bench_transfer_queue.py [--seconds 5] [--recovery-trajectories 100000]

The server is a real ``omni-engine transfer-queue serve`` process; the writers run here, on
uvloop: 32 concurrent writers of ~2 KB trajectories, group size 16. HTTP writers post one
trajectory per request over keep-alive connections (slime's ``send_data_to_buffer``); RPC
writers send ``BatchWrite``s of 16. HTTP and RPC runs take turns on one server (``--rounds``,
the best of each kept), each from an empty queue: nothing is read, so a run holds everything it
wrote, and without the reset a later run would pay for growing the server's memory into pages
the machine never touched before (on these VMs a first touch costs several times an ordinary
page fault) instead of for the protocol. Ratios come from one run. Results print as a table
and go to JSON (default benchmarks/results/bench_transfer_queue.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_common import REPO, machine_info, pct, progress  # noqa: E402

WRITERS = 32
GROUP_SIZE = 16
READY = "transfer queue ready "


class Server:
    def __init__(self, data_dir: Path | None, durability: str = "fsync", group_size: int = GROUP_SIZE) -> None:
        cmd = [sys.executable, "-m", "omni_engine.entrypoints.cli.main", "transfer-queue", "serve", "--port", "0",
               "--rpc-address", "tcp://127.0.0.1:0", "--log-level", "WARNING", "--group-size", str(group_size),
               "--max-memory-bytes", str(16 << 30)]
        if data_dir is not None:
            cmd += ["--data-dir", str(data_dir), "--durability", durability]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()
        self.info: dict = {}
        self.lines: list[str] = []

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith(READY):
                    self.info = json.loads(line[len(READY):])
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(600) or not self.info:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self.url, self.rpc = self.info["http"], self.info["rpc"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def trajectory(uid: str, instance_id: str, size: int = 2048) -> dict:
    """About ``size`` bytes of JSON, slime-shaped."""
    item = {"uid": uid, "instance_id": instance_id,
            "messages": [{"role": "user", "content": "Solve: 2x + 3 = 7"},
                         {"role": "assistant", "content": ""}],
            "reward": 1.0, "extra_info": {"timestamp": "1707900000.0", "finish_reason": "stop", "label": "2"}}
    item["messages"][1]["content"] = "x" * max(0, size - len(json.dumps(item)))
    return item


class _HttpConnection:
    """A minimal HTTP/1.1 keep-alive client: the load generator must cost less than the server it
    measures (aiohttp's per-request work here is about what the server's is), so requests are
    written as bytes and responses read by Content-Length."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, url: str) -> _HttpConnection:
        host, port = url.split("://", 1)[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        return cls(reader, writer, f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), self.host.encode(), len(body), body))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = int(head.lower().split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


async def http_writes(url: str, seconds: float, warmup: float = 1.0) -> float:
    """Trajectories/s: WRITERS connections, each posting one trajectory per request."""
    counted = 0
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds
    run = uuid.uuid4().hex[:8]
    template = json.dumps(trajectory("UID", "INSTANCE")).encode()

    async def writer(w: int) -> None:
        nonlocal counted
        conn = await _HttpConnection.open(url)
        try:
            i = 0
            while (now := time.perf_counter()) < t_end:
                body = template.replace(b'"UID"', b'"%s-h%d-%d"' % (run.encode(), w, i), 1).replace(
                    b'"INSTANCE"', b'"%s-h%d-%d"' % (run.encode(), w, i // GROUP_SIZE), 1)
                status, _ = await conn.post("/buffer/write", body)
                if status != 200:
                    raise RuntimeError(f"write answered {status}")
                if now >= t_start:
                    counted += 1
                i += 1
        finally:
            conn.close()

    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    return counted / seconds


async def rpc_writes(rpc: str, seconds: float, batch: int = GROUP_SIZE, warmup: float = 1.0) -> float:
    from omni_engine.transfer_queue import AsyncTransferQueueClient

    counted = 0
    t_start = time.perf_counter() + warmup
    t_end = t_start + seconds
    run = uuid.uuid4().hex[:8]
    template = trajectory("", "")

    async def writer(w: int) -> None:
        nonlocal counted
        async with AsyncTransferQueueClient(rpc_address=rpc) as client:
            i = 0
            while (now := time.perf_counter()) < t_end:
                items = [dict(template, uid=f"{run}-r{w}-{i}-{j}", instance_id=f"{run}-r{w}-{i}") for j in range(batch)]
                result = await client.batch_write(items)
                assert result.written == batch, result
                if now >= t_start:
                    counted += batch
                i += 1

    await asyncio.gather(*(writer(w) for w in range(WRITERS)))
    return counted / seconds


async def wakeup_latency(rpc: str, n: int) -> dict:
    """A reader blocked in BatchRead; a writer sends the group's last trajectory: write sent -> groups in hand."""
    from omni_engine.transfer_queue import AsyncTransferQueueClient

    run = uuid.uuid4().hex[:8]
    times = []
    async with AsyncTransferQueueClient(rpc_address=rpc) as writer, \
            AsyncTransferQueueClient(rpc_address=rpc) as reader:
        for k in range(n):
            items = [trajectory(f"{run}-w{k}-{j}", f"{run}-w{k}") for j in range(GROUP_SIZE)]
            await writer.batch_write(items[:-1])
            read = asyncio.create_task(reader.read(max_groups=1, block=True, timeout=30))
            await asyncio.sleep(0.005)  # the read is waiting at the server
            t0 = time.perf_counter()
            await writer.batch_write(items[-1:])
            result = await read
            times.append((time.perf_counter() - t0) * 1e3)
            assert len(result.groups) == 1 and len(result.groups[0].trajectories) == GROUP_SIZE
    return {"n": n, "p50_ms": pct(times, 50), "p99_ms": pct(times, 99), "max_ms": max(times),
            "mean_ms": statistics.fmean(times)}


async def fill(rpc: str, total: int, size: int) -> None:
    from omni_engine.transfer_queue import AsyncTransferQueueClient

    template = trajectory("", "", size)
    per_writer = total // 8

    async def writer(w: int) -> None:
        async with AsyncTransferQueueClient(rpc_address=rpc) as client:
            for i in range(0, per_writer, GROUP_SIZE):
                await client.batch_write([dict(template, uid=f"f{w}-{i + j}", instance_id=f"f{w}-{i}")
                                          for j in range(GROUP_SIZE)])

    await asyncio.gather(*(writer(w) for w in range(8)))


def reset(server: Server) -> None:
    from omni_engine.transfer_queue import TransferQueueClient

    with TransferQueueClient(url=server.url) as admin:
        admin.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per throughput run")
    ap.add_argument("--rounds", type=int, default=2,
                    help="throughput runs per protocol and durability, taking turns; the best is kept")
    ap.add_argument("--wakeups", type=int, default=300)
    ap.add_argument("--recovery-trajectories", type=int, default=100_000)
    ap.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "bench_transfer_queue.json"))
    args = ap.parse_args()
    import uvloop

    res: dict = {"machine": machine_info(), "writers": WRITERS, "group_size": GROUP_SIZE, "trajectory_bytes": 2048,
                 "writes_per_s": {}, "wakeup": {}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-tq-"))
    try:
        for durability in ("fsync", "off"):
            server = Server(tmp / durability if durability != "off" else None, durability)
            try:
                runs: dict[str, list[float]] = {"http": [], "rpc": []}
                for round_ in range(args.rounds):
                    for proto in ("http", "rpc"):
                        progress(f"{proto.upper()} writes, durability {durability}, round {round_ + 1} ...")
                        reset(server)  # every run starts from an empty queue (nothing is read)
                        runs[proto].append(uvloop.run(http_writes(server.url, args.seconds) if proto == "http"
                                                      else rpc_writes(server.rpc, args.seconds)))
                progress(f"blocked-read wake-up, durability {durability} ...")
                reset(server)
                res["wakeup"][durability] = uvloop.run(wakeup_latency(server.rpc, args.wakeups))
            finally:
                server.stop()
            http, rpc = max(runs["http"]), max(runs["rpc"])
            res["writes_per_s"][durability] = {"http": http, "rpc": rpc, "rpc_over_http": rpc / http, "runs": runs}
        progress(f"recovery: logging {args.recovery_trajectories} trajectories ...")
        data_dir = tmp / "recovery"
        server = Server(data_dir, "fsync")
        try:
            uvloop.run(fill(server.rpc, args.recovery_trajectories, 2048))
        finally:
            server.stop()
        log_bytes = sum(p.stat().st_size for p in data_dir.glob("wal-*.log"))
        t0 = time.perf_counter()
        server = Server(data_dir, "fsync")
        startup = time.perf_counter() - t0
        server.stop()
        n = args.recovery_trajectories
        res["recovery"] = {"trajectories": n, "log_bytes": log_bytes, "replay_s": server.info["recovery_seconds"],
                           "restart_to_ready_s": startup,
                           "replay_s_per_million": server.info["recovery_seconds"] * 1e6 / n}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    w = res["writes_per_s"]
    print(f"\n{WRITERS} writers, ~2 KB trajectories, group size {GROUP_SIZE}")
    print(f"{'durability':>10} {'HTTP writes/s':>14} {'RPC writes/s':>13} {'RPC/HTTP':>9}")
    for d in ("fsync", "off"):
        print(f"{d:>10} {w[d]['http']:>14,.0f} {w[d]['rpc']:>13,.0f} {w[d]['rpc_over_http']:>8.1f}x")
    for d, lat in res["wakeup"].items():
        print(f"blocked read wake-up ({d}): p50 {lat['p50_ms']:.2f} ms, p99 {lat['p99_ms']:.2f} ms, "
              f"max {lat['max_ms']:.2f} ms over {lat['n']}")
    r = res["recovery"]
    print(f"recovery: {r['trajectories']:,} trajectories ({r['log_bytes'] / 2**20:.0f} MiB of log) replayed in "
          f"{r['replay_s']:.2f} s = {r['replay_s_per_million']:.1f} s per million (restart to ready "
          f"{r['restart_to_ready_s']:.1f} s)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
