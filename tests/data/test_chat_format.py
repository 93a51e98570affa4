"""format_chat: ChatML equal to the real chat template, on every branch of it and on the bundled chats."""

from __future__ import annotations

import pytest

from hybrid_pack.data import format_chat, tokenize_chats
from tests.data.chats import TEMPLATE_CASES, TEMPLATE_TOOLS


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
@pytest.mark.parametrize("with_tools", [False, True])
def test_format_chat_equals_the_chat_template(case: str, with_tools: bool, hf_tokenizer) -> None:
    messages = TEMPLATE_CASES[case]
    tools = TEMPLATE_TOOLS if with_tools else None
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert format_chat(messages, tools=tools).text == expected
    assert format_chat({"messages": messages, "tools": tools}).text == expected


def test_bundled_chats_render_and_tokenize_like_the_template(gsm8k_train, toolcall_chats, arena_chats,
                                                            hf_tokenizer) -> None:
    chats = gsm8k_train[:20] + toolcall_chats + arena_chats[:20]
    for chat in chats:
        expected = hf_tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=False)
        assert format_chat(chat).text == expected
    sample = gsm8k_train[:5] + toolcall_chats[:10] + arena_chats[:5]
    features = tokenize_chats(sample)
    for chat, feature in zip(sample, features):
        expected_ids = hf_tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"),
                                                        tokenize=True, return_dict=True)["input_ids"]
        assert feature["input_ids"] == expected_ids


def test_empty_think_false_is_plain_chatml() -> None:
    messages = TEMPLATE_CASES["single turn"]
    assert format_chat(messages).text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    assert format_chat(messages, empty_think=False).text == \
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    with_reasoning = [messages[0], {**messages[1], "reasoning_content": "r"}]
    assert "<think>\nr\n</think>" in format_chat(with_reasoning, empty_think=False).text


@pytest.mark.parametrize(("chat", "message"), [
    ([], r"messages: expected a non-empty list"),
    ({"conversations": []}, r"chat: expected a 'messages' key"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\]\.role: expected one of"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
     r"messages\[1\]\.content: expected a string"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
     r"messages\[1\]\.tool_calls\[0\]: expected 'name' and 'arguments'"),
])
def test_format_chat_rejects_malformed_chats(chat, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        format_chat(chat)
