"""The Qwen2 tokenizer of a tiny Qwen-Omni checkpoint, from a GGUF's metadata, and its JSON files.

Both Qwen-Omni families speak Qwen2's byte-level BPE; they differ in the names of their special
tokens and in the chat template. The vocabulary and merges come from the metadata of the
``qwen2.5-coder-0.5b`` recipe's first GGUF part (no weights are read). Its 151,936 token slots run
past the 151,665 Qwen2.5 uses; the Qwen3 families name some of the slots beyond, and a renamed slot
becomes a special token of its own, as in the published tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_qwen2_tokenizer(staging: Path, gguf_path: Path, *, names: Mapping[int, str],
                          processor_tokens: Mapping[str, str], chat_template: str) -> None:
    """Qwen2's tokenizer from ``gguf_path`` with ``names`` at their ids, saved into ``staging``.

    ``processor_tokens`` (``audio_token`` -> its text, ...) are what the family's transformers
    processor reads off the tokenizer; they are written as ``extra_special_tokens``.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        convert_gguf_tokenizer,
        get_gguf_tokenizer,
    )

    architecture, tokenizer_dict, _ = get_gguf_tokenizer(str(gguf_path))
    tokens = list(tokenizer_dict["tokens"])
    for token_id, name in names.items():
        tokens[token_id] = name
    backend, _ = convert_gguf_tokenizer(architecture, dict(tokenizer_dict, tokens=tokens))
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    # A slot the GGUF left as padding is an ordinary vocabulary entry there: make the name special,
    # or BPE would split "<|audio_pad|>" into pieces (its id stays the slot's: it is in the vocab).
    backend.add_special_tokens([AddedToken(name, special=True, normalized=False)
                                for _, name in sorted(names.items()) if name not in known])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=dict(processor_tokens), model_max_length=32768, clean_up_tokenization_spaces=False)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(staging))
    config_path = staging / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "Qwen2Tokenizer"  # as published; the same BPE either way
    write_json(config_path, tokenizer_config)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """``data`` as the checkpoint's JSON files are written: sorted keys, so rebuilds match byte for byte."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
