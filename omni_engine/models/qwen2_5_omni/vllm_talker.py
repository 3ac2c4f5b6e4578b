"""Qwen2.5-Omni's talker as a vLLM model of ours: codec tokens from the thinker's states.

The decoder is vLLM's ``LlamaModel``: the talker is Qwen2's architecture (Llama's with biases on q, k
and v: its derived config says ``qkv_bias``), but its heads are wider than hidden / heads (the
published talker: 896 wide, 12 heads of 128), which vLLM's ``Qwen2Model`` cannot express (it takes
the head size from the width) and Llama's decoder reads from ``head_dim``. It is fed embeddings the
way transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` builds them:

- the prompt is ``L + 2`` positions: the thinker's prompt rows (its last hidden state plus its
  input embedding, zero at multimodal placeholders); then the speaker's text bos embedding plus
  the codec pad embedding; then the thinker's first reply row plus the codec bos embedding;
- each later position adds the codec embedding of the code just made to the thinker's next
  reply row; after the reply rows the thinker's text eos embedding, then its text pad embedding
  for every position that follows;
- everything is projected (``thinker_to_talker_proj``) from the thinker's width to the talker's,
  and ``codec_head`` makes the logits (codec bos never sampled, as transformers suppresses it).

A request brings its thinker rows as tensors of its own (``request_tap``: ``prompt_rows``
``[L, thinker hidden]``, ``reply_rows`` ``[N - 1, thinker hidden]``, ``speaker_bos`` ``[1]``); its
token ids are placeholders (``[codec mask] * L + [codec pad, codec bos]``) that vLLM's repetition
penalty sees as transformers' does. The thinker's embedding rows the talker needs (text eos, text
pad, each speaker's bos) are read from the checkpoint's thinker embedding when weights load.

Positions: Qwen2.5-Omni's multimodal rope (``talker_mrope_section`` of the head's frequencies per
T/H/W channel). vLLM runs the talker with plain 1-D positions; the forward turns them into three
channels per request, as transformers' talker gets them from ``get_rope_index``: the thinker's own
positions for the prompt rows (``rope_prompt``: equal channels for text and audio, an image's
tokens at their grid's T/H/W), then one more each row from ``rope_from``. Each decoder layer's rope is
vLLM's ``MRotaryEmbedding`` with the same frequencies, so equal channels are ordinary rope.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    WeightsMapper,
    maybe_prefix,
)

from omni_engine.models.qwen2_5_omni.speakers import load_speakers
from omni_engine.models.reply_parts import ReplyRows
from omni_engine.models.talker_rope import multimodal_rope, talker_rope_channels
from omni_engine.models.request_tap import batch_segments

THINKER_EMBEDDING = "thinker.model.embed_tokens.weight"


class OmniEngineQwen2_5OmniTalker(nn.Module):
    """The talker: Qwen2 decoder over projected thinker states + codec embeddings -> codec ids."""

    # (LlamaModel's own loader stacks q/k/v and gate/up.)
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix={"talker.": "", "thinker.": None, "token2wav.": None})

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LlamaModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # The codec embedding lives in the thinker's width (embedding_size), not the decoder's.
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.embedding_size,
                                                         prefix=maybe_prefix(prefix, "model.embed_tokens"))
        self.thinker_to_talker_proj = nn.Linear(config.embedding_size, config.hidden_size, bias=True)
        self.codec_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=False,
                                         prefix=maybe_prefix(prefix, "codec_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.codec_bos = config.tts_codec_start_token_id
        self.codec_pad = config.tts_codec_pad_token_id
        # The thinker embedding rows the talker reads, by token id (filled when weights load).
        self.speaker_bos_ids = sorted({s["bos_token"] for s in load_speakers(vllm_config.model_config.model).values()})
        self.text_ids = (config.tts_text_end_token_id, config.tts_text_pad_token_id)
        self.register_buffer("thinker_rows", torch.zeros(len(self.speaker_bos_ids) + 2, config.embedding_size),
                             persistent=False)
        self.mrope_section = getattr(config, "talker_mrope_section", None)
        if self.mrope_section:
            for layer in self.model.layers:
                layer.self_attn.rotary_emb = multimodal_rope(layer.self_attn.rotary_emb, self.mrope_section)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def thinker_row(self, token_id: int) -> torch.Tensor:
        ids = [*self.speaker_bos_ids, *self.text_ids]
        return self.thinker_rows[ids.index(token_id)]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        inputs_embeds = inputs_embeds.clone()
        for io, begin, end, first in batch_segments():
            if "prompt_rows" in io.inputs:
                self._add_thinker_rows(inputs_embeds[begin:end], first, io)
        return self.model(None, self.rope_positions(positions), intermediate_tensors,
                          inputs_embeds=self.thinker_to_talker_proj(inputs_embeds))

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """vLLM's 1-D positions as the talker's three rope channels (``[3, tokens]``), per request."""
        if not self.mrope_section:
            return positions
        return talker_rope_channels(positions, [
            (begin, end, io.inputs["rope_prompt"], int(io.inputs["rope_from"][0]))
            for io, begin, end, _first in batch_segments() if "rope_prompt" in io.inputs])

    def _add_thinker_rows(self, embeds: torch.Tensor, first: int, io: Any) -> None:
        """``embeds`` (positions ``first`` on; the codec embeddings of their ids), as transformers
        builds them: prompt rows replace the codec mask's embedding; the speaker's bos row is added
        at ``L``; reply row 0 at ``L + 1`` (with codec bos), row k with each code after, then the
        text eos row, then the text pad row for ever."""
        inputs = io.inputs
        prompt = inputs["prompt_rows"].to(embeds.dtype)
        length = prompt.shape[0]
        if "reply" not in io.memo:  # (kept while the request lives: a part adds only its own rows)
            io.memo["reply"] = ReplyRows(inputs, io.inputs_path, lambda rows: rows.to(embeds.device, embeds.dtype))
        reply: ReplyRows = io.memo["reply"]
        needed = first + embeds.shape[0] - length - 1  # reply rows these positions read
        if needed > reply.count and not reply.whole:
            # fed in parts: the rows these positions need came with a part since they were read
            reply.more()
        # (the text eos row follows the reply once it is whole; the engine never runs a talker fed in
        # parts past the rows it has)
        tail = torch.stack([self.thinker_row(self.text_ids[0]), self.thinker_row(self.text_ids[1])]).to(embeds.dtype)
        positions = torch.arange(first, first + embeds.shape[0], device=embeds.device)
        in_prompt = positions < length
        embeds[in_prompt] = prompt[positions[in_prompt]]
        embeds[positions == length] += self.thinker_row(int(inputs["speaker_bos"][0])).to(embeds.dtype)
        after = positions > length
        embeds[after] += reply.gather(positions[after] - length - 1, tail)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.codec_head, hidden_states)
        if logits is not None:
            logits[:, self.codec_bos] = float("-inf")  # transformers' suppress_tokens=[codec bos]
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        ids = [*self.speaker_bos_ids, *self.text_ids]

        def talker_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name == THINKER_EMBEDDING:
                    with torch.no_grad():
                        self.thinker_rows.copy_(tensor[ids].to(self.thinker_rows.dtype))
                    continue
                yield name, tensor

        loader = AutoWeightsLoader(self)
        loaded = loader.load_weights(talker_weights(), mapper=self.hf_to_vllm_mapper)
        if not bool(self.thinker_rows.abs().sum()):
            raise ValueError(f"the checkpoint has no {THINKER_EMBEDDING}: the talker reads the thinker's "
                             "embeddings of its text eos, text pad and speaker bos tokens from it")
        return loaded
