"""The talker's rows of requests fed in parts (both Qwen-Omni families under async_chunk).

A talker that starts on the thinker's first reply token gets the reply's rows as the thinker
writes them (``thinker2talker``'s ``starts_on_states``). Each family's ``TalkerRequests`` turns a
part into its model's ``reply_rows``. The request's inputs file (safetensors, written once) holds
the rows known when it opened and ``reply_final`` 0; every later row is appended to a row file
beside it (``<inputs>.reply``, float rows of the same width and type, row ``j`` the reply's row
``opened + j``), and ``<inputs>.reply.end`` appears once the reply is whole. Both sides then do
work in proportion to the new rows only: the stage writes a part's rows once (``ReplyParts``), the
model reads them once and keeps them, transformed, in a buffer that grows in place (``ReplyRows``).
(Rewriting the whole file at every part, and re-reading and re-projecting it at the next frame, was
O(answer) a frame: O(answer^2) a request.)

Ordering: the stage writes a part's rows before the chunk that may read them is handed to vLLM, and
the end marker after the last rows, so a worker that sees the marker finds every row; a worker only
reads rows its chunk is allowed to read, which were written before that chunk began.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

REPLY_SUFFIX = ".reply"
END_SUFFIX = ".reply.end"


def reply_files(inputs_path: str) -> tuple[str, str]:
    """The files a request fed in parts adds beside its inputs file (to remove when it ends)."""
    return inputs_path + REPLY_SUFFIX, inputs_path + END_SUFFIX


def reply_whole(inputs: dict[str, torch.Tensor]) -> bool:
    """A request's inputs file holds all its reply rows (one fed in parts has ``reply_final`` 0)."""
    return "reply_final" not in inputs or bool(inputs["reply_final"][0])


@dataclass
class _Feed:
    """One request's reply rows on the stage's side: rows written, and those not yet."""

    dtype: torch.dtype
    width: int
    opened: int  # rows in the inputs file
    written: int  # rows in the inputs file and the row file
    known: int  # rows given so far
    pending: list[torch.Tensor] = field(default_factory=list)
    last: bool = False
    ended: bool = False  # the end marker is written


class ReplyParts:
    """Requests fed in parts (the stage's side): their reply rows, appended as parts come."""

    def __init__(self) -> None:
        self._feeds: dict[str, _Feed] = {}

    def open(self, request_id: str, rows: dict[str, torch.Tensor]) -> int:
        """A request's first part (``rows``: its inputs file's tensors, marked not whole here); the
        reply rows it holds."""
        rows["reply_final"] = torch.tensor([0])
        reply = rows["reply_rows"]
        self._feeds[request_id] = _Feed(reply.dtype, reply.shape[1], *[reply.shape[0]] * 3)
        return reply.shape[0]

    def width(self, request_id: str) -> int | None:
        """The width of the request's reply rows; None where it is not fed in parts (or has ended)."""
        feed = self._feeds.get(request_id)
        return None if feed is None else feed.width

    def append(self, request_id: str, reply_rows: torch.Tensor, last: bool) -> int | None:
        """The next reply rows; the rows now known (None once the reply is whole). They are written
        at ``write``, when the talker needs them."""
        feed = self._feeds[request_id]
        if reply_rows.shape[0]:
            feed.pending.append(reply_rows.to(feed.dtype))
            feed.known += reply_rows.shape[0]
        feed.last = feed.last or last
        return None if feed.last else feed.known

    def write(self, request_id: str, inputs_path: str | None) -> None:
        """The rows given since the last write, appended to the request's row file beside
        ``inputs_path``; then, if the reply is whole, its end marker."""
        feed = self._feeds.get(request_id)
        if feed is None or inputs_path is None:
            return
        rows_path, end_path = reply_files(inputs_path)
        if feed.pending:
            rows = torch.cat(feed.pending).cpu().contiguous()
            row_bytes = feed.width * rows.element_size()
            fd = os.open(rows_path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # (raw bytes: any float type, bfloat16 included)
                os.pwrite(fd, rows.view(torch.uint8).numpy().tobytes(), (feed.written - feed.opened) * row_bytes)
            finally:
                os.close(fd)
            feed.written += rows.shape[0]
            feed.pending.clear()
        if feed.last and not feed.ended:
            with open(end_path, "wb"):
                pass
            feed.ended = True

    def drop(self, request_id: str) -> None:
        self._feeds.pop(request_id, None)


class ReplyRows:
    """One request's reply rows in the worker (a model of ours reads them): those its inputs file
    brought, then those appended to its row file, each transformed once (``transform``: e.g. a
    projection to the talker's width) into a buffer that doubles when full, so a frame that needs a
    new row costs the new rows, not the reply so far."""

    def __init__(self, inputs: dict[str, torch.Tensor], inputs_path: str | None,
                 transform: Callable[[torch.Tensor], torch.Tensor] = lambda rows: rows) -> None:
        first = inputs["reply_rows"]
        self.transform = transform
        self.source_dtype, self.source_width = first.dtype, first.shape[1]
        self.opened = first.shape[0]
        self.whole = reply_whole(inputs)
        self.paths = reply_files(inputs_path) if isinstance(inputs_path, str) and not self.whole else None
        rows = transform(first)
        self.buffer = rows.new_empty((max(2 * rows.shape[0], 16), rows.shape[1]))
        self.buffer[:rows.shape[0]] = rows
        self.count = rows.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer[:self.count]

    def more(self) -> None:
        """Take the rows appended since the last call, and whether the reply is now whole (a reply
        not whole yet: the stage has written the rows this chunk may read)."""
        if self.whole or self.paths is None:
            return
        rows_path, end_path = self.paths
        whole = os.path.exists(end_path)  # (before the rows: the marker follows the last of them)
        row_bytes = self.source_width * self.source_dtype.itemsize
        try:
            with open(rows_path, "rb") as f:
                f.seek((self.count - self.opened) * row_bytes)
                data = f.read()
        except FileNotFoundError:
            data = b""
        new = len(data) // row_bytes
        if new:
            source = torch.frombuffer(bytearray(data[:new * row_bytes]), dtype=self.source_dtype)
            self.append(self.transform(source.view(new, self.source_width)))
        self.whole = whole

    def append(self, rows: torch.Tensor) -> None:
        end = self.count + rows.shape[0]
        if end > self.buffer.shape[0]:
            grown = self.buffer.new_empty((max(2 * self.buffer.shape[0], end), self.buffer.shape[1]))
            grown[:self.count] = self.rows
            self.buffer = grown
        self.buffer[self.count:end] = rows
        self.count = end

    def gather(self, index: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """``row`` for each of ``index`` (``[n]``), as ``[n, width]``."""
        out = tail[(index - self.count).clamp(0, tail.shape[0] - 1)]
        inside = index < self.count
        if bool(inside.any()):
            out[inside] = self.buffer[index[inside]]
        return out
