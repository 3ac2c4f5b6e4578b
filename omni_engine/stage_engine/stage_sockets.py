"""Where a stage's sockets live and how they are opened, on both ends.

Addresses: ``ipc://`` in a private (0700) runtime directory by default;
``tcp://`` binds to loopback unless a host is configured, so a stage is never
reachable from other machines by accident. With CURVE keys, the binding side
is a CURVE server (see ``security``) and the connecting side a CURVE client.
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import tempfile
from pathlib import Path

import zmq
import zmq.asyncio

from omni_engine.connectors.shm import pid_alive
from omni_engine.stage_engine import security

logger = logging.getLogger(__name__)

RUNTIME_DIR_PREFIX = "omni-"
TRANSPORTS = ("ipc", "tcp")
DEFAULT_TCP_HOST = "127.0.0.1"
# The largest message the request socket accepts: only READY (a few hundred
# bytes) ever arrives there, and ZMQ drops a peer that sends more.
MAX_READY_BYTES = 1 << 20


def remove_stale_runtime_dirs(prefix: str = RUNTIME_DIR_PREFIX, pattern: str = "*-s*-*",
                              root: Path | None = None) -> list[Path]:
    """Remove directories (``<prefix><pid>-...``, matching ``prefix + pattern``, in ``root``:
    default the system temp dir) of processes that died without cleaning up: a client killed
    with -9, a Ray launcher whose node was lost."""
    removed = []
    for path in (root or Path(tempfile.gettempdir())).glob(prefix + pattern):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def check_host(host: str) -> str | None:
    """Why ``host`` cannot be a tcp bind address, or None. Hostnames other than
    ``localhost`` are refused: bind to an interface's address, not a name."""
    if host in ("*", "localhost"):
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"{host!r} is not an IP address, 'localhost' or '*'"
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*": every interface
        return False


def make_addresses(stage_id: int, transport: str, runtime_dir: Path,
                   host: str | None = None) -> tuple[str, str]:
    """Input/output addresses for a stage. ``tcp`` ports are chosen at bind time."""
    if transport == "ipc":
        if host is not None:
            raise ValueError(f"stage {stage_id}: a host ({host!r}) applies only to transport 'tcp'")
        return f"ipc://{runtime_dir}/in", f"ipc://{runtime_dir}/out"
    if transport == "tcp":
        host = DEFAULT_TCP_HOST if host is None else host
        problem = check_host(host)
        if problem is not None:
            raise ValueError(f"stage {stage_id}: {problem}")
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        return f"tcp://{host}:*", f"tcp://{host}:*"
    if transport == "inproc":  # a stage in a thread of this process (in_process.py)
        name = f"omni-{runtime_dir.name}"
        return f"inproc://{name}-in", f"inproc://{name}-out"
    raise ValueError(f"stage {stage_id}: unknown transport {transport!r}; use one of {list(TRANSPORTS)}")


def _tcp_host(address: str) -> str | None:
    if not address.startswith("tcp://"):
        return None
    return address[len("tcp://"):].rpartition(":")[0].strip("[]")


def _set_options(sock: zmq.Socket, address: str) -> None:
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def bind_client_sockets(ctx: zmq.Context, stage_id: int, input_address: str, output_address: str,
                        curve: security.CurveKeys | None) -> tuple[zmq.Socket, zmq.Socket]:
    """The client's ROUTER (requests out) and PULL (responses in), bound."""
    host = _tcp_host(input_address)
    if curve is None and host is not None and not is_loopback(host):
        logger.warning("stage %d listens on %s without CURVE: anyone who reaches it can submit requests "
                       "and inject outputs (set runtime.security.curve)", stage_id, host)
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, MAX_READY_BYTES)
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    for sock, address in ((router, input_address), (pull, output_address)):
        _set_options(sock, address)
        if curve is not None:
            security.make_server(sock, curve)
        sock.bind(address)
    return router, pull


def open_stage_socket(ctx: zmq.Context, kind: int, address: str,
                      curve: security.StageCurveKeys | None) -> zmq.Socket:
    """A stage's DEALER or PUSH, set up (CURVE client if keyed) but not yet connected."""
    sock = ctx.socket(kind)
    _set_options(sock, address)
    if curve is not None:
        security.make_client(sock, curve)
    return sock


async def recv_frames(sock: zmq.asyncio.Socket, copy: bool = True) -> list:
    """``recv_multipart`` on an asyncio socket, retried when it reports EAGAIN.

    With CURVE and ZAP, libzmq queues a credential message ahead of a
    connection's first message; it makes the socket report POLLIN, but a
    read skips it and finds nothing. pyzmq then fails the pending recv with
    ``zmq.Again``, which would end a reader loop (and leave its waiters hanging).
    The skipped credential is consumed by that read, so this does not spin.
    """
    while True:
        try:
            return await sock.recv_multipart(copy=copy)
        except zmq.Again:
            continue
