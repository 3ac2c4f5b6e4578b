"""Function tools in a realtime session, and the pieces that keep calls out of speech.

The session's side (events, items, history) runs against a scripted ``RealtimeEngine`` that answers
with the pieces a tool-calling LLM's parsed output makes, so every event order can be checked;
the real path (Qwen2.5 through vLLM's chat rendering and the ``hermes_json`` parser, Piper after
it) is tested over a server in tests/voice_tools/. ``SpokenSentences`` and the parser run here on
their own: they are pure text handling (the parser with a real tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from omni_engine.entrypoints.openai.tool_parsers import HermesJsonToolParser, tag_bare_calls
import numpy as np

from omni_engine.pipeline.input_processors import SpokenSentences, split_sentences, spoken_fragments
from omni_engine.realtime.engine import AudioChunk, FunctionCallDelta, ResponseStart, TextDelta
from omni_engine.realtime.session import RealtimeSession

aio = pytest.mark.asyncio(loop_scope="session")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


class ScriptedEngine:
    """Answers each response with the next script (a list of pieces); records what it was asked."""

    can_hear = can_speak = False
    hears_audio = False
    default_voice = None

    def __init__(self, *scripts: list[Any], can_call_tools: bool = True, gate: asyncio.Event | None = None) -> None:
        self.scripts = list(scripts)
        self.can_call_tools = can_call_tools
        self.asked: list[dict[str, Any]] = []
        self.gate = gate  # when set, each piece after the first waits for it

    def start_turn(self, item_id):
        return None  # (not traced)

    def check_voice(self, voice, speed):
        pass

    def check_language(self, language):
        pass

    async def respond(self, messages, **kwargs):
        self.asked.append({"messages": messages, **kwargs})
        yield ResponseStart(10)
        for i, piece in enumerate(self.scripts.pop(0)):
            if self.gate is not None and i:
                await self.gate.wait()
            yield piece


def call_pieces(index: int, call_id: str, name: str, arguments: str) -> list[FunctionCallDelta]:
    """A call as vLLM's streaming parser gives it: the name first, then the arguments in pieces."""
    return [FunctionCallDelta(index, call_id, name, "")] + [
        FunctionCallDelta(index, None, None, arguments[i:i + 4]) for i in range(0, len(arguments), 4)]


async def session_with(engine: ScriptedEngine, tools: list[dict] | None = None) -> tuple[RealtimeSession, list]:
    out: list[dict[str, Any]] = []
    session = RealtimeSession(engine, out.append, model="m", vad_factory=None)
    await session.handle(json.dumps({"type": "session.update",
                                     "session": {"output_modalities": ["text"], "tools": tools or [WEATHER]}}))
    assert out[-1]["type"] == "session.updated", out[-1]
    return session, out


async def until_done(session: RealtimeSession, out: list) -> dict[str, Any]:
    await asyncio.wait_for(session.response.task, 10)
    assert out[-1]["type"] == "response.done"
    return out[-1]["response"]


async def ask(session: RealtimeSession, out: list, text: str, response: dict | None = None) -> dict[str, Any]:
    await session.handle(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}}))
    await session.handle(json.dumps({"type": "response.create", **({"response": response} if response else {})}))
    return await until_done(session, out)


def of_response(out: list, response_id: str) -> list[dict[str, Any]]:
    """The events that name ``response_id``, in order."""
    return [e for e in out if e.get("response_id") == response_id
            or (isinstance(e.get("response"), dict) and e["response"]["id"] == response_id)]


@aio
async def test_a_call_is_an_item_with_streamed_arguments_and_no_message() -> None:
    engine = ScriptedEngine(call_pieces(0, "call_a", "get_weather", '{"city": "Paris"}') + [TextDelta("", 12, "stop")])
    session, out = await session_with(engine)
    response = await ask(session, out, "Weather in Paris?")

    assert response["status"] == "completed"
    [call] = response["output"]
    assert (call["type"], call["name"], call["call_id"], call["status"]) == ("function_call", "get_weather", "call_a",
                                                                            "completed")
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    events = of_response(out, response["id"])
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.done"
    assert "response.content_part.added" not in kinds and "response.output_text.delta" not in kinds
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call["arguments"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert (done["name"], done["call_id"], done["arguments"], done["output_index"]) == ("get_weather", "call_a",
                                                                                       call["arguments"], 0)
    assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.delta") \
        < kinds.index("response.function_call_arguments.done") < kinds.index("response.output_item.done")
    # The engine got the tools in Chat Completions' shape, and the call is in the conversation.
    assert engine.asked[0]["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["parameters"]}}]
    assert engine.asked[0]["tool_choice"] == "auto"
    assert session.conversation.items[-1].call_id == "call_a"


@aio
async def test_an_output_goes_back_to_the_llm_after_its_call() -> None:
    engine = ScriptedEngine(call_pieces(0, "call_a", "get_weather", '{"city": "Paris"}'),
                            [TextDelta("It is sunny.", 4, "stop")])
    session, out = await session_with(engine)
    await ask(session, out, "Weather in Paris?")
    await session.handle(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call_output", "call_id": "call_a", "output": '{"sky": "sunny"}'}}))
    await session.handle(json.dumps({"type": "response.create"}))
    response = await until_done(session, out)

    assert [o["type"] for o in response["output"]] == ["message"]
    assert response["output"][0]["content"][0]["text"] == "It is sunny."
    assert engine.asked[1]["messages"] == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "sunny"}'}]


@aio
async def test_text_then_two_calls_keep_their_output_order() -> None:
    engine = ScriptedEngine([TextDelta("Checking both.", 3, None)]
                            + call_pieces(0, "call_a", "get_weather", '{"city": "Paris"}')
                            + call_pieces(1, "call_b", "get_weather", '{"city": "Rome"}') + [TextDelta("", 5, "stop")])
    session, out = await session_with(engine)
    response = await ask(session, out, "Paris and Rome?")

    assert [(o["type"], o.get("call_id")) for o in response["output"]] == [
        ("message", None), ("function_call", "call_a"), ("function_call", "call_b")]
    done = [e for e in of_response(out, response["id"]) if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], json.loads(e["arguments"])["city"]) for e in done] == [(1, "Paris"), (2, "Rome")]
    # In the history the calls join the assistant's message.
    messages = session.conversation.chat_messages("")
    assert messages[-1]["content"] == "Checking both."
    assert [c["id"] for c in messages[-1]["tool_calls"]] == ["call_a", "call_b"]


@aio
async def test_a_cancelled_call_ends_incomplete() -> None:
    gate = asyncio.Event()
    engine = ScriptedEngine(call_pieces(0, "call_a", "get_weather", '{"city": "Paris"}'), gate=gate)
    session, out = await session_with(engine)
    await session.handle(json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]}}))
    await session.handle(json.dumps({"type": "response.create"}))
    while not any(e["type"] == "response.output_item.added" for e in out):
        await asyncio.sleep(0.01)
    await session.handle(json.dumps({"type": "response.cancel"}))
    response = out[-1]["response"]

    assert out[-1]["type"] == "response.done" and response["status"] == "cancelled"
    assert [(o["type"], o["status"]) for o in response["output"]] == [("function_call", "incomplete")]
    sent = len(out)
    gate.set()  # the engine would go on: nothing of the cancelled response follows its done
    await asyncio.sleep(0.1)
    assert len(out) == sent


@aio
async def test_response_level_tools_and_choice_override_the_session() -> None:
    other = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    engine = ScriptedEngine([TextDelta("Noon.", 2, "stop")], [TextDelta("Hi.", 2, "stop")])
    session, out = await session_with(engine)
    await ask(session, out, "Time?", {"tools": [other], "tool_choice": {"type": "function", "name": "get_time"}})
    await ask(session, out, "Hello", {"tool_choice": "none"})

    assert [t["function"]["name"] for t in engine.asked[0]["tools"]] == ["get_time"]
    assert engine.asked[0]["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert engine.asked[1]["tool_choice"] == "none"


@aio
@pytest.mark.parametrize(("session", "param", "words"), [
    ({"tools": [{"type": "web_search"}]}, "session.tools[0].type", "must be 'function'"),
    ({"tools": [{"type": "function"}]}, "session.tools[0].name", "non-empty string"),
    ({"tools": [WEATHER, WEATHER]}, "session.tools[1].name", "declared twice"),
    ({"tools": [{**WEATHER, "parameters": "city"}]}, "session.tools[0].parameters", "JSON schema"),
    ({"tools": [{**WEATHER, "strict": True}]}, "session.tools[0].strict", "Unknown parameter"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "session.tool_choice", "must be one of"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "session.tool_choice.name",
     "not among the tools"),
    ({"tools": [], "tool_choice": "required"}, "session.tool_choice", "needs tools"),
])
async def test_bad_tools_are_refused_by_field_and_change_nothing(session, param, words) -> None:
    engine = ScriptedEngine()
    rt, out = await session_with(engine)
    await rt.handle(json.dumps({"type": "session.update", "event_id": "ev1", "session": session}))

    error = out[-1]
    assert error["type"] == "error" and error["error"]["param"] == param and words in error["error"]["message"]
    assert error["error"]["event_id"] == "ev1"
    assert rt.config.tools == [WEATHER] and rt.config.tool_choice == "auto"


@aio
async def test_a_server_without_a_tool_parser_refuses_tools() -> None:
    out: list[dict[str, Any]] = []
    session = RealtimeSession(ScriptedEngine(can_call_tools=False), out.append, model="m", vad_factory=None)
    await session.handle(json.dumps({"type": "session.update", "session": {"tools": [WEATHER]}}))
    assert out[-1]["error"]["param"] == "session.tools"
    assert "--enable-auto-tool-choice" in out[-1]["error"]["message"]
    await session.handle(json.dumps({"type": "response.create", "response": {"tools": [WEATHER]}}))
    assert out[-1]["error"]["param"] == "response.tools" and session.response is None


@aio
async def test_client_function_call_items_are_checked() -> None:
    session, out = await session_with(ScriptedEngine())
    await session.handle(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call", "call_id": "c1", "name": "get_weather"}}))
    assert out[-1]["type"] == "error" and out[-1]["error"]["param"] == "item.arguments"
    await session.handle(json.dumps({"type": "conversation.item.create", "item": {
        "type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}}))
    assert out[-1]["type"] == "conversation.item.done" and out[-1]["item"]["name"] == "get_weather"


def spoken(chunks: list[str]) -> list[str]:
    splitter = SpokenSentences([0], 1)
    sentences = [s.prompt for chunk in chunks for s in splitter.on_output(None, chunk)]  # type: ignore[arg-type]
    return sentences + [s.prompt for s in splitter.on_finish({}, {})]


@pytest.mark.parametrize(("chunks", "expected"), [
    (["Sure. Let me check.", "<tool", '_call>\n{"name": "x", "arguments": {}}\n</tool_', "call>", " Done. Bye"],
     ["Sure.", "Let me check.", "Done.", "Bye"]),
    (['{"na', 'me": "get_weather", "arguments": {"city": "Paris"}}\n', '{"name": "x"}'], []),
    (["```", 'json\n{"name": "f", "arguments": {}}\n```'], []),
    (["```python\nprint(1)\n```. Done."], ["```python\nprint(1)\n```.", "Done."]),
    (["{not a call. ", "Yes."], ["{not a call.", "Yes."]),
    (["\n", "Hello there. How", " are you?"], ["Hello there.", "How are you?"]),
    (["I will call it. [TOOL_CALLS] [{\"name\": \"x\"}]. More."], ["I will call it."]),
    (["a < b. Yes <", "3 indeed."], ["a < b.", "Yes <3 indeed."]),
])
def test_spoken_sentences_leave_tool_calls_out(chunks, expected) -> None:
    assert spoken(chunks) == expected


def test_a_streamed_sentence_ends_at_its_full_stop_without_waiting_for_the_next_token() -> None:
    splitter = SpokenSentences([0], 1)
    assert [s.prompt for s in splitter.on_output(None, "The capital is Paris")] == []  # type: ignore[arg-type]
    assert [s.prompt for s in splitter.on_output(None, ".")] == ["The capital is Paris."]  # type: ignore[arg-type]
    # Not after a number, a capital or a dotted abbreviation: the text may go on.
    assert spoken(["It is 3", ".", "5 m long", ". Mr", ".", "Smith too."]) == ["It is 3.5 m long.", "Mr.Smith too."]
    splitter = SpokenSentences([0], 1)
    assert [s.prompt for chunk in ("See e.g", ".") for s in splitter.on_output(None, chunk)] == []  # type: ignore[arg-type]


def test_spoken_sentences_of_a_whole_text() -> None:
    """In sequential mode the text goes whole, as SentenceSplitter sends it, less the call."""
    splitter = SpokenSentences([0], 1)
    [whole] = splitter.on_finish({}, {0: 'Hi. <tool_call>{"name": "x"}</tool_call> Bye.'})
    assert whole.prompt.split() == ["Hi.", "Bye."]


def fragments(chunks: list[str]) -> list[str]:
    splitter = spoken_fragments([0], 1)
    pieces = [s.prompt for chunk in chunks for s in splitter.on_output(None, chunk)]  # type: ignore[arg-type]
    return pieces + [s.prompt for s in splitter.on_finish({}, {})]


@pytest.mark.parametrize(("text", "expected"), [
    # No clause and no sentence end in the first 4 words: the first piece is those words, cut as the
    # 5th begins; the rest goes by whole sentences.
    ("The capital of France is Paris. It is a big city with many people in it.",
     ["The capital of France", "is Paris.", "It is a big city with many people in it."]),
    ("Sure, here it is. Then a longer sentence, with a comma.",
     ["Sure,", "here it is.", "Then a longer sentence, with a comma."]),  # a clause first
    ("Hi! How are you doing today, my friend?", ["Hi!", "How are you doing today, my friend?"]),  # a sentence first
    ("It costs 1,000 dollars and 10:30 is late.", ["It costs 1,000 dollars", "and 10:30 is late."]),  # not a clause
    ("Yes.", ["Yes."]),
])
def test_a_live_voice_s_first_piece_is_cut_early_and_the_rest_by_sentences(text, expected) -> None:
    by_token = [text[:1], *re.findall(r"\s*\S+", text[1:])]
    assert "".join(by_token) == text
    assert fragments(by_token) == expected  # streamed a word at a time
    assert fragments([text]) == expected    # or all at once: the same cuts
    assert split_sentences(text, first_fragment_words=4) == expected
    assert spoken([text]) == split_sentences(text)  # spoken_sentences keeps whole sentences


def test_fragments_leave_tool_calls_out_too() -> None:
    assert fragments(['<tool_call>{"name": "x"}</tool_call>', " I looked it up for you and it says", " rain."]) \
        == ["I looked it up", "for you and it says rain."]


@aio
async def test_an_audio_answer_s_transcript_is_what_its_pieces_say() -> None:
    """The speech stage says what each piece of audio speaks (a live voice's first piece is no
    sentence): the assistant item's transcript, and its truncation, go by those pieces."""
    rate = 1000
    text = "The capital of France is Paris. It is big."
    pieces = ["The capital of France", "is Paris.", "It is big."]
    engine = ScriptedEngine([TextDelta(text, 9, "stop"),
                             *(AudioChunk(np.zeros(rate, dtype=np.float32), rate, piece) for piece in pieces)])
    engine.can_speak = True
    session, out = await session_with(engine)
    response = await ask(session, out, "Where?", {"output_modalities": ["audio"]})
    item = response["output"][0]
    assert item["content"][0]["transcript"] == " ".join(pieces)
    # Heard 1.5 s of three 1 s pieces: the first piece only.
    await session.handle(json.dumps({"type": "conversation.item.truncate", "item_id": item["id"],
                                     "content_index": 0, "audio_end_ms": 1500}))
    await session.handle(json.dumps({"type": "conversation.item.retrieve", "item_id": item["id"]}))
    assert out[-1]["type"] == "conversation.item.retrieved"
    assert out[-1]["item"]["content"][0]["transcript"] == "The capital of France"


@aio
async def test_without_the_pieces_text_the_transcript_goes_by_sentences() -> None:
    rate = 1000
    engine = ScriptedEngine([TextDelta("One two. Three four.", 4, "stop"),
                             AudioChunk(np.zeros(rate, dtype=np.float32), rate),
                             AudioChunk(np.zeros(rate, dtype=np.float32), rate)])
    engine.can_speak = True
    session, out = await session_with(engine)
    response = await ask(session, out, "Count.", {"output_modalities": ["audio"]})
    assert response["output"][0]["content"][0]["transcript"] == "One two. Three four."


def test_bare_calls_get_their_tags() -> None:
    start, end = "<tool_call>", "</tool_call>"
    assert tag_bare_calls('{"name": "a", "arguments": {}}\n{"name": "b", "arg', start, end) \
        == f'{start}{{"name": "a", "arguments": {{}}}}{end}{start}{{"name": "b", "arg'
    assert tag_bare_calls('{"name": "a"} and then text', start, end) == f'{start}{{"name": "a"}}{end} and then text'


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path))


def stream(parser: HermesJsonToolParser, pieces: list[str]) -> tuple[str, list[tuple[int, str | None, str]]]:
    """Content and (index, name, arguments) as the parser streams them for ``pieces``."""
    content, calls, text = "", [], ""
    for piece in pieces:
        previous, text = text, text + piece
        delta = parser.extract_tool_calls_streaming(previous, text, piece, [], [], [], None)
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or ():
            calls.append((call.index, call.function.name, call.function.arguments or ""))
    return content, calls


def test_hermes_json_reads_bare_and_tagged_calls(tokenizer) -> None:
    bare = ['{"', 'name', '": "get_weather", "arguments": {"city": ', '"Paris"}}', '\n{"name": "f", ',
            '"arguments": {}}']
    content, calls = stream(HermesJsonToolParser(tokenizer), bare)
    assert content == ""
    assert [(i, n) for i, n, _ in calls if n] == [(0, "get_weather"), (1, "f")]
    assert json.loads("".join(a for i, _, a in calls if i == 0)) == {"city": "Paris"}

    tagged = ["Let me look. <tool_", 'call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>']
    content, calls = stream(HermesJsonToolParser(tokenizer), tagged)
    assert content == "Let me look. " and calls[0][1] == "get_weather"

    fenced = ["``", "`json\n{", '"name": "get_weather", "arguments": {"city": "Oslo"}}', "\n```"]
    content, calls = stream(HermesJsonToolParser(tokenizer), fenced)
    assert content == "" and calls[0][1] == "get_weather"
    assert json.loads("".join(a for _, _, a in calls)) == {"city": "Oslo"}

    content, calls = stream(HermesJsonToolParser(tokenizer), ["\n", "{", " Not", " a call."])
    assert content == "\n{ Not a call." and calls == []

    whole = HermesJsonToolParser(tokenizer).extract_tool_calls('{"name": "f", "arguments": {"x": 1}}', None)
    assert whole.tools_called and json.loads(whole.tool_calls[0].function.arguments) == {"x": 1}
