"""Offline data bundled with hybrid_pack: the Qwen3 tokenizer, chat datasets and their token lengths.

``load_gsm8k`` / ``load_toolcall_chats`` / ``load_arena_hard_chats`` -> chats; ``format_chat``
renders one like the Qwen3 chat template; ``tokenize_chats`` turns chats into the
``{"input_ids", "labels"}`` features :class:`~hybrid_pack.PackingCollator` takes, with every
non-assistant token masked to -100. See docs/data.md.
"""

from hybrid_pack.data.chat_format import Chat, RenderedChat, format_chat
from hybrid_pack.data.loaders import (
    ASSETS_DIR,
    LENGTH_TABLES,
    load_arena_hard_chats,
    load_gsm8k,
    load_lengths,
    load_toolcall_chats,
)
from hybrid_pack.data.tokenize import tokenize_chats
from hybrid_pack.data.tokenizer import QWEN3_DIR, load_hf_tokenizer, load_tokenizer, save_tokenizer

__all__ = [
    "ASSETS_DIR",
    "LENGTH_TABLES",
    "QWEN3_DIR",
    "Chat",
    "RenderedChat",
    "format_chat",
    "load_arena_hard_chats",
    "load_gsm8k",
    "load_hf_tokenizer",
    "load_lengths",
    "load_tokenizer",
    "load_toolcall_chats",
    "save_tokenizer",
    "tokenize_chats",
]
