"""A chat rendered by a tokenizer's own chat template, and which characters are trained on.

:func:`render_with_template` gives the text of ``tokenizer.apply_chat_template(chat, tokenize=False)`` and the
character spans of its assistant turns, as :func:`~hybrid_pack.data.format_chat` defines them for ChatML: from
the end of the template's assistant header (its generation prompt) to the turn's last non-whitespace
character, its end-of-turn token included, the separator after it not.

Where the template renders the chat exactly as :func:`~hybrid_pack.data.format_chat` does (the Qwen3 template
and its ChatML kin), its spans are used. Otherwise each assistant turn ``i`` is located by rendering the chat's
first messages: its span opens where ``messages[:i]`` with the generation prompt ends and closes where
``messages[:i + 1]`` ends; both renders must be prefixes of the whole chat's text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybrid_pack.data.chat_format import Chat, RenderedChat, _messages_and_tools, format_chat
from hybrid_pack.errors import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["render_with_template"]


def render_with_template(chat: Chat, tokenizer: PreTrainedTokenizerBase) -> RenderedChat:
    """``chat`` rendered by ``tokenizer``'s chat template (no generation prompt), with its assistant spans.

    Args:
        chat: a list of messages, or a dict with ``"messages"`` (and optionally ``"tools"``, passed to the template).
        tokenizer: a ``transformers`` tokenizer with a ``chat_template``.

    Raises:
        InputError: the template renders the first messages of the chat differently from the start of the whole
            chat (so an assistant turn cannot be located), or the chat opens with an assistant turn.
    """
    messages, tools = _messages_and_tools(chat)

    def render(upto: int, generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages[:upto], tools=list(tools) if tools else None, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    text = render(len(messages))
    chatml = format_chat(chat)
    if chatml.text == text:
        return chatml
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise InputError("messages[0]: the chat opens with an assistant turn; the template's assistant header "
                             "is found by rendering the messages before it, and there are none")
        head, turn = render(i, generation_prompt=True), render(i + 1)
        for upto, prefix in ((i, head), (i + 1, turn)):
            if not text.startswith(prefix):
                raise InputError(f"chat template: messages[:{upto}] render differently from the start of the whole "
                                 f"chat (the template changes earlier turns once later ones follow), so assistant "
                                 f"turn {i} cannot be located; train on chats that end at that turn")
        if not turn.startswith(head):
            raise InputError(f"chat template: assistant turn {i} does not start with the template's generation "
                             f"prompt (messages[:{i}] with add_generation_prompt=True)")
        spans.append((len(head), len(turn.rstrip())))
    return RenderedChat(text, tuple(spans))

