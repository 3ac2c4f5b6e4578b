"""Who may use a transfer queue: a bearer key over HTTP, CURVE over RPC, and no open queue
on a public address by accident.

What the queue holds decides what a model learns, and in an RL cluster the queue
is what crosses hosts: anyone who can write may poison training with rewards of
their choosing, anyone who can read may starve it. So:

* HTTP: with an API key (``--api-key`` or ``$OMNI_ENGINE_TRANSFER_QUEUE_API_KEY``,
  as ``vllm serve`` reads ``VLLM_API_KEY``) every route but ``/health`` needs
  ``Authorization: Bearer <key>`` (``/metrics`` too, unless made public); the
  key is compared in constant time and never logged or shown.
* RPC: CURVE with the engine's own keys and files (``stage_engine.security``):
  the server's keypair, and the client public keys admitted (a shared client
  keypair for simple setups, or one public key file per client). A client
  without an admitted key fails the handshake: it can neither send nor read.
  Refusals are logged with the peer's address, at most once a minute per peer.
* Binding either API to a non-loopback address without its protection is
  refused at start, unless ``--insecure`` says it is meant (then it warns).
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from omni_engine.stage_engine.security import (
    ZAP_DOMAIN,
    CurveKeys,
    KeyFileError,
    KeyPair,
    StageCurveKeys,
    load_public_key,
    make_client,
    make_server,
)
from omni_engine.stage_engine.stage_sockets import is_loopback

logger = logging.getLogger(__name__)

API_KEY_ENV = "OMNI_ENGINE_TRANSFER_QUEUE_API_KEY"
# Routes that answer without the key: a load balancer's health check carries none.
OPEN_PATHS = frozenset({"/health"})
# A refused peer is logged at most this often (a scanner must not flood the log).
REFUSAL_LOG_INTERVAL_S = 60.0


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


@dataclass(frozen=True)
class QueueSecurity:
    """How a transfer queue server protects its two APIs."""

    api_key: str | None = field(default=None, repr=False)
    curve: CurveKeys | None = None
    public_metrics: bool = False
    insecure: bool = False

    @classmethod
    def from_files(cls, api_key: str | None = None, server_key: str | None = None, client_key: str | None = None,
                   allowed_keys: tuple[str, ...] = (), public_metrics: bool = False,
                   insecure: bool = False) -> QueueSecurity:
        """Keys from ``zmq.auth.create_certificates`` files, as the engine's ``runtime.security``:
        ``server_key`` the server's secret file; ``client_key`` a client keypair every client
        may share (its public key admitted); ``allowed_keys`` more clients' public key files.
        Raises ``KeyFileError`` naming the file."""
        curve = None
        if server_key is not None:
            server = KeyPair.load(server_key)
            client = KeyPair.load(client_key) if client_key is not None else None
            allowed = {load_public_key(p) for p in allowed_keys} | ({client.public} if client else set())
            if not allowed:
                raise KeyFileError("CURVE on the RPC API admits no client: give a client key file (shared by "
                                   "the clients) and/or the public key files of the clients to admit")
            curve = CurveKeys(server, client, frozenset(allowed), fixed_client=client is not None)
        elif client_key is not None or allowed_keys:
            raise KeyFileError("client keys are given but no server key: CURVE needs the server's key file")
        return cls(api_key=api_key, curve=curve, public_metrics=public_metrics, insecure=insecure)

    def open_paths(self) -> frozenset[str]:
        return OPEN_PATHS | ({"/metrics"} if self.public_metrics else frozenset())

    def exposure_problems(self, host: str, rpc_address: str | None) -> list[str]:
        """What would be reachable by anyone on the network, unprotected (empty: nothing)."""
        problems = []
        if self.api_key is None and not is_loopback(host):
            problems.append(f"the HTTP API would listen on {host} with no API key: anyone who reaches it can "
                            f"write, read and reset the queue; give --api-key (or set {API_KEY_ENV})")
        rpc_host = _tcp_host(rpc_address)
        if self.curve is None and rpc_host is not None and not is_loopback(rpc_host):
            problems.append(f"the RPC API would listen on {rpc_address} without CURVE: give --curve-server-key "
                            "and --curve-client-key (or --curve-allowed-key), made with "
                            "zmq.auth.create_certificates")
        return problems


def _tcp_host(address: str | None) -> str | None:
    if address is None or not address.startswith("tcp://"):
        return None  # ipc:// and inproc:// do not leave the host
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host or "*"


def authorized(header: bytes | None, api_key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <api_key>`` (constant-time compare)."""
    expected = b"Bearer " + api_key.encode()
    return header is not None and hmac.compare_digest(header, expected)


# ------------------------------------------------------------------ RPC (CURVE)


class _RefusalLog:
    """Logs refused CURVE peers by address, at most once per ``interval`` per peer."""

    def __init__(self, interval: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def refused(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(address, -self.interval) < self.interval:
                self._suppressed[address] = self._suppressed.get(address, 0) + 1
                return
            self._last[address] = now
            more = self._suppressed.pop(address, 0)
        logger.warning("transfer queue rpc: refused a client from %s: its CURVE key is not admitted%s", address,
                       f" ({more} more refusals since the last report)" if more else "")


class _QueueAuthenticator(ThreadAuthenticator):
    """ZAP in a thread: admits the allowed client keys, logs refusals with the peer's address."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset[bytes]) -> None:
        super().__init__(ctx)
        self.allowed_keys = allowed
        self.refusals = _RefusalLog()
        self._peer = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The address is in the request, the key check below sees only the key.
        self._peer = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed_keys:
            return True
        self.refusals.refused(self._peer)
        return False


def secure_rpc_server(ctx: zmq.Context, sock: zmq.Socket, keys: CurveKeys) -> ThreadAuthenticator:
    """Make ``sock`` (not yet bound) a CURVE server admitting ``keys.allowed_clients``; the
    returned authenticator must be stopped after the socket is closed."""
    auth = _QueueAuthenticator(ctx, keys.allowed_clients)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=auth)
    make_server(sock, keys)
    return auth


def client_curve_keys(server_key: str | Path, client_key: str | Path) -> StageCurveKeys:
    """A queue client's CURVE keys: the server's public key (its ``.key`` file, or the secret
    file) and this client's keypair (a ``.key_secret`` file)."""
    return StageCurveKeys(KeyPair.load(client_key), load_public_key(server_key))


def secure_rpc_client(sock: zmq.Socket, keys: StageCurveKeys | None) -> None:
    if keys is not None:
        make_client(sock, keys)


__all__ = [
    "API_KEY_ENV",
    "OPEN_PATHS",
    "QueueSecurity",
    "api_key_from_env",
    "authorized",
    "client_curve_keys",
    "load_public_key",
    "secure_rpc_client",
    "secure_rpc_server",
]
