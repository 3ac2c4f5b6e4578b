"""The talker stage's side of a request: the thinker's states become the talker model's inputs.

Runs in the talker's stage process (``engine_args.request_adapter``), before vLLM sees the request.
The thinker's states arrive as the thinker stage sent them (``thinker2talker`` forwards them
untouched, as shared-memory handles); here they become what transformers' ``generate`` gives its
talker, written to one safetensors file in ``/dev/shm`` that the worker's ``RequestTap`` reads
when the request enters the batch:

- ``prompt_rows`` ``[L, D]``: the thinker's last hidden state plus its input embedding at each
  prompt position, the embedding zeroed at audio / image / video placeholders (transformers
  zeroes the merged features there);
- ``reply_rows`` ``[N - 1, D]``: the same sum for each generated token but the last;
- ``speaker_bos`` ``[1]``: the voice's text bos token (``spk_dict.pt``);
- ``rope_prompt`` ``[3, L]`` and ``rope_from`` ``[1]``: the multimodal rope positions of the prompt
  rows (the thinker's) and of row ``L`` (every later row one more), where the thinker sent them;
- ``reply_final`` ``[1]``, for a request fed in parts (async_chunk: the talker starts on the
  thinker's first reply token): 0 while the thinker still writes. Each next part's rows are
  appended to a row file beside it before the talker runs on them (``reply_parts``); the engine never lets
  the talker make code ``k`` before reply row ``k`` has come (``extend``'s allowance).

The request vLLM runs is ``[codec mask] * L + [codec pad, codec bos]``: placeholders whose
embeddings the model replaces, but whose ids vLLM's repetition penalty counts, as transformers'.
The voice is the talker params' ``extra_args["voice"]`` (default ``Chelsie``, transformers'
default); an unknown one is refused here, naming the voices there are.
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
from omni_engine.models.qwen2_5_omni.speakers import load_speakers, pick_voice
from omni_engine.models.reply_parts import ReplyParts, reply_files
from omni_engine.models.request_tap import INPUTS_PATH_KEY

DEFAULT_VOICE = "Chelsie"
PROMPT_FIELDS = ("thinker_prompt_token_ids", "input_embeds", "hidden_states")


def voice_name(params: Any) -> str:
    return (getattr(params, "extra_args", None) or {}).get("voice") or DEFAULT_VOICE


class TalkerRequests:
    """Turns ``thinker2talker``'s prompts into the talker model's requests (one file each)."""

    def __init__(self, stage_id: int, model_dir: str) -> None:
        self.stage_id = stage_id
        self.model_dir = model_dir
        self.speakers = load_speakers(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        talker, thinker = config["talker_config"], config["thinker_config"]
        self.codec_mask = talker["tts_codec_mask_token_id"]
        self.codec_pad = talker["tts_codec_pad_token_id"]
        self.codec_bos = talker["tts_codec_start_token_id"]
        self.codec_eos = talker["tts_codec_end_token_id"]
        self.placeholders = torch.tensor([thinker["audio_token_index"], thinker["image_token_index"],
                                          thinker["video_token_index"]])
        self._prefix: str | None = None  # known at the first request: the stage's pool is set after start
        self._paths: dict[str, str] = {}
        self._voices: dict[str, str] = {}
        self._streamed: dict[str, int] = {}  # codes a request's partial outputs have carried
        self.parts = ReplyParts()  # requests fed in parts
        self._counter = itertools.count()

    @property
    def prefix(self) -> str:
        if self._prefix is None:
            self._prefix = shm.stage_file_prefix("talker")
        return self._prefix

    def info(self) -> dict[str, Any]:
        """For the stage's READY info: the voices it speaks (a server routes a request's voice here,
        in ``extra_args["voice"]``)."""
        return {"voices": sorted(self.speakers), "default_voice": DEFAULT_VOICE}

    def voice_of(self, params: Any, request_id: str) -> dict[str, Any]:
        try:
            return pick_voice(self.speakers, voice_name(params))
        except ValueError as exc:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: {exc}") from None

    def adapt(self, request_id: str, prompt: Any, params: Any) -> tuple[dict[str, Any], Any]:
        """vLLM's prompt and params for the request; its inputs file is written."""
        return self.start(request_id, self.request_rows(request_id, prompt, params), params)

    def adapt_parts(self, request_id: str, prompt: Any, params: Any) -> tuple[dict[str, Any], Any, int]:
        """As ``adapt``, for a request whose thinker is still writing (``thinker2talker`` under
        async_chunk): the reply rows known so far, and the codes the talker may make from them (code
        ``k`` is made at the position that adds reply row ``k``: the prompt's last holds row 0)."""
        rows = self.request_rows(request_id, prompt, params)
        known = self.parts.open(request_id, rows)
        vllm_prompt, params = self.start(request_id, rows, params)
        return vllm_prompt, params, known

    def extend(self, request_id: str, prompt: Any, last: bool) -> int | None:
        """The thinker's next rows (``input_embeds`` and ``hidden_states``, ``[n, D]`` each); the codes
        the talker may make now (None once the reply is whole: up to its stop code). Written when the
        talker needs them (``write_inputs``)."""
        width = self.parts.width(request_id)
        if width is None:
            return None
        parts = [prompt.get(k) if isinstance(prompt, dict) else None for k in ("input_embeds", "hidden_states")]
        if any(p is None or getattr(p, "ndim", 0) != 2 or p.shape[1] != width for p in parts) \
                or parts[0].shape != parts[1].shape:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: a part of the thinker's states needs "
                             f"input_embeds and hidden_states [rows, {width}], got "
                             f"{[None if p is None else tuple(getattr(p, 'shape', ())) for p in parts]}")
        embeds, hidden = (torch.as_tensor(p) for p in parts)
        return self.parts.append(request_id, hidden + embeds, last)

    def write_inputs(self, request_id: str) -> None:
        """The reply rows given since the talker last ran, appended beside its inputs (``reply_parts``)."""
        self.parts.write(request_id, self._paths.get(request_id))

    def request_rows(self, request_id: str, prompt: Any, params: Any) -> dict[str, torch.Tensor]:
        """The inputs file's tensors for a ``thinker2talker`` prompt, the voice's bos among them."""
        missing = [f for f in PROMPT_FIELDS if not isinstance(prompt, dict) or f not in prompt]
        if missing:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: a talker prompt needs "
                             f"{', '.join(missing)} (the thinker's states: its stage needs "
                             "engine_output_type: latent, and the edge custom_process_input_func thinker2talker)")
        speaker = self.voice_of(params, request_id)
        ids = torch.as_tensor(list(prompt["thinker_prompt_token_ids"]))
        embeds, hidden = torch.as_tensor(prompt["input_embeds"]), torch.as_tensor(prompt["hidden_states"])
        length = ids.shape[0]
        if embeds.shape != hidden.shape or embeds.shape[0] < length + 1:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: thinker states of shapes "
                             f"{tuple(embeds.shape)} and {tuple(hidden.shape)} for a {length}-token prompt")
        kept = (~torch.isin(ids, self.placeholders)).to(embeds.dtype).unsqueeze(1)
        return {"prompt_rows": (hidden[:length] + embeds[:length] * kept).contiguous(),
                "reply_rows": (hidden[length:] + embeds[length:]).contiguous(),
                "speaker_bos": torch.tensor([int(speaker["bos_token"])]),
                **self.rope_positions(prompt, length, request_id)}

    def start(self, request_id: str, rows: dict[str, torch.Tensor], params: Any) -> tuple[dict[str, Any], Any]:
        from safetensors.torch import save_file

        path = str(shm.SHM_DIR / f"{self.prefix}{next(self._counter)}")
        save_file(rows, path)
        self._paths[request_id] = path
        self._voices[request_id] = voice_name(params)
        params = copy.copy(params)
        params.extra_args = {**(params.extra_args or {}), INPUTS_PATH_KEY: path}
        length = rows["prompt_rows"].shape[0]
        return {"prompt_token_ids": [self.codec_mask] * length + [self.codec_pad, self.codec_bos]}, params

    def rope_positions(self, prompt: dict[str, Any], length: int, request_id: str) -> dict[str, torch.Tensor]:
        """The talker's multimodal rope, as transformers' talker gets it from ``get_rope_index`` over the
        thinker's ids: the thinker's own positions for the ``L`` prompt rows (an image's tokens at their
        grid's T/H/W), then every later row one past the last (``rope_from``: the position of row ``L``,
        which is ``L`` unless an image took fewer positions than tokens). None given: plain positions."""
        if prompt.get("thinker_positions") is None:
            return {}
        positions = torch.as_tensor(prompt["thinker_positions"])
        if positions.ndim != 2 or positions.shape[1] != 3 or positions.shape[0] < length:
            raise ValueError(f"stage {self.stage_id}: request {request_id!r}: thinker positions of shape "
                             f"{tuple(positions.shape)} for a {length}-token prompt (want [>= {length}, 3])")
        prompt_positions = positions[:length].round().to(torch.int64)
        following = int(prompt_positions.max()) + 1 if length else 0
        return {"rope_prompt": prompt_positions.T.contiguous(), "rope_from": torch.tensor([following])}

    def output_extras(self, request_id: str, generated: list[int]) -> dict[str, Any]:
        """What the final output carries for code2wav: all the codes (the stop code cut), whatever
        the stream's output kind, and the voice they were made for."""
        codes = generated[:-1] if generated and generated[-1] in (self.codec_pad, self.codec_eos) else generated
        return {"codes": np.asarray(codes, dtype=np.int64), "voice": self._voices.get(request_id, DEFAULT_VOICE)}

    def partial_extras(self, request_id: str, generated: list[int]) -> dict[str, Any]:
        """What a partial output carries: the codes since the last one, from ``codes_offset``, so an
        ``async_chunk`` edge renders speech while the talker still speaks, whatever the output kind.
        (A stop code ends the request: it comes in the final output, never here.)"""
        offset = self._streamed.get(request_id, 0)
        self._streamed[request_id] = len(generated)
        return {"codes": np.asarray(generated[offset:], dtype=np.int64), "codes_offset": offset,
                "voice": self._voices.get(request_id, DEFAULT_VOICE)}

    def finish(self, request_id: str) -> None:
        self._voices.pop(request_id, None)
        self._streamed.pop(request_id, None)
        self.parts.drop(request_id)
        path = self._paths.pop(request_id, None)
        for name in (path, *reply_files(path)) if path is not None else ():
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass
