"""Chats -> ``{"input_ids", "labels"}`` features for :class:`~hybrid_pack.PackingCollator`: rendered as Qwen3
ChatML (:func:`tokenize_chats`) or by a tokenizer's own chat template (:func:`tokenize_with_template`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from hybrid_pack.data.chat_format import Chat, RenderedChat, format_chat
from hybrid_pack.data.chat_template import render_with_template
from hybrid_pack.data.tokenizer import load_tokenizer
from hybrid_pack.errors import InputError
from hybrid_pack.schema import IGNORE_INDEX, INPUT_IDS, LABELS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["tokenize_chats", "tokenize_with_template"]


def tokenize_chats(
    chats: Sequence[Chat],
    tokenizer: Tokenizer | None = None,
    max_length: int | None = None,
    *,
    empty_think: bool = True,
) -> list[dict[str, list[int]]]:
    """Render every chat with :func:`~hybrid_pack.data.format_chat` and tokenize them in one batch.

    Args:
        chats: lists of messages, or dicts with ``"messages"`` (and optionally ``"tools"``).
        tokenizer: a ``tokenizers.Tokenizer`` knowing the ChatML special tokens; defaults to the
            bundled Qwen3 one (:func:`~hybrid_pack.data.load_tokenizer`).
        max_length: keep at most this many tokens of each chat (its start); None keeps all.
        empty_think: passed to :func:`~hybrid_pack.data.format_chat`.

    Returns:
        One dict per chat: ``input_ids`` (the template's text tokenized without added special
        tokens, as ``apply_chat_template(..., tokenize=True)`` gives) and ``labels``: the token id
        where the token overlaps an assistant span, ``-100`` elsewhere.
    """
    _check_max_length(max_length)
    tokenizer = load_tokenizer() if tokenizer is None else tokenizer
    if tokenizer.padding is not None or tokenizer.truncation is not None:
        raise InputError("tokenizer: expected padding and truncation off (they would change the ids); call "
                         "tokenizer.no_padding() and tokenizer.no_truncation(), or use max_length here")
    rendered = [format_chat(chat, empty_think=empty_think) for chat in chats]
    encodings = tokenizer.encode_batch([chat.text for chat in rendered], add_special_tokens=False)
    return [_feature(chat, encoding.ids, encoding.offsets, max_length) for chat, encoding in zip(rendered, encodings)]


def tokenize_with_template(chats: Sequence[Chat], tokenizer: PreTrainedTokenizerBase,
                           max_length: int | None = None) -> list[dict[str, list[int]]]:
    """Render every chat with ``tokenizer``'s own chat template
    (:func:`~hybrid_pack.data.chat_template.render_with_template`) and tokenize them in one batch.

    Args:
        chats: lists of messages, or dicts with ``"messages"`` (and optionally ``"tools"``).
        tokenizer: a fast ``transformers`` tokenizer with a ``chat_template`` (it gives the token offsets).
        max_length: keep at most this many tokens of each chat (its start); None keeps all.

    Returns:
        One dict per chat: ``input_ids`` (what ``tokenizer.apply_chat_template(chat)`` gives) and ``labels``: the
        token id where the token overlaps an assistant span, ``-100`` elsewhere.
    """
    _check_max_length(max_length)
    if not tokenizer.is_fast:
        raise InputError(f"tokenizer: expected a fast tokenizer (its token offsets locate the assistant turns); got "
                         f"{type(tokenizer).__name__}; save the folder's tokenizer with a tokenizer.json")
    rendered = [render_with_template(chat, tokenizer) for chat in chats]
    encodings = tokenizer([chat.text for chat in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [_feature(chat, ids, offsets, max_length)
            for chat, ids, offsets in zip(rendered, encodings[INPUT_IDS], encodings["offset_mapping"], strict=True)]


def _check_max_length(max_length: int | None) -> None:
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise InputError(f"max_length: expected a positive int or None; got {max_length!r}")


def _feature(chat: RenderedChat, ids: Sequence[int], offsets: Sequence[tuple[int, int]],
             max_length: int | None) -> dict[str, list[int]]:
    """The first ``max_length`` tokens of ``chat``, and their labels (-100 outside its assistant spans)."""
    input_ids = np.asarray(ids, dtype=np.int64)[:max_length]
    labels = np.where(_trained_tokens(chat, offsets)[:max_length], input_ids, IGNORE_INDEX)
    return {INPUT_IDS: input_ids.tolist(), LABELS: labels.tolist()}


def _trained_tokens(chat: RenderedChat, offsets: Sequence[tuple[int, int]]) -> np.ndarray:
    """bool ``[num_tokens]``: whether each token's characters (``[start, stop)`` offsets) overlap an assistant span
    of ``chat``."""
    edges = np.zeros(len(chat.text) + 1, dtype=np.int64)
    for start, stop in chat.assistant_spans:
        edges[start] += 1
        edges[stop] -= 1
    trained_before = np.zeros(len(chat.text) + 1, dtype=np.int64)
    np.cumsum(np.cumsum(edges[:-1]) > 0, out=trained_before[1:])
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    return trained_before[offsets[:, 1]] > trained_before[offsets[:, 0]]
