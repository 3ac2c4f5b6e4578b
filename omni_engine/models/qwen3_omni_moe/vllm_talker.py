"""Qwen3-Omni's talker as a vLLM model of ours: a frame of codec codes per step from the thinker's states.

The decoder is vLLM's Qwen3-MoE model (every layer MoE with a shared expert, q/k norms) over the
talker's derived config (``talker_config``); its codec embedding is the decoder's token embedding.
vLLM samples each frame's first code (``codec_head``, the ids past the codebook suppressed but the
stop code, as transformers does); the code predictor (``code_predictor``) makes the frame's other
codes at the start of the next step, from the hidden state that made the first and its embedding,
and their summed embeddings are that step's input. Inputs, as transformers' ``generate`` builds
them (``talker_requests`` writes what a request brings):

- the prompt: the user turns' rows (``hidden_projection`` of the accepted thinker layer at audio /
  image / video placeholders, ``text_projection`` of the thinker's input embedding elsewhere), then
  9 rows: ``<|im_start|>assistant\\n``'s projected embeddings; tts pad plus the codec embedding of
  nothink, think bos, think eos and the speaker; tts bos plus codec pad; the reply's first token
  plus codec bos;
- step ``f`` after it: the frame's summed code embeddings plus the reply's token ``f + 1``
  (projected), then tts eos, then tts pad for ever.

A frame's residual codes and the hidden state that made its first code are written to the request's
``RowFile`` (``request_tap``): the stage reads the codes from it, and a request recomputed after
preemption finds there what it cannot recompute in one pass (a row's input depends on the previous
row's output). Positions: Qwen3's interleaved multimodal rope, each request's rows placed as
transformers' talker ``get_rope_index`` places them (``talker_requests.talker_rope``); the channels
are equal, so plain rope, but for a prompt with an image or video.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen3_moe import Qwen3MoeModel
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from omni_engine.models.qwen3_omni_moe.code_predictor import PREFIX, build_code_predictor, predict_codes
from omni_engine.models.qwen3_omni_moe.talker_requests import HIDDEN_SUFFIX
from omni_engine.models.reply_parts import ReplyRows
from omni_engine.models.request_tap import RequestIO, RowFile, batch_segments
from omni_engine.models.talker_rope import multimodal_rope, talker_rope_channels

logger = logging.getLogger(__name__)

THINKER_EMBEDDING = "thinker.model.embed_tokens.weight"
SUPPRESSED_TAIL = 1024  # transformers suppresses the vocabulary's last 1024 ids but the stop code


def hidden_file(io: RequestIO) -> RowFile:
    """The request's second row file: per frame, the hidden state that made its first code."""
    return io.side_file(HIDDEN_SUFFIX)


class ResizeMLP(nn.Module):
    """``fc2(silu(fc1(x)))``: the thinker's width to the talker's (transformers' ResizeMLP)."""

    def __init__(self, width_in: int, intermediate: int, width_out: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width_in, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, width_out, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(nn.functional.silu(self.linear_fc1(x)))


class OmniEngineQwen3OmniMoeTalker(nn.Module):
    """The talker: Qwen3-MoE decoder + code predictor -> all code groups of a frame per step."""

    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={
        "talker.model.codec_embedding.": "model.embed_tokens.",
        "talker.": "", "thinker.": None, "code2wav.": None})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Qwen3MoeModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        width, thinker_width = config.hidden_size, config.thinker_hidden_size
        self.text_projection = ResizeMLP(thinker_width, config.intermediate_size, width)
        self.hidden_projection = ResizeMLP(thinker_width, config.intermediate_size, width)
        self.codec_head = ParallelLMHead(config.vocab_size, width, bias=False, prefix=maybe_prefix(prefix, "codec_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.code_predictor = build_code_predictor(config.code_predictor_config)
        self.groups = int(config.num_code_groups)
        if len(self.code_predictor.lm_head) != self.groups - 1:
            raise ValueError(f"talker_config.num_code_groups is {self.groups} but the code predictor makes "
                             f"{len(self.code_predictor.lm_head)} groups after the first")
        suppressed = torch.zeros(config.vocab_size, dtype=torch.bool)
        suppressed[config.vocab_size - SUPPRESSED_TAIL:] = True
        suppressed[config.codec_eos_token_id] = False
        self.register_buffer("suppressed", suppressed, persistent=False)
        # The thinker's embeddings of tts pad, bos and eos (filled when weights load).
        self.tts_ids = (config.tts_pad_token_id, config.tts_bos_token_id, config.tts_eos_token_id)
        self.register_buffer("tts_rows", torch.zeros(3, thinker_width), persistent=False)
        # Qwen3's interleaved multimodal rope, placed per request (``talker_rope``): plain positions
        # in every channel but for a prompt with an image or video
        self.mrope_section = getattr(config, "talker_mrope_section", None)
        if self.mrope_section:
            for layer in self.model.layers:
                layer.self_attn.rotary_emb = multimodal_rope(layer.self_attn.rotary_emb, self.mrope_section,
                                                             interleaved=True)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    # ------------------------------------------------------------------ inputs

    def tts_row(self, which: int) -> torch.Tensor:
        """The projected thinker embedding of tts pad (0), bos (1) or eos (2)."""
        return self.text_projection(self.tts_rows[which])

    def prompt_rows(self, io: RequestIO) -> torch.Tensor:
        """A request's whole prompt, ``[user rows + 9, D]`` (made once, kept in its memo)."""
        if "prompt" in io.memo:
            return io.memo["prompt"]
        inputs, config = io.inputs, self.config
        user, multimodal = inputs["user_rows"], inputs["user_multimodal"].bool()
        dtype = self.tts_rows.dtype
        user_rows = torch.where(multimodal.unsqueeze(1), self.hidden_projection(user.to(dtype)),
                                self.text_projection(user.to(dtype)))
        codec = self.embed_input_ids(torch.tensor(
            [config.codec_nothink_id, config.codec_think_bos_id, config.codec_think_eos_id,
             int(inputs["speaker"][0]), config.codec_pad_id, config.codec_bos_id], device=user.device))
        # the reply's rows, projected once each (those of a request fed in parts as they come)
        reply = io.memo["reply"] = ReplyRows(inputs, io.inputs_path, lambda rows: self.text_projection(
            rows.to(self.tts_rows.device, dtype)))
        pad, bos = self.tts_row(0), self.tts_row(1)
        assistant = torch.cat([
            self.text_projection(inputs["assistant_rows"].to(dtype)),   # <|im_start|> assistant \n
            pad + codec[0:1], pad + codec[1:2], pad + codec[2:3], pad + codec[3:4],
            bos + codec[4:5], reply.rows[0:1] + codec[5:6]])
        io.memo["prompt"] = torch.cat([user_rows, assistant])
        return io.memo["prompt"]

    def trailing_row(self, io: RequestIO, frame: int) -> torch.Tensor:
        """The text row added to frame ``frame``'s codes: the reply's token ``frame + 1``, then tts eos
        (once the reply is whole), then tts pad for ever."""
        reply: ReplyRows = io.memo["reply"]
        if frame + 1 >= reply.count and not reply.whole:
            # fed in parts: the thinker's rows this frame needs came with a part since they were read
            # (whether vLLM re-adds the request to the batch at a part or not); a talker fed in parts
            # is never run past the rows it has (``talker_requests.TalkerRequests.extend``)
            reply.more()
        if frame + 1 < reply.count:
            return reply.rows[frame + 1]
        return self.tts_row(2 if reply.whole and frame + 1 == reply.count else 0)

    def build_embeds(self, input_ids: torch.Tensor, embeds: torch.Tensor, segments: list[Any]) -> None:
        """Each tapped request's rows of ``embeds``: its prompt rows, and for each later row (frame
        ``f``'s first code) the frame's summed code embeddings plus its text row."""
        pending: list[tuple[int, RequestIO, int, torch.Tensor]] = []  # rows the predictor completes
        for io, begin, end, first in segments:
            if "user_rows" not in io.inputs:
                continue
            prompt = self.prompt_rows(io)
            length = prompt.shape[0]
            for offset in range(end - begin):
                position, row = first + offset, begin + offset
                if position < length:
                    embeds[row] = prompt[position]
                    continue
                frame = position - length
                if offset == 0 and io.memo.get("last_frame") == frame:  # a decode step
                    pending.append((row, io, frame, io.memo["last_hidden"]))
                    continue
                # recomputed after preemption: the frame's codes are in its row file, or (the last
                # row) the hidden state that made its first code is
                codes = self.stored_codes(io, frame)
                if codes is not None:
                    embeds[row] = self.summed_embeds(codes) + self.trailing_row(io, frame)
                else:
                    pending.append((row, io, frame, self.stored_hidden(io, frame)))
        if pending:
            self.predict(input_ids, embeds, pending)

    def stored_codes(self, io: RequestIO, frame: int) -> torch.Tensor | None:
        return None if io.outputs is None else io.outputs.read(frame, torch.zeros(self.groups, dtype=torch.long))

    def stored_hidden(self, io: RequestIO, frame: int) -> torch.Tensor:
        width = self.config.hidden_size
        row = None if io.outputs is None else hidden_file(io).read(frame, torch.zeros(width, dtype=torch.float32))
        if row is None:
            logger.error("talker: %s: frame %d's first code has no hidden state that made it (its row file "
                         "lost it); its other codes are predicted from zeros", io.outputs and io.outputs.path, frame)
            row = torch.zeros(width)
        return row.to(self.tts_rows.device, self.tts_rows.dtype)

    def summed_embeds(self, codes: torch.Tensor) -> torch.Tensor:
        """A frame's codes ``[G]`` as the talker's input: every group's embedding, summed."""
        codes = codes.to(self.tts_rows.device)
        rows = [self.embed_input_ids(codes[:1])] + [self.code_predictor.model.codec_embedding[g](codes[g + 1:g + 2])
                                                    for g in range(self.groups - 1)]
        return torch.cat(rows).sum(0)

    def predict(self, input_ids: torch.Tensor, embeds: torch.Tensor,
                pending: list[tuple[int, RequestIO, int, torch.Tensor]]) -> None:
        rows = [row for row, *_ in pending]
        first = input_ids[rows]
        codes, summed = predict_codes(self.code_predictor, torch.stack([made_by for *_, made_by in pending]),
                                      self.embed_input_ids(first), [self.sampler(io) for _, io, _, _ in pending])
        for (row, io, frame, _), frame_first, frame_codes, frame_sum in zip(pending, first, codes, summed):
            embeds[row] = frame_sum + self.trailing_row(io, frame)
            if io.outputs is not None:
                io.outputs.write(frame, torch.cat([frame_first.view(1), frame_codes]).cpu())

    @staticmethod
    def sampler(io: RequestIO) -> torch.Generator | None | bool:
        """False: greedy (a greedy talker); else the request's seeded generator, or None (global)."""
        params = io.params
        if getattr(params, "temperature", 1.0) == 0.0:
            return False
        if "generator" not in io.memo:
            seed = getattr(params, "seed", None)
            io.memo["generator"] = torch.Generator().manual_seed(seed) if seed is not None else None
        return io.memo["generator"]

    # ------------------------------------------------------------------ vLLM's interface

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        inputs_embeds = inputs_embeds.clone()
        segments = list(batch_segments())
        if input_ids is not None:
            self.build_embeds(input_ids, inputs_embeds, segments)
        hidden = self.model(None, self.rope_positions(positions, segments), intermediate_tensors,
                            inputs_embeds=inputs_embeds)
        for io, begin, end, first in segments:
            frame = first + (end - begin) - io.memo["prompt"].shape[0] if "prompt" in io.memo else -1
            if frame >= 0:
                # the last row makes frame ``frame``'s first code; the predictor completes the frame
                # from it at the next step (kept, and written for a recomputation)
                io.memo["last_hidden"], io.memo["last_frame"] = hidden[end - 1].detach(), frame
                if io.outputs is not None:
                    hidden_file(io).write(frame, hidden[end - 1].float())
        return hidden

    def rope_positions(self, positions: torch.Tensor, segments: list[Any]) -> torch.Tensor:
        """vLLM's 1-D positions as the three rope channels (``[3, tokens]``), per request."""
        if not self.mrope_section:
            return positions
        return talker_rope_channels(positions, [
            (begin, end, io.inputs["rope_prompt"], int(io.inputs["rope_from"][0]))
            for io, begin, end, _first in segments if "rope_prompt" in io.inputs])

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.codec_head, hidden_states)
        if logits is not None:
            logits[:, self.suppressed] = float("-inf")
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        predictor: dict[str, torch.Tensor] = {}

        def talker_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == THINKER_EMBEDDING:
                    with torch.no_grad():
                        self.tts_rows.copy_(tensor[list(self.tts_ids)].to(self.tts_rows.dtype))
                elif name.startswith(PREFIX):
                    predictor[name[len(PREFIX):]] = tensor
                else:
                    yield name, tensor

        loaded = AutoWeightsLoader(self).load_weights(
            talker_weights(), mapper=self.hf_to_vllm_mapper)
        missing, unexpected = self.code_predictor.load_state_dict(predictor, strict=False)
        if missing or unexpected:
            raise ValueError(f"the code predictor's weights do not fit: missing {missing[:4]}, unexpected {unexpected[:4]}")
        self.code_predictor.to(self.tts_rows.dtype)
        if not bool(self.tts_rows.abs().sum()):
            raise ValueError(f"the checkpoint has no {THINKER_EMBEDDING}: the talker reads the thinker's "
                             "embeddings of its tts pad, bos and eos tokens from it")
        return loaded | {f"code_predictor.{name}" for name in predictor}
