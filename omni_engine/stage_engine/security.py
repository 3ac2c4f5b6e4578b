"""ZMQ CURVE on stage sockets: keys, socket set-up, and who may connect.

Roles follow ZMQ's: the pipeline's client process binds ROUTER and PULL and is
the CURVE *server*; a stage process connects DEALER and PUSH and is a CURVE
*client*. CURVE alone only proves that a peer knows the server's public key,
which is no secret, so the binding side also runs a ZAP authenticator that
admits only the allowed client public keys: a peer without the stages' secret
key can neither submit requests nor inject outputs, and (since the client only
ever sends to the stage that completed the handshake) reads nothing either.

Keys stay in memory: loaded from certificate files named in the config
(``SecurityConfig.curve_keys``), or generated per run, and handed to a spawned stage inside its process spec (the
spawn pipe), never on a command line, in the environment or in a file.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "omni_engine"

_HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_MONITORS = itertools.count()  # names of handshake monitors' endpoints


def curve_available() -> bool:
    return bool(zmq.has("curve"))


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class KeyPair:
    """A CURVE keypair, z85-encoded as ZMQ takes it. The secret never shows in a repr."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)

    @classmethod
    def load(cls, path: str | Path) -> KeyPair:
        """Read a ``zmq.auth.create_certificates`` secret file (``*.key_secret``)."""
        path = Path(path)
        public, secret = _read_certificate(path)
        if not secret:
            raise KeyFileError(f"key file {path} has no secret key (the .key file holds only the public "
                               "key; name the .key_secret file)")
        if not _valid_z85_key(public) or not _valid_z85_key(secret):
            raise KeyFileError(f"key file {path} does not hold 40-character z85 CURVE keys")
        if path.stat().st_mode & 0o077:
            logger.warning("secret key file %s is readable by other users; chmod 600 it", path)
        return cls(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """The public key of a ZMQ certificate file (``.key``, or the ``.key_secret`` beside it)."""
    path = Path(path).expanduser()
    public, _secret = _read_certificate(path)
    if not _valid_z85_key(public):
        raise KeyFileError(f"key file {path} does not hold a 40-character z85 CURVE public key")
    return public


def _read_certificate(path: Path) -> tuple[bytes | None, bytes | None]:
    if not path.is_file():
        raise KeyFileError(f"key file {path} not found")
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"key file {path} is not a ZMQ certificate: {exc}") from None


def _valid_z85_key(key: bytes | None) -> bool:
    try:
        return key is not None and len(zmq.utils.z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True)
class StageCurveKeys:
    """What a stage process holds: its own keypair and the server's public key, no server secret."""

    keypair: KeyPair
    server_public: bytes


@dataclass(frozen=True)
class CurveKeys:
    """One pipeline's CURVE keys: the server's keypair, the stages' keypair, and who may connect."""

    server: KeyPair
    # None for a stage whose keypair was made where it runs (``admitting``): only its public key is known here.
    client: KeyPair | None
    # Client public keys the ZAP check admits; by default only the stages' own.
    allowed_clients: frozenset[bytes] = frozenset()
    # The stages' keypair came from a file (runtime.security.client_key): every
    # stage process uses it. Else each stage process gets a keypair of its own.
    fixed_client: bool = False

    def __post_init__(self) -> None:
        if not self.allowed_clients and self.client is not None:
            object.__setattr__(self, "allowed_clients", frozenset({self.client.public}))

    @classmethod
    def generate(cls) -> CurveKeys:
        """Ephemeral keys for one run (``curve: true`` without key files)."""
        return cls(KeyPair.generate(), KeyPair.generate())

    def for_stage(self) -> StageCurveKeys:
        if self.client is None:
            raise ValueError("these keys hold no stage keypair: the stage made its own")
        return StageCurveKeys(self.client, self.server.public)

    def admitting(self, stage_public: bytes) -> CurveKeys:
        """The keys for a stage that generated its keypair where it runs: the server's keypair,
        and only that stage's public key admitted (its secret never left its host)."""
        return CurveKeys(self.server, None, frozenset({stage_public}))

    def for_new_process(self) -> CurveKeys:
        """The keys for one more stage process: a fresh stage keypair unless it is fixed, so a
        process that was evicted (dead, replaced) holds a key nobody admits any more."""
        if self.fixed_client:
            return self
        return CurveKeys(self.server, KeyPair.generate())


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make a binding socket a CURVE server that asks ZAP about every client key."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server.secret
    sock.curve_publickey = keys.server.public
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket, keys: StageCurveKeys) -> None:
    """Make a connecting socket a CURVE client of the server with ``keys.server_public``."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.keypair.public
    sock.curve_secretkey = keys.keypair.secret


class _AllowedKeys:
    """ZAP credentials provider: admits exactly the allowed client public keys."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        logger.warning("refused a CURVE peer with an unknown client key (domain %s)", domain)
        return False


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Run ZAP for ``ctx`` in a thread of its own. Start it before binding: without a
    ZAP handler ZMQ admits any client that knows the server key."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(keys.allowed_clients))
    return auth


class CurveHandshakeError(RuntimeError):
    """A stage's CURVE handshake with its client failed: it cannot be served."""


def watch_handshake(sock: zmq.Socket) -> zmq.Socket:
    """A monitor of ``sock``'s handshakes; call before ``connect`` so no event is missed.

    The monitor's endpoint is named here: pyzmq's default names it after the socket's
    descriptor number, which a later socket reuses while libzmq may still hold the endpoint."""
    return sock.get_monitor_socket(_HANDSHAKE_EVENTS, addr=f"inproc://omni-handshake-{next(_MONITORS)}")


def handshake_ended(event: dict, address: str) -> bool:
    """Whether a monitor ``event`` ends the first handshake (True: it succeeded);
    ``CurveHandshakeError`` saying why it failed. A failure is final: a wrong key does
    not get right by retrying, and failing now gives a clear error instead of a
    startup timeout."""
    kind = event["event"]
    if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return True
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        raise CurveHandshakeError(
            f"CURVE: the client at {address} refused this stage's key (ZAP status {event['value']}); "
            "the stage's client key is not one the client allows")
    if kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        raise CurveHandshakeError(
            f"CURVE handshake with the client at {address} failed ({zmq.Event(kind).name}): "
            "the stage has the wrong server public key, or the client does not use CURVE")
    return False


def stop_watching_handshake(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)


def wait_for_handshake(sock: zmq.Socket, monitor: zmq.Socket, wake: zmq.Socket, address: str) -> None:
    """Block until the first handshake on ``sock`` ends (``handshake_ended``).

    Returns early, without consuming it, when ``wake`` becomes readable (shutdown).
    """
    poller = zmq.Poller()
    poller.register(monitor, zmq.POLLIN)
    poller.register(wake, zmq.POLLIN)
    try:
        while True:
            events = dict(poller.poll())
            if wake in events or handshake_ended(recv_monitor_message(monitor), address):
                return
    finally:
        stop_watching_handshake(sock, monitor)
