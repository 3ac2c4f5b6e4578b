"""Qwen2.5-Omni's speakers (``spk_dict.pt``): each a talker bos token, a condition vector and a
reference mel for token2wav. Every stage that speaks reads them from the checkpoint."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

SPEAKERS_FILE = "spk_dict.pt"


@lru_cache(maxsize=8)
def load_speakers(model_dir: str | Path) -> dict[str, dict[str, Any]]:
    """``{name: {"bos_token": int, "cond": tensor, "ref_mel": tensor}}`` of a checkpoint; a
    checkpoint without the file is refused by name (transformers refuses it too)."""
    import torch

    path = Path(model_dir) / SPEAKERS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir}: no {SPEAKERS_FILE}; Qwen2.5-Omni's speakers (a talker bos "
                                "token, cond and ref_mel per voice) come from it")
    speakers = torch.load(path, weights_only=True, map_location="cpu")
    for name, speaker in speakers.items():
        missing = {"bos_token", "cond", "ref_mel"} - set(speaker)
        if missing:
            raise ValueError(f"{path}: speaker {name!r} lacks {sorted(missing)}")
    return speakers


def pick_voice(speakers: dict[str, dict[str, Any]], name: str) -> dict[str, Any]:
    """One speaker of ``load_speakers``' result; an unknown name lists the checkpoint's (the caller
    says where the name came from)."""
    if name not in speakers:
        raise ValueError(f"unknown voice {name!r}; this checkpoint's voices: {', '.join(sorted(speakers))}")
    return speakers[name]
