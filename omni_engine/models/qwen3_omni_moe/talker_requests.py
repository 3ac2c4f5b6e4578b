"""The talker stage's side of a Qwen3-Omni request: the thinker's states become the talker's inputs.

Runs in the talker's stage process (``engine_args.request_adapter``), before vLLM sees the request.
From what ``thinker2talker`` forwards (the thinker's prompt ids, each position's input embedding
and its accepted layer's hidden state) it writes, as transformers' ``generate`` selects them, one
safetensors file in ``/dev/shm`` that the worker's ``RequestTap`` reads when the request enters
the batch:

- ``user_rows`` ``[U, D]`` and ``user_multimodal`` ``[U]``: every user turn's positions (system and
  earlier assistant turns are left out), the hidden state at audio / image / video placeholders and
  the input embedding elsewhere (the model projects each with its own projection);
- ``assistant_rows`` ``[3, D]``: the embeddings of the closing ``<|im_start|>assistant\\n``;
- ``reply_rows`` ``[N - 1, D]``: the reply's tokens but the last (which is never spoken);
- ``speaker`` ``[1]``: the voice's codec id (``talker_config.speaker_id``).

The request vLLM runs is ``[codec pad] * (U + 9)``: placeholders the model replaces, whose id is
one the talker never samples, so vLLM's repetition penalty (which counts prompt ids) penalises only
generated codes, as transformers' does. The model writes each frame's codes to the request's row
file (``OUTPUTS_PATH_KEY``), from which outputs carry them as ``codes`` ``[G, frames]``. The voice is
``extra_args["voice"]`` (case-insensitive; default ``ethan``, transformers' default); an unknown
one is refused here, naming the voices there are.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omni_engine.connectors import shm
from omni_engine.models.reply_parts import ReplyParts, reply_files
from omni_engine.models.request_tap import INPUTS_PATH_KEY, OUTPUTS_PATH_KEY, create_files, read_rows

DEFAULT_VOICE = "ethan"  # transformers' default speaker; the config names them in lower case
# vLLM-Omni's words for it: the talker takes its rows by chat turn, which a raw prompt lacks.
COMPLETIONS_REFUSAL = ("Qwen3-Omni requires chat template structure for thinker-talker handoff. "
                       "Use /v1/chat/completions instead.")
PROMPT_FIELDS = ("thinker_prompt_token_ids", "input_embeds", "hidden_states")
ASSISTANT_ROWS = 9
# The model's second row file, beside its codes' (``<codes>.hidden``): per frame, the hidden state
# that made its first code (``vllm_talker.hidden_file``).
HIDDEN_SUFFIX = "hidden"


def voice_name(params: Any) -> str:
    return (getattr(params, "extra_args", None) or {}).get("voice") or DEFAULT_VOICE


def talker_rope(thinker_positions: torch.Tensor, user: torch.Tensor) -> dict[str, torch.Tensor]:
    """The talker's multimodal rope for its prompt, as transformers' talker ``get_rope_index`` places
    the user rows and the 9 assistant rows: each run of consecutive user rows keeps the thinker's
    layout (an image's tokens at their grid's T/H/W), shifted to start one past the previous run's
    largest position (the first at 0); the assistant rows, and every later row, one more each.
    ``rope_prompt`` ``[3, U + 9]``, ``rope_from`` ``[1]`` (the first decode row's position)."""
    positions = thinker_positions[:, :3].round().to(torch.int64)
    placed, following = [], 0
    runs = torch.tensor_split(user, (torch.diff(user) != 1).nonzero().flatten() + 1) if user.numel() else []
    for run in runs:
        rows = positions[run]
        rows = rows - rows[0] + following  # a run starts with <|im_start|>: its channels are equal
        placed.append(rows)
        following = int(rows.max()) + 1
    assistant = torch.arange(following, following + ASSISTANT_ROWS).unsqueeze(1).expand(-1, 3)
    prompt = torch.cat([*placed, assistant]) if placed else assistant
    return {"rope_prompt": prompt.T.contiguous(), "rope_from": torch.tensor([following + ASSISTANT_ROWS])}


class TalkerRequests:
    """Turns ``thinker2talker``'s prompts into the Qwen3-Omni talker's requests (one file each)."""

    def __init__(self, stage_id: int, model_dir: str) -> None:
        self.stage_id = stage_id
        config = json.loads((Path(model_dir) / "config.json").read_text())
        talker, thinker = config["talker_config"], config["thinker_config"]
        self.speakers: dict[str, int] = {name.lower(): int(i) for name, i in (talker.get("speaker_id") or {}).items()}
        if not self.speakers:
            raise ValueError(f"{model_dir}: talker_config.speaker_id names no voice")
        self.groups = int(talker["num_code_groups"])
        self.codec_pad = int(talker["codec_pad_id"])
        self.im_start = int(config.get("im_start_token_id", 151644))
        self.user = int(config.get("user_token_id", 872))
        self.assistant = int(config.get("assistant_token_id", 77091))
        self.placeholders = torch.tensor([thinker["audio_token_id"], thinker["image_token_id"],
                                          thinker["video_token_id"]])
        self.visual = torch.tensor([thinker["image_token_id"], thinker["video_token_id"]])
        self._prefix: str | None = None  # known at the first request: the stage's pool is set after start
        self._paths: dict[str, tuple[str, str]] = {}
        self._voices: dict[str, str] = {}
        self._streamed: dict[str, int] = {}  # frames a request's partial outputs have carried
        self.parts = ReplyParts()  # requests fed in parts
        self._counter = itertools.count()

    @property
    def prefix(self) -> str:
        if self._prefix is None:
            self._prefix = shm.stage_file_prefix("talker")
        return self._prefix

    def info(self) -> dict[str, Any]:
        """For the stage's READY info: the voices it speaks, and the route a server must refuse."""
        return {"voices": sorted(self.speakers), "default_voice": DEFAULT_VOICE,
                "refuses_endpoints": {"/v1/completions": COMPLETIONS_REFUSAL}}

    def speaker_of(self, params: Any, request_id: str) -> int:
        name = voice_name(params)
        if name.lower() not in self.speakers:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: unknown voice {name!r}; "
                             f"the voices are {', '.join(sorted(self.speakers))}")
        return self.speakers[name.lower()]

    def adapt(self, request_id: str, prompt: Any, params: Any) -> tuple[dict[str, Any], Any]:
        """vLLM's prompt and params for the request; its inputs file is written."""
        return self.start(request_id, self.request_rows(request_id, prompt, params), params)

    def adapt_parts(self, request_id: str, prompt: Any, params: Any) -> tuple[dict[str, Any], Any, int]:
        """As ``adapt``, for a request whose thinker is still writing (``thinker2talker`` under
        async_chunk): the reply rows known so far, and the frames the talker may make from them
        (frame ``f`` needs the reply's token ``f``: the prompt's last row holds the first, and the
        step that makes frame ``f`` reads token ``f``)."""
        rows = self.request_rows(request_id, prompt, params)
        known = self.parts.open(request_id, rows)
        vllm_prompt, params = self.start(request_id, rows, params)
        return vllm_prompt, params, known

    def extend(self, request_id: str, prompt: Any, last: bool) -> int | None:
        """The thinker's next rows (``input_embeds`` ``[n, D]``); the frames the talker may make now
        (None once the reply is whole: up to its stop code). Written when the talker needs them."""
        width = self.parts.width(request_id)
        if width is None:
            return None
        embeds = prompt.get("input_embeds") if isinstance(prompt, dict) else None
        if embeds is None or getattr(embeds, "ndim", 0) != 2 or embeds.shape[1] != width:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: a part of the thinker's states needs "
                             f"input_embeds [rows, {width}], got "
                             f"{None if embeds is None else tuple(getattr(embeds, 'shape', ()))}")
        return self.parts.append(request_id, torch.as_tensor(embeds), last)

    def write_inputs(self, request_id: str) -> None:
        """The reply rows given since the talker last ran, appended beside its inputs (``reply_parts``)."""
        paths = self._paths.get(request_id)
        self.parts.write(request_id, paths[0] if paths else None)

    def request_rows(self, request_id: str, prompt: Any, params: Any) -> dict[str, torch.Tensor]:
        """The inputs file's tensors for a ``thinker2talker`` prompt, the voice's speaker among them."""
        missing = [f for f in PROMPT_FIELDS if not isinstance(prompt, dict) or f not in prompt]
        if missing:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: a talker prompt needs "
                             f"{', '.join(missing)} (the thinker's states: its stage needs "
                             "engine_output_type: latent, and the edge custom_process_input_func thinker2talker)")
        speaker = self.speaker_of(params, request_id)
        rows = self.input_rows(request_id, torch.as_tensor(list(prompt["thinker_prompt_token_ids"])),
                               torch.as_tensor(prompt["input_embeds"]), torch.as_tensor(prompt["hidden_states"]),
                               prompt.get("thinker_positions"))
        return {**rows, "speaker": torch.tensor([speaker])}

    def start(self, request_id: str, rows: dict[str, torch.Tensor], params: Any) -> tuple[dict[str, Any], Any]:
        from safetensors.torch import save_file

        base = str(shm.SHM_DIR / f"{self.prefix}{next(self._counter)}")
        save_file(rows, base)
        create_files(f"{base}.codes", f"{base}.codes.{HIDDEN_SUFFIX}")  # the worker's row files
        self._paths[request_id] = (base, f"{base}.codes")
        self._voices[request_id] = voice_name(params).lower()
        params = copy.copy(params)
        params.extra_args = {**(params.extra_args or {}), INPUTS_PATH_KEY: base, OUTPUTS_PATH_KEY: f"{base}.codes"}
        length = rows["user_rows"].shape[0] + ASSISTANT_ROWS
        return {"prompt_token_ids": [self.codec_pad] * length}, params

    def input_rows(self, request_id: str, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                   thinker_positions: Any = None) -> dict[str, torch.Tensor]:
        """The rows transformers' ``generate`` takes from the thinker, selected by chat segment."""
        length = ids.shape[0]
        where = f"stage {self.stage_id}: request {request_id!r}"
        if embeds.shape != hidden.shape or embeds.shape[0] < length + 1:
            raise ValueError(f"{where}: thinker states of shapes {tuple(embeds.shape)} and {tuple(hidden.shape)} "
                             f"for a {length}-token prompt (the talker needs the reply's first token's too)")
        starts = (ids == self.im_start).nonzero().flatten().tolist()
        if length < 3 or length - 3 not in starts or int(ids[length - 2]) != self.assistant:
            raise ValueError(f"{where}: the thinker's prompt does not end with <|im_start|>assistant\\n: the talker "
                             "takes its rows by chat turn (render the prompt with the model's chat template)")
        role = torch.full((length,), -1, dtype=torch.long)
        for start in starts:
            if start + 1 < length:
                role[start:] = int(ids[start + 1])
        user = (role == self.user).nonzero().flatten()
        multimodal = torch.isin(ids[user], self.placeholders)
        user_rows = torch.where(multimodal.unsqueeze(1), hidden[user], embeds[user])
        rows = {"user_rows": user_rows.contiguous(), "user_multimodal": multimodal.to(torch.int64),
                "assistant_rows": embeds[length - 3:length].contiguous(),
                "reply_rows": embeds[length:].contiguous()}
        if bool(torch.isin(ids[user], self.visual).any()):
            if thinker_positions is None:
                raise ValueError(f"{where}: an image or video in the prompt, and no thinker positions to place "
                                 "the talker's rows by its grid (the thinker stage records them)")
            rows.update(talker_rope(torch.as_tensor(thinker_positions), user))
        return rows

    def frames(self, request_id: str, generated: list[int], start: int = 0) -> np.ndarray:
        """The request's codes ``[G, frames]`` from frame ``start``: each frame's first code is a generated
        id, and its row in the file (written at the step after it was sampled) holds all of its codes."""
        paths = self._paths.get(request_id)
        # The last id's frame is completed at the next step: none comes after the stop code, nor
        # after a last code cut by max_tokens (which makes no frame, as in transformers).
        count = len(generated) - 1
        if paths is None or count <= start:
            return np.zeros((self.groups, 0), dtype=np.int64)
        rows = read_rows(paths[1], count, self.groups, np.int64, start)
        return np.ascontiguousarray(rows.T)

    def output_extras(self, request_id: str, generated: list[int]) -> dict[str, Any]:
        """What the final output carries for code2wav: every complete frame's codes (the stop code
        ends the list; a last code with no step after it makes no frame, as transformers')."""
        return {"codes": self.frames(request_id, generated),
                "voice": self._voices.get(request_id, DEFAULT_VOICE)}

    def partial_extras(self, request_id: str, generated: list[int]) -> dict[str, Any]:
        """The frames since the last partial output, from frame ``codes_offset``."""
        offset = self._streamed.get(request_id, 0)
        codes = self.frames(request_id, generated, offset)  # the new frames only: no re-read per output
        self._streamed[request_id] = offset + codes.shape[1]
        return {"codes": codes, "codes_offset": offset,
                "voice": self._voices.get(request_id, DEFAULT_VOICE)}

    def finish(self, request_id: str) -> None:
        self._voices.pop(request_id, None)
        self._streamed.pop(request_id, None)
        self.parts.drop(request_id)
        for path in self._paths.pop(request_id, ()):
            for name in (path, f"{path}.{HIDDEN_SUFFIX}", *reply_files(path)):
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass
