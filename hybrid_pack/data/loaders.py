"""Loaders for the bundled datasets, as chats :func:`~hybrid_pack.data.format_chat` takes.

Every loader reads the gzipped files under ``hybrid_pack/data/assets`` (no network) and returns
a list of dicts with ``"messages"`` (``[{"role", "content"}, ...]``), plus ``"tools"`` where the
chat declares tools and the source's own fields where useful.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

from hybrid_pack.errors import InputError

__all__ = ["ASSETS_DIR", "LENGTH_TABLES", "load_arena_hard_chats", "load_gsm8k", "load_lengths",
           "load_toolcall_chats"]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"

LENGTH_TABLES = ("gsm8k_train", "gsm8k_test", "arena_hard_v2_sky_t1_32b")
"""Names :func:`load_lengths` takes."""

_GLAIVE_ROLES = {"human": "user", "gpt": "assistant", "function_call": "assistant", "observation": "tool"}


def load_gsm8k(split: str = "train") -> list[dict[str, Any]]:
    """GSM8K (OpenAI grade-school maths; MIT): 7,473 ``"train"`` / 1,319 ``"test"`` problems.

    Each item: ``question``, ``answer`` (worked solution ending in ``#### <number>``) and
    ``messages`` = the question as the user turn, the answer as the assistant turn.
    """
    if split not in ("train", "test"):
        raise InputError(f"split: expected 'train' or 'test'; got {split!r}")
    with gzip.open(ASSETS_DIR / "gsm8k" / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{"question": row["question"], "answer": row["answer"],
             "messages": [{"role": "user", "content": row["question"]},
                          {"role": "assistant", "content": row["answer"]}]} for row in rows]


def load_toolcall_chats() -> list[dict[str, Any]]:
    """300 multi-turn tool-calling chats (glaive-function-calling demo from LLaMA-Factory; Apache-2.0).

    ``function_call`` turns become assistant messages with ``tool_calls`` (content ``""``),
    ``observation`` turns become ``tool`` messages; ``tools`` (OpenAI-style
    ``{"type": "function", "function": schema}``) is present when the chat declares any.
    """
    with gzip.open(ASSETS_DIR / "glaive_toolcall" / "glaive_toolcall_en_demo.json.gz", "rt", encoding="utf-8") as f:
        rows = json.load(f)
    chats = []
    for row in rows:
        messages = []
        for turn in row["conversations"]:
            if turn["from"] == "function_call":
                messages.append({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": json.loads(turn["value"])}]})
            else:
                messages.append({"role": _GLAIVE_ROLES[turn["from"]], "content": turn["value"]})
        chat: dict[str, Any] = {"messages": messages}
        tools = json.loads(row["tools"]) if row["tools"] else []
        if tools:
            chat["tools"] = [{"type": "function", "function": tool} for tool in tools]
        chats.append(chat)
    return chats


def load_arena_hard_chats() -> list[dict[str, Any]]:
    """748 Arena-Hard v2.0 prompts with Sky-T1-32B's long answers (lmarena/arena-hard-auto; Apache-2.0).

    Multilingual single-turn chats whose answers run to 8.6k tokens: the long tail for packing.
    Each item: ``uid`` and ``messages``.
    """
    with gzip.open(ASSETS_DIR / "arena_hard" / "sky-t1-32b.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{"uid": row["uid"], "messages": [
        {"role": message["role"],
         "content": message["content"]["answer"] if isinstance(message["content"], dict) else message["content"]}
        for message in row["messages"]]} for row in rows]


def load_lengths(name: str) -> dict[str, np.ndarray]:
    """Precomputed Qwen3 token counts of a bundled dataset, int32 ``[num_examples]`` each.

    Keys: ``full_chatml`` (the whole chat as plain ChatML, i.e.
    ``tokenize_chats(chats, empty_think=False)`` lengths), ``last_turn_prompt`` (everything up to
    and including ``<|im_start|>assistant\\n``) and ``last_turn_response`` (the answer,
    ``<|im_end|>`` and the final newline). ``name``: one of :data:`LENGTH_TABLES`.
    """
    if name not in LENGTH_TABLES:
        raise InputError(f"name: expected one of {list(LENGTH_TABLES)}; got {name!r}")
    with np.load(ASSETS_DIR / "lengths" / f"{name}.qwen3_lengths.npz") as table:
        return {key: table[key] for key in table.files}
