"""ChatML rendering with the Qwen3 chat template's semantics, and which characters are trained on.

:func:`format_chat` produces exactly the text of the ``chat_template`` in the bundled
``tokenizer_config.json`` (as rendered by ``transformers``' ``apply_chat_template``; a test checks
this on every bundled dataset), plus the character spans of the assistant turns: everything
after ``<|im_start|>assistant\\n`` up to and including ``<|im_end|>``, i.e. the reasoning block,
the answer and its tool calls. The system prompt, user turns, tool results and the newline
after each ``<|im_end|>`` are prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybrid_pack.errors import InputError

__all__ = ["Chat", "RenderedChat", "format_chat"]

Message = Mapping[str, Any]
Chat = Sequence[Message] | Mapping[str, Any]
"""A list of messages (``{"role", "content"}`` dicts), or a dict with ``"messages"`` and optional ``"tools"``."""

_ROLES = ("system", "user", "assistant", "tool")
_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)


@dataclass(frozen=True)
class RenderedChat:
    """A chat rendered to text.

    Attributes:
        text: the ChatML text (what ``apply_chat_template(..., tokenize=False)`` returns).
        assistant_spans: ``[start, stop)`` character ranges of ``text`` the model is trained on.
    """

    text: str
    assistant_spans: tuple[tuple[int, int], ...]


def format_chat(chat: Chat, *, tools: Sequence[Any] | None = None, empty_think: bool = True) -> RenderedChat:
    """Render ``chat`` like the Qwen3 chat template (no generation prompt).

    Args:
        chat: a list of messages, or a dict with ``"messages"`` (and optionally ``"tools"``).
            Roles: ``system`` / ``user`` / ``assistant`` / ``tool``; every ``content`` a string.
            Assistant messages may carry ``reasoning_content`` and ``tool_calls``
            (``{"name", "arguments"}`` or ``{"function": {...}}``).
        tools: tool schemas (JSON-serialisable); overrides ``chat["tools"]``.
        empty_think: the template opens an assistant turn after the last user query with a
            ``<think>`` block, empty (``<think>\\n\\n</think>\\n\\n``) when the message has no
            reasoning. ``False`` leaves the empty block out: plain ChatML, as counted by the
            bundled ``lengths/*.npz`` tables.
    """
    messages, chat_tools = _messages_and_tools(chat)
    tools = chat_tools if tools is None else tools
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    size = 0

    def emit(text: str, *, trained: bool = False) -> None:
        nonlocal size
        if trained and text:
            spans.append((size, size + len(text)))
        parts.append(text)
        size += len(text)

    first_is_system = messages[0]["role"] == "system"
    if tools:
        emit("<|im_start|>system\n" + (messages[0]["content"] + "\n\n" if first_is_system else "") + _TOOLS_HEADER)
        for tool in tools:
            emit("\n" + _to_json(tool))
        emit(_TOOLS_FOOTER)
    elif first_is_system:
        emit("<|im_start|>system\n" + messages[0]["content"] + "<|im_end|>\n")

    last_query = _last_query_index(messages)
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        is_last = i == len(messages) - 1
        if role == "user" or (role == "system" and i > 0):
            emit(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            emit("<|im_start|>assistant\n")
            body = _assistant_body(i, message, after_last_query=i > last_query, is_last=is_last,
                                   empty_think=empty_think)
            emit(body + "<|im_end|>", trained=True)
            emit("\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                emit("<|im_start|>user")
            emit(f"\n<tool_response>\n{content}\n</tool_response>")
            if is_last or messages[i + 1]["role"] != "tool":
                emit("<|im_end|>\n")
    return RenderedChat("".join(parts), tuple(spans))


def _messages_and_tools(chat: Chat) -> tuple[list[Message], Sequence[Any] | None]:
    """The checked message list and the tools of ``chat``."""
    if isinstance(chat, Mapping):
        if "messages" not in chat:
            raise InputError(f"chat: expected a 'messages' key (a list of {{'role', 'content'}} dicts); "
                             f"got keys {sorted(chat)}")
        messages, tools = chat["messages"], chat.get("tools")
    else:
        messages, tools = chat, None
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or len(messages) == 0:
        raise InputError("messages: expected a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in _ROLES:
            role = message.get("role") if isinstance(message, Mapping) else None
            raise InputError(f"messages[{i}].role: expected one of {list(_ROLES)}; got {role!r}")
        if not isinstance(message.get("content"), str):
            raise InputError(f"messages[{i}].content: expected a string; got {type(message.get('content')).__name__} "
                             f"(use \"\" for an assistant turn that only calls tools)")
    return list(messages), tools


def _last_query_index(messages: list[Message]) -> int:
    """Index of the last user message that is not a wrapped tool response (else the last index)."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        content = message["content"]
        if message["role"] == "user" and not (content.startswith("<tool_response>")
                                              and content.endswith("</tool_response>")):
            return i
    return len(messages) - 1


def _assistant_body(index: int, message: Message, *, after_last_query: bool, is_last: bool,
                    empty_think: bool) -> str:
    """The text of assistant message ``index`` between ``<|im_start|>assistant\\n`` and ``<|im_end|>``."""
    content = message["content"]
    reasoning = message.get("reasoning_content")
    if reasoning is None:
        reasoning = ""
        if "</think>" in content:
            before, _, _ = content.partition("</think>")
            content = content.split("</think>")[-1].lstrip("\n")
            reasoning = before.rstrip("\n").split("<think>")[-1].lstrip("\n")
    if after_last_query and (reasoning or (is_last and empty_think)):
        body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
    else:
        body = content
    for j, call in enumerate(message.get("tool_calls") or ()):
        if j > 0 or content:
            body += "\n"
        call = call.get("function") or call
        if "name" not in call or "arguments" not in call:
            raise InputError(f"messages[{index}].tool_calls[{j}]: expected 'name' and 'arguments' "
                             f"(or a 'function' dict holding them); got keys {sorted(call)}")
        arguments = call["arguments"]
        body += ('<tool_call>\n{"name": "' + str(call["name"]) + '", "arguments": '
                 + (arguments if isinstance(arguments, str) else _to_json(arguments)) + "}\n</tool_call>")
    return body


def _to_json(value: Any) -> str:
    """JSON as the template's ``tojson`` filter writes it in ``transformers`` (no HTML escaping, keys in order)."""
    return json.dumps(value, ensure_ascii=False)
