"""Function tools over ``/v1/realtime`` with a real tool-calling LLM: Qwen2.5-Coder-0.5B behind
vLLM's chat rendering (the tools in its chat template) and the ``hermes_json`` tool parser, Whisper
before it and Piper after it, through the official ``openai`` client.

A spoken question that needs a tool becomes a ``function_call`` item whose arguments stream in; the
call is never spoken. The function's output goes back into the next prompt. A question that needs no
tool is answered aloud as usual. vLLM's own ``/v1/chat/completions`` parses the same calls.
(This 0.5B model answers a tool's output by calling the tool again, so what it says after an output
is not checked; that the output reached its prompt is.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from omni_engine.models.prepare import model_dir

from tests.realtime_helpers import aclient, events_until, of_type, silence, spoken, stream_audio
from tests.serve_helpers import assert_nothing_in_flight

pytestmark = [pytest.mark.llm, pytest.mark.asyncio(loop_scope="session")]

MODEL = "voice-tools"  # as the package's server serves it

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SESSION = {"type": "realtime", "tools": [WEATHER],
           "instructions": "You are a helpful voice assistant. Answer in one or two short sentences."}
NO_VAD = {"input": {"turn_detection": None}}


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def ask(conn, text: str, **response) -> list:
    await conn.conversation.item.create(item=user_text(text))
    await conn.response.create(**({"response": response} if response else {}))
    return await events_until(conn, "response.done")


async def test_a_spoken_question_calls_the_tool_and_nothing_of_the_call_is_spoken(server):
    question = spoken("What is the weather like in Paris right now?")
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.session.update(session=SESSION)
        await stream_audio(conn, np.concatenate([silence(0.5), question, silence(1.0)]))
        events = await events_until(conn, "response.done")

    heard, = of_type(events, "conversation.item.input_audio_transcription.completed")
    assert "paris" in heard.transcript.lower()
    done = of_type(events, "response.done")[-1].response
    assert done.status == "completed"
    call, = [item for item in done.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed" and call.call_id
    assert "paris" in json.loads(call.arguments)["city"].lower()
    deltas = [ev.delta for ev in of_type(events, "response.function_call_arguments.delta")]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments
    args_done, = of_type(events, "response.function_call_arguments.done")
    assert (args_done.call_id, args_done.name, args_done.arguments) == (call.call_id, "get_weather", call.arguments)
    # The call went to the client, not to the speaker: no audio, no transcript of it.
    assert not of_type(events, "response.output_audio.delta")
    assert all("{" not in ev.delta for ev in of_type(events, "response.output_audio_transcript.delta"))
    assert_nothing_in_flight(server)


async def test_the_function_output_goes_into_the_next_prompt(server):
    output = json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny", "wind_kmh": 12,
                         "forecast": "clear skies all afternoon with a light breeze from the west"})
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={**SESSION, "output_modalities": ["text"], "audio": NO_VAD})
        first = of_type(await ask(conn, "What is the weather like in Paris right now?"), "response.done")[-1].response
        call, = [item for item in first.output if item.type == "function_call"]
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": call.call_id,
                                                  "output": output})
        added = await events_until(conn, "conversation.item.created")
        await conn.response.create()
        second = of_type(await events_until(conn, "response.done"), "response.done")[-1].response

    assert of_type(added, "conversation.item.created")[-1].item.type == "function_call_output"
    assert second.status == "completed"
    # The second prompt is the first, then the call and its output as the chat template writes them.
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir("qwen2.5-coder-0.5b")))
    grown = second.usage.input_tokens - first.usage.input_tokens
    assert grown >= first.usage.output_tokens + len(tokenizer.encode(output)), (first.usage, second.usage)


async def test_a_question_without_a_tool_is_answered_aloud(server):
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={**SESSION, "audio": NO_VAD})
        events = await ask(conn, "Say hello to me in one short sentence.")
    done = of_type(events, "response.done")[-1].response
    assert done.status == "completed"
    assert [item.type for item in done.output] == ["message"]
    said = done.output[0].content[0].transcript
    assert said.strip() and "{" not in said
    assert len(of_type(events, "response.output_audio.delta")) >= 1


async def test_a_named_tool_choice_forces_that_call(server):
    async with aclient(server).realtime.connect(model=MODEL) as conn:
        await conn.session.update(session={**SESSION, "output_modalities": ["text"], "audio": NO_VAD})
        events = await ask(conn, "I fly to Rome tomorrow. Say hello to me.",
                           tool_choice={"type": "function", "name": "get_weather"})
    done = of_type(events, "response.done")[-1].response
    call, = done.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)


async def test_chat_completions_parse_the_same_calls(server):
    tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    reply = await aclient(server).chat.completions.create(model=MODEL, temperature=0, tools=[tool], messages=[
        {"role": "user", "content": "What is the weather like in Paris right now?"}])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert "paris" in json.loads(choice.message.tool_calls[0].function.arguments)["city"].lower()
    assert_nothing_in_flight(server)
