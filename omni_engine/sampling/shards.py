"""The output directory: shards that appear only when complete, a journal per shard in progress.

``shard_00000.jsonl`` is written to a temporary name, fsynced and renamed, so
a shard file is complete or absent. While a shard runs, every finished
request (one item, one round: its responses or its error) is appended to
``shard_00000.journal``; after a crash or ``kill -9`` the rerun replays it, so
only the requests in flight at the kill are sent again. ``manifest.json``
records the run's settings and input: a rerun with other settings into the
same directory is refused, naming what changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import msgspec

from omni_engine.sampling.items import ItemResult

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


class ResumeMismatch(ValueError):
    """The output directory holds a run with other settings or input."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.jsonl"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` entirely or keeps what it had, whatever happens meanwhile."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _differences(old: Any, new: Any, path: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [d for key in sorted(set(old) | set(new), key=str)
                for d in _differences(old.get(key), new.get(key), f"{path}.{key}" if path else str(key))]
    return [] if old == new else [f"{path or 'settings'} (was {old!r}, now {new!r})"]


def _shard_entry(path: Path, lines: list[dict[str, Any]]) -> dict[str, Any]:
    """A done shard as the manifest lists it."""
    return {"file": path.name, "items": len(lines), "rollouts": sum(len(line["rollouts"]) for line in lines)}


class ShardJournal:
    """Append-only record of one shard's finished requests (JSON lines of ``ItemResult``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def replay(self) -> list[ItemResult]:
        """The results recorded so far. A torn last line (a kill mid-write) is cut off."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        results, good = [], 0
        decoder = msgspec.json.Decoder(ItemResult)
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                results.append(decoder.decode(line))
            except msgspec.DecodeError:
                break
            good += len(line)
        if good < len(data):
            os.truncate(self.path, good)
        return results

    def append(self, result: ItemResult) -> None:
        """One ``write`` per record: a kill leaves whole lines and at most one torn tail."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, msgspec.json.encode(result) + b"\n")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class OutputDir:
    """The run's output directory; ``open`` creates it or checks that it holds this same run."""

    def __init__(self, path: Path, settings: dict[str, Any], input_path: Path, num_items: int) -> None:
        self.path = path
        self.settings = json.loads(json.dumps(settings))  # as it reads back from the manifest
        self.input = {"sha256": file_sha256(input_path), "items": num_items}
        self.shards: dict[str, dict[str, Any]] = {}
        # Names this run wherever its rollouts go (the transfer queue's uids); kept by a resume.
        self.run_id = uuid.uuid4().hex[:16]

    def open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        manifest_path = self.path / MANIFEST
        if manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
            changed = _differences({"settings": manifest.get("settings"), "input": manifest.get("input")},
                                   {"settings": self.settings, "input": self.input})
            if changed and not self._has_progress():
                # A run that failed before sampling anything (say, a wrong model name): nothing to protect.
                manifest, changed = {}, []
                self._write_manifest(complete=False)
            if changed:
                raise ResumeMismatch(f"output.dir {self.path} holds a run with other settings or input: "
                                     f"{'; '.join(changed)}. Use a new output.dir, or remove this one to start over")
            self.shards = manifest.get("shards", {})
            self.run_id = manifest.get("run_id") or self.run_id
            if "run_id" not in manifest:
                self._write_manifest(complete=False)
        else:
            self._write_manifest(complete=False)
        for stale in self.path.glob("*.tmp"):
            stale.unlink()
        # A kill between a shard's rename and the manifest's update: the shard is done all the same.
        for path in sorted(self.path.glob("shard_*.jsonl")):
            index = str(int(path.stem.removeprefix("shard_")))
            if index not in self.shards:
                lines = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
                self.shards[index] = _shard_entry(path, lines)
            self.journal(int(index)).remove()

    def _has_progress(self) -> bool:
        return any(self.path.glob("shard_*.jsonl")) or any(
            p.stat().st_size > 0 for p in self.path.glob("shard_*.journal"))

    def shard_done(self, index: int) -> bool:
        return (self.path / shard_name(index)).exists()

    def journal(self, index: int) -> ShardJournal:
        return ShardJournal(self.path / f"shard_{index:05d}.journal")

    def write_shard(self, index: int, lines: list[dict[str, Any]], journal: ShardJournal) -> Path:
        """Publish a complete shard (atomically), record it in the manifest, drop its journal."""
        path = self.path / shard_name(index)
        write_atomic(path, b"".join(msgspec.json.encode(line) + b"\n" for line in lines))
        self.shards[str(index)] = _shard_entry(path, lines)
        self._write_manifest(complete=False)
        journal.remove()
        return path

    def finish(self, summary: dict[str, Any]) -> None:
        self._write_manifest(complete=True, summary=summary)

    def _write_manifest(self, *, complete: bool, summary: dict[str, Any] | None = None) -> None:
        manifest = {"version": MANIFEST_VERSION, "run_id": self.run_id, "settings": self.settings,
                    "input": self.input, "shards": self.shards, "complete": complete}
        if summary is not None:
            manifest["summary"] = summary
        write_atomic(self.path / MANIFEST, json.dumps(manifest, indent=2).encode())
