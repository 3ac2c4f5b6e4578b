"""Tool-call parsers this server adds to vLLM's (``--tool-call-parser <name>``).

``hermes_json``: vLLM's ``hermes`` parser, which reads calls inside ``<tool_call>`` tags, plus
calls written without them (or in a Markdown ```json fence). Qwen2.5-Coder-0.5B-Instruct as it ships offline (a quantized GGUF,
``prepare-model qwen2.5-coder-0.5b``) answers a call as bare ``{"name": ..., "arguments": ...}``
lines far more often than inside the tags its chat template asks for (measured: every call of a
dozen prompts), so ``hermes`` alone finds none. A reply that *opens* with such an object is read
as calls, one per object; anything else is ``hermes``'s. Registered lazily with vLLM's
``ToolParserManager`` (``register``), so it is listed, validated and built as vLLM's own are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from vllm.tool_parsers.abstract_tool_parser import ToolParserManager
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

from omni_engine.pipeline.input_processors import BARE_TOOL_CALL, opens_with_bare_call

NAME = "hermes_json"
_FENCE = re.compile(r"\s*```(json)?")


def register() -> None:
    """Make ``--tool-call-parser hermes_json`` known to vLLM (idempotent; imports nothing yet)."""
    ToolParserManager.register_lazy_module(NAME, __name__, HermesJsonToolParser.__name__)


def tag_bare_calls(text: str, start: str, end: str) -> str:
    """``text`` (bare JSON calls one after another, maybe text after them) with each call inside
    ``start``/``end``; the last one, while its JSON is incomplete, with ``start`` only."""
    decoder = json.JSONDecoder()
    pieces, pos = [], 0
    if fence := _FENCE.match(text):  # a fenced call: the fence is neither call nor content
        pos = fence.end()
    while True:
        rest = text[pos:]
        stripped = rest.lstrip()
        if not stripped.startswith("{"):
            pieces.append(rest)
            return "".join(pieces)
        pos += len(rest) - len(stripped)
        try:
            _obj, after = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            pieces.append(start + text[pos:])
            return "".join(pieces)
        pieces.append(start + text[pos:after] + end)
        pos = after


class HermesJsonToolParser(Hermes2ProToolParser):
    """``hermes``, and calls written as bare JSON objects at the start of the reply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._bare: bool | None = None  # decided once the reply's start tells

    def _tagged(self, text: str) -> str | None:
        """``text`` as ``hermes`` reads it; None while its start is undecided."""
        if self._bare is None:
            self._bare = opens_with_bare_call(text)
            if self._bare is None:
                return None
        if not self._bare:
            return text
        return tag_bare_calls(text, self.tool_call_start_token, self.tool_call_end_token)

    def extract_tool_calls(self, model_output: str, request: Any) -> Any:
        if self.tool_call_start_token not in model_output and BARE_TOOL_CALL.match(model_output):
            model_output = tag_bare_calls(model_output, self.tool_call_start_token, self.tool_call_end_token)
        return super().extract_tool_calls(model_output, request)

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int], current_token_ids: Sequence[int],
                                     delta_token_ids: Sequence[int], request: Any) -> Any:
        tagged = self._tagged(current_text)
        if tagged is None:
            return None
        return super().extract_tool_calls_streaming(previous_text, tagged, delta_text, previous_token_ids,
                                                    current_token_ids, delta_token_ids, request)
