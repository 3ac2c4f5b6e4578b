"""The talker's rows of requests fed in parts (both Qwen-Omni families under async_chunk).

A talker that starts on the thinker's first reply token gets the reply's rows as the thinker
writes them (``thinker2talker``'s ``starts_on_states``). Each family's ``TalkerRequests`` turns a
part into its model's ``reply_rows``; this keeps what each request has been given, whether its
reply is whole (``reply_final``, read by the model), and replaces its inputs file, whole, with the
rows known before the talker runs on them (a worker re-reading it sees the old rows or the new,
never a half-written file).
"""

from __future__ import annotations

import os

import torch


def reply_whole(inputs: dict[str, torch.Tensor]) -> bool:
    """A request's inputs hold all its reply rows (one fed in parts has ``reply_final`` 0 until then)."""
    return "reply_final" not in inputs or bool(inputs["reply_final"][0])


class ReplyParts:
    """Requests fed in parts: their inputs-file tensors so far, and which files lack rows."""

    def __init__(self) -> None:
        self._rows: dict[str, dict[str, torch.Tensor]] = {}
        self._stale: set[str] = set()

    def open(self, request_id: str, rows: dict[str, torch.Tensor]) -> int:
        """A request's first part (its reply not whole yet); the reply rows it holds."""
        rows["reply_final"] = torch.tensor([0])
        self._rows[request_id] = rows
        return rows["reply_rows"].shape[0]

    def width(self, request_id: str) -> int | None:
        """The width of the request's reply rows; None where it is not fed in parts (or has ended)."""
        rows = self._rows.get(request_id)
        return None if rows is None else rows["reply_rows"].shape[1]

    def append(self, request_id: str, reply_rows: torch.Tensor, last: bool) -> int | None:
        """The next reply rows; the rows now known (None once the reply is whole). The file is
        rewritten at ``write``, when the talker needs them."""
        rows = self._rows[request_id]
        rows["reply_rows"] = torch.cat([rows["reply_rows"], reply_rows.to(rows["reply_rows"].dtype)])
        if last:
            rows["reply_final"] = torch.tensor([1])
        self._stale.add(request_id)
        return None if last else rows["reply_rows"].shape[0]

    def write(self, request_id: str, path: str | None) -> None:
        """The request's inputs file at ``path`` with every row known, if it lacks any."""
        if request_id not in self._stale or path is None:
            return
        from safetensors.torch import save_file

        self._stale.discard(request_id)
        save_file(self._rows[request_id], f"{path}.part")
        os.replace(f"{path}.part", path)

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)
        self._stale.discard(request_id)
