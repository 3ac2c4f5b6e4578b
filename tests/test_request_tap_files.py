"""The files a worker writes a request's rows to: the stage creates and removes them, the worker only
opens them, so a write that races the request's end (an abort while its step runs) leaves nothing
behind in ``/dev/shm``; and a request's files are closed when it leaves the batch."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from omni_engine.models.request_tap import (INPUTS_PATH_KEY, OUTPUTS_PATH_KEY, STATE_KINDS, RequestTap, RowFile,
                                            StateFile, create_files)


@pytest.fixture(scope="module")
def tap():
    return RequestTap(None, torch.device("cpu"), False)


def enter(tap, path: str) -> SimpleNamespace:
    request = SimpleNamespace(params=SimpleNamespace(
        extra_args={INPUTS_PATH_KEY: path, OUTPUTS_PATH_KEY: f"{path}.codes"}))
    request.state = tap.new_state(request)
    return request


def test_a_row_file_removed_by_the_stage_is_not_made_again_by_a_late_write(tmp_path):
    path = str(tmp_path / "codes")
    create_files(path)
    early, late = RowFile(path), RowFile(path)
    early.write(1, torch.arange(4))
    assert os.path.getsize(path) == 2 * 4 * 8
    os.unlink(path)  # the request ended: the stage removed its files
    early.write(2, torch.arange(4))  # (an open file: written to the removed inode, freed on close)
    late.write(0, torch.arange(4))  # the first write of a step that ran on past the end
    early.close()
    assert not os.path.exists(path) and late.failed and late.fd is None


def test_state_files_removed_by_the_stage_are_not_made_again_by_a_late_write(tmp_path):
    path = str(tmp_path / "states")
    create_files(*(f"{path}.{kind}" for kind in STATE_KINDS))
    os.unlink(f"{path}.hidden")  # (one of three gone: none is opened)
    states = StateFile(path)
    states.write(0, torch.ones(2, 8), torch.ones(2, 8), torch.ones(2, 3))
    assert states.failed and states.fds == ()
    assert sorted(os.listdir(tmp_path)) == ["states.embeds", "states.positions"]
    assert all(os.path.getsize(tmp_path / name) == 0 for name in os.listdir(tmp_path))


def test_the_stage_s_state_files_are_made_when_it_names_them_and_gone_when_it_discards_them(tmp_path, monkeypatch):
    from omni_engine.connectors import shm
    from omni_engine.engines.hidden_states import StateFiles
    from omni_engine.models.request_tap import STATES_PATH_KEY

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    files = StateFiles(0, 8)
    params = files.tag(SimpleNamespace(extra_args=None), "r")
    path = params.extra_args[STATES_PATH_KEY]
    assert sorted(os.listdir(tmp_path)) == sorted(f"{os.path.basename(path)}.{kind}" for kind in STATE_KINDS)
    files.discard("r")
    StateFile(path).write(0, torch.ones(1, 8), torch.ones(1, 8), torch.ones(1, 3))  # a late write
    assert os.listdir(tmp_path) == []


def test_a_request_s_row_files_are_closed_when_it_leaves_the_batch(tap, tmp_path):
    path = str(tmp_path / "inputs")
    create_files(f"{path}.codes", f"{path}.codes.hidden")
    request = enter(tap, path)
    request.state.outputs.write(0, torch.zeros(4))
    request.state.side_file("hidden").write(0, torch.zeros(4))
    fds = [request.state.outputs.fd, request.state.side_file("hidden").fd]
    assert all(fd is not None for fd in fds)
    tap.release(request)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
