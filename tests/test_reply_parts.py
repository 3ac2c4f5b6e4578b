"""A talker fed the thinker's reply in parts does work in proportion to each part, not to the answer.

The stage appends a part's rows beside the request's inputs file (``ReplyParts``), the worker's model
reads only the rows it has not read and transforms each once (``ReplyRows``), and what it made of
them outlives the request's re-entries into vLLM's batch (``RequestTap.KEPT_MEMO``) until the stage
removes the request's files. The end-to-end equality of the talkers fed in parts with transformers is
in the families' tests (``test_qwen2_5_omni``, ``test_qwen3_omni_moe``).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_engine.models.reply_parts import ReplyParts, ReplyRows, reply_files


def open_request(folder, reply: torch.Tensor, first: int = 1) -> tuple[ReplyParts, str, dict]:
    """A request opened with the reply's first ``first`` rows, as a talker stage opens one."""
    parts, path = ReplyParts(), str(folder / "inputs")
    rows = {"user_rows": torch.zeros(3, reply.shape[1], dtype=reply.dtype), "reply_rows": reply[:first].clone()}
    assert parts.open("r", rows) == first
    save_file(rows, path)
    return parts, path, load_file(path)


def test_each_part_is_written_once_and_read_once(tmp_path):
    reply = torch.randn(40, 16)
    parts, path, inputs = open_request(tmp_path, reply)
    inputs_stat = os.stat(path)
    seen: list[int] = []
    rows = ReplyRows(inputs, path, lambda new: (seen.append(new.shape[0]), new * 2)[1])
    for k in range(1, 40, 3):  # parts of 3 rows (the last of 3 too: 39 = 1 + 13 * 3)
        known = parts.append("r", reply[k:k + 3], last=k + 3 >= 40)
        assert known == (None if k + 3 >= 40 else k + 3)
        parts.write("r", path)
        rows.more()
        assert rows.count == min(k + 3, 40)
        rows.more()  # nothing new: nothing read, nothing transformed
    assert seen == [1] + [3] * 13, "a row was transformed more than once"
    assert rows.whole
    torch.testing.assert_close(rows.rows, reply * 2, rtol=0, atol=0)
    # the inputs file was written once, at the request's start
    assert os.stat(path).st_mtime_ns == inputs_stat.st_mtime_ns and os.stat(path).st_ino == inputs_stat.st_ino
    rows_path, end_path = reply_files(path)
    assert os.path.getsize(rows_path) == 39 * 16 * 4 and os.path.exists(end_path)


def test_the_reply_is_whole_only_after_its_last_part_and_its_rows(tmp_path):
    reply = torch.randn(6, 8)
    parts, path, inputs = open_request(tmp_path, reply, first=2)
    rows = ReplyRows(inputs, path)
    assert not rows.whole
    parts.append("r", reply[2:4], last=False)
    assert not os.path.exists(reply_files(path)[0]), "rows written before the talker needs them"
    parts.write("r", path)
    rows.more()
    assert (rows.count, rows.whole) == (4, False)
    assert parts.append("r", reply[4:], last=True) is None
    rows.more()  # (not written yet: the stage writes before the chunk that reads them)
    assert (rows.count, rows.whole) == (4, False)
    parts.write("r", path)
    rows.more()
    assert (rows.count, rows.whole) == (6, True)
    torch.testing.assert_close(rows.rows, reply, rtol=0, atol=0)


def test_bfloat16_rows_travel_bit_for_bit(tmp_path):
    reply = torch.randn(5, 8).to(torch.bfloat16)
    parts, path, inputs = open_request(tmp_path, reply)
    rows = ReplyRows(inputs, path)
    parts.append("r", reply[1:], last=True)
    parts.write("r", path)
    rows.more()
    assert rows.rows.dtype == torch.bfloat16 and torch.equal(rows.rows, reply)


def test_past_the_reply_come_the_tail_rows_the_last_for_ever(tmp_path):
    reply = torch.arange(12.0).view(3, 4)
    rows = ReplyRows({"reply_rows": reply}, None)  # (a whole reply: no parts)
    tail = -torch.ones(2, 4) * torch.tensor([[1.0], [2.0]])
    got = rows.gather(torch.tensor([0, 2, 3, 4, 9]), tail)
    torch.testing.assert_close(got, torch.stack([reply[0], reply[2], tail[0], tail[1], tail[1]]))
    assert torch.equal(tail, -torch.ones(2, 4) * torch.tensor([[1.0], [2.0]])), "the tail was written to"


@pytest.fixture(scope="module")
def tap():
    from omni_engine.models.request_tap import RequestTap

    return RequestTap(None, torch.device("cpu"), False)


def live(path: str) -> SimpleNamespace:
    from omni_engine.models.request_tap import INPUTS_PATH_KEY, OUTPUTS_PATH_KEY

    return SimpleNamespace(params=SimpleNamespace(extra_args={INPUTS_PATH_KEY: path, OUTPUTS_PATH_KEY: f"{path}.codes"}))


def enter(tap, path: str) -> SimpleNamespace:
    request = live(path)
    request.state = tap.new_state(request)
    return request


def test_what_a_model_made_outlives_a_re_entry_and_goes_when_the_request_ends(tap, tmp_path):
    path = str(tmp_path / "inputs")
    save_file({"reply_rows": torch.ones(2, 4), "reply_final": torch.tensor([0])}, path)
    first = enter(tap, path)
    made = first.state.memo["reply"] = ReplyRows(first.state.inputs, path)
    first.state.memo["scratch"] = object()  # (not in KEPT_MEMO)
    tap.release(first)
    os.replace(path, f"{path}.moved")  # a re-entry must not read the inputs file again
    again = enter(tap, path)
    assert again.state.memo.get("reply") is made and "scratch" not in again.state.memo
    assert again.state.inputs["reply_rows"].shape == (2, 4)
    os.replace(f"{path}.moved", path)
    tap.release(again)
    assert path in tap.kept
    # the request has ended (the stage removed its files): its memo goes at a later release
    os.unlink(path)
    other = str(tmp_path / "other")
    save_file({"reply_rows": torch.ones(1, 4)}, other)
    request = enter(tap, other)
    assert request.state.inputs
    tap.release(request)
    assert path not in tap.kept and other in tap.kept
