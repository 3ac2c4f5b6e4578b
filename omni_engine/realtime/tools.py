"""Function tools of a realtime session: checked in OpenAI's Realtime shape, rendered for chat.

A Realtime session declares tools flat (``{"type": "function", "name", "description",
"parameters"}``) and picks one with ``{"type": "function", "name"}``; the chat template and vLLM's
tool parsers take Chat Completions' nested shape (``{"type": "function", "function": {...}}``).
The conversation's function calls and their outputs become an assistant message with
``tool_calls`` and a ``tool`` message, as a chat client would send them.
"""

from __future__ import annotations

from typing import Any

from omni_engine.realtime.config import SessionConfigError

TOOL_CHOICES = ("auto", "none", "required")


def check_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """``tools`` as a list of function tools; ``SessionConfigError`` names the first field at fault."""
    if not isinstance(tools, list):
        raise SessionConfigError("tools must be a list of function tools", f"{where}.tools")
    names = set()
    for i, tool in enumerate(tools):
        at = f"{where}.tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            got = tool.get("type") if isinstance(tool, dict) else tool
            raise SessionConfigError(f"{at}.type must be 'function', got {got!r}", f"{at}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise SessionConfigError(f"{at}.name must be a non-empty string", f"{at}.name")
        if tool["name"] in names:
            raise SessionConfigError(f"{at}.name {tool['name']!r} is declared twice", f"{at}.name")
        names.add(tool["name"])
        if not isinstance(tool.get("description", ""), str):
            raise SessionConfigError(f"{at}.description must be a string", f"{at}.description")
        if not isinstance(tool.get("parameters", {}), dict):
            raise SessionConfigError(f"{at}.parameters must be a JSON schema object", f"{at}.parameters")
        if unknown := sorted(set(tool) - {"type", "name", "description", "parameters"}):
            raise SessionConfigError(f"Unknown parameter: '{at}.{unknown[0]}'.", f"{at}.{unknown[0]}")
    return tools


def check_tool_choice(choice: Any, tools: list[dict[str, Any]], where: str) -> None:
    """``choice`` is ``auto``/``none``/``required`` or names one of ``tools``."""
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise SessionConfigError(f"tool_choice must be one of {list(TOOL_CHOICES)} or "
                                     f"{{'type': 'function', 'name': ...}}, got {choice!r}", f"{where}.tool_choice")
        if choice == "required" and not tools:
            raise SessionConfigError("tool_choice 'required' needs tools", f"{where}.tool_choice")
        return
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise SessionConfigError("tool_choice must name a function as {'type': 'function', 'name': ...}",
                                 f"{where}.tool_choice")
    if choice["name"] not in {tool["name"] for tool in tools}:
        raise SessionConfigError(f"tool_choice names {choice['name']!r}, which is not among the tools",
                                 f"{where}.tool_choice.name")


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools in Chat Completions' shape."""
    return [{"type": "function", "function": {"name": tool["name"], "description": tool.get("description", ""),
                                              "parameters": tool.get("parameters") or {"type": "object",
                                                                                       "properties": {}}}}
            for tool in tools]


def chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """The tool choice in Chat Completions' shape."""
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice
