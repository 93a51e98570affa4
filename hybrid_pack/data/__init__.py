"""Offline data bundled with hybrid_pack: the Qwen3 tokenizer, chat datasets and their token lengths.

``load_gsm8k`` / ``load_toolcall_chats`` / ``load_arena_hard_chats`` -> chats; ``format_chat``
renders one like the Qwen3 chat template; ``tokenize_chats`` turns chats into the
``{"input_ids", "labels"}`` features :class:`~hybrid_pack.PackingCollator` takes, with every
non-assistant token masked to -100; ``tokenize_with_template`` does the same with a model's own
tokenizer and chat template (``load_chat_tokenizer``). See docs/data.md.
"""

from hybrid_pack.data.chat_format import Chat, RenderedChat, format_chat
from hybrid_pack.data.chat_template import render_with_template
from hybrid_pack.data.loaders import (
    ASSETS_DIR,
    LENGTH_TABLES,
    load_arena_hard_chats,
    load_gsm8k,
    load_lengths,
    load_toolcall_chats,
)
from hybrid_pack.data.tokenize import tokenize_chats, tokenize_with_template
from hybrid_pack.data.tokenizer import (
    QWEN3_DIR,
    TOKENIZER_FILES,
    has_tokenizer,
    load_chat_tokenizer,
    load_hf_tokenizer,
    load_tokenizer,
    save_tokenizer,
)

__all__ = [
    "ASSETS_DIR",
    "LENGTH_TABLES",
    "QWEN3_DIR",
    "TOKENIZER_FILES",
    "Chat",
    "RenderedChat",
    "format_chat",
    "has_tokenizer",
    "load_arena_hard_chats",
    "load_chat_tokenizer",
    "load_gsm8k",
    "load_hf_tokenizer",
    "load_lengths",
    "load_tokenizer",
    "load_toolcall_chats",
    "render_with_template",
    "save_tokenizer",
    "tokenize_chats",
    "tokenize_with_template",
]
