"""What a mixing teacher and its theta stage send each other (msgpack; rows as a raw frame)."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import zmq

# The key in a theta scoring request's extra_args: where its row goes and for which step.
CAPTURE_KEY = "omni_theta_capture"


class ScoreItem(msgspec.Struct, array_like=True):
    """One request's tokens since its last step. A prompt (text or chat messages as JSON)
    comes with a request's first step, and after a preemption: theta then starts it anew."""

    request_id: str
    new_tokens: list[int]
    theta_prompt: str | None = None
    theta_messages: str | None = None


class ScoreBatch(msgspec.Struct, tag=True, array_like=True):
    """One teacher step's requests for one theta replica; rows go to ``reply``."""

    step: int
    reply: str
    items: list[ScoreItem]
    sent_at: float = 0.0  # time.time() at the teacher: the transport's share is measured
    replica: int = 0  # which of the teacher's theta replicas this went to (echoed in ThetaRows)


class ReleaseRequests(msgspec.Struct, tag=True, array_like=True):
    """These requests left the teacher: theta forgets their tokens."""

    request_ids: list[str]


class ThetaRows(msgspec.Struct, array_like=True):
    """Theta's log-probabilities for ``request_ids`` (the rows of the frame that follows, float32
    [n, vocab]) at teacher step ``step``; ``errors``: requests theta could not score, and why."""

    step: int
    request_ids: list[str]
    vocab: int
    errors: dict[str, str] = {}
    # The theta prompt's token ids of requests that started at this step (for the α history).
    prompts: dict[str, list[int]] = {}
    # Seconds the batch took to reach theta, and time.time() when these rows left theta's engine.
    outbound_s: float = 0.0
    sent_at: float = 0.0
    replica: int = 0


TO_THETA = msgspec.msgpack.Decoder(ScoreBatch | ReleaseRequests)
ROWS = msgspec.msgpack.Decoder(ThetaRows)
encode = msgspec.msgpack.encode


def rows_frames(step: int, request_ids: list[str], rows: np.ndarray, errors: dict[str, str] | None = None,
                prompts: dict[str, list[int]] | None = None, outbound_s: float = 0.0, replica: int = 0) -> list:
    header = ThetaRows(step, request_ids, int(rows.shape[-1]) if rows.size else 0, errors or {}, prompts or {},
                       outbound_s, time.time(), replica)
    return [encode(header), np.ascontiguousarray(rows, dtype=np.float32)]


def read_rows(frames: list) -> tuple[ThetaRows, np.ndarray]:
    header = ROWS.decode(frames[0])
    rows = np.frombuffer(frames[1], dtype=np.float32)
    return header, rows.reshape(len(header.request_ids), header.vocab) if header.request_ids else rows


class PushSockets:
    """PUSH sockets by address, made on first use, never lingering at close: every sender
    of mixing (teacher to theta, theta's scorer and engine core to a teacher) uses these and
    sends with NOBLOCK, so a peer that is gone never holds the sender up."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}

    def get(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._sockets[address] = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
        return sock

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()
