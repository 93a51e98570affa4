"""Training data: chats (or tokenized rows) -> features that fit a packed row, in the model's vocabulary.

Chats are rendered and tokenized by a model's own tokenizer and chat template when there is one (ids untouched),
else by the bundled Qwen3 tokenizer, remapped to a compact vocabulary for a model with fewer ids.

Nothing is lost silently: :func:`prepare_data` counts every example cut to ``capacity``, split into
pieces, or left out (with the reason) in a :class:`DataReport`, which ``hybrid-pack train`` writes to
``metrics.json`` and names in its summary.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import TYPE_CHECKING, Any

from hybrid_pack.data import load_chat_tokenizer, load_gsm8k, tokenize_chats, tokenize_with_template
from hybrid_pack.errors import InputError
from hybrid_pack.modeling.vocab import VocabRemap
from hybrid_pack.packing.plan import OVERFLOW_POLICIES
from hybrid_pack.packing.slicing import slice_example
from hybrid_pack.schema import IGNORE_INDEX, INPUT_IDS, LABELS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKENIZER_VOCAB = 151_669
BUNDLED_TOKENIZER = "qwen3 (bundled)"
"""``DataReport.tokenizer`` when the bundled Qwen3 tokenizer made the ids."""

DROP_REASONS = {
    "one_token": "one token (nothing to predict)",
    "no_targets": "no target token (no assistant turn, or every label -100)",
    "longer_than_capacity": "longer than --capacity (--overflow drop)",
}
"""Why an example is left out: the keys of ``dropped_examples_by_reason``, and their meaning."""


def _utf8_lines(file: Iterable[str], name: str) -> Iterator[str]:
    """The lines of a text file opened as UTF-8; InputError naming ``name`` when its bytes are not UTF-8."""
    try:
        yield from file
    except UnicodeDecodeError as err:
        raise InputError(f"data: {name} is not UTF-8 text ({err.reason}); expected a JSONL file saved as UTF-8"
                         ) from None


def load_chats(data: str, max_examples: int | None = None) -> list[dict[str, Any]]:
    """``"gsm8k"`` (bundled train split) or a JSONL file, one example per line: a chat
    (``{"messages": [...]}``) or a tokenized example in the training tokenizer's ids (``{"input_ids": [...]}``,
    optionally ``"labels"``)."""
    if data == "gsm8k":
        chats = load_gsm8k("train")
    else:
        chats = []
        with open(data, encoding="utf-8") as f:
            for number, line in enumerate(_utf8_lines(f, data), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise InputError(f"data: line {number} of {data} is not JSON ({err.msg}, column {err.colno}); "
                                     'expected one {"messages": [...]} or {"input_ids": [...]} object per line'
                                     ) from None
                if not isinstance(row, dict) or not (isinstance(row.get("messages"), list)
                                                     or isinstance(row.get(INPUT_IDS), list)):
                    raise InputError(f"data: line {number} of {data} has no 'messages' or 'input_ids' list; expected "
                                     'one {"messages": [{"role": ..., "content": ...}, ...]} or {"input_ids": [...]} '
                                     "object per line")
                chats.append(row)
        if not chats:
            raise InputError(f"data: {data} holds no chats")
    return chats[:max_examples]


@dataclass
class DataReport:
    """What the data lost on the way to the packed rows, and which tokenizer made its ids.

    Attributes:
        examples: examples read.
        documents: documents trained on (examples kept, each piece of a split example counted).
        truncated_examples: examples cut to ``capacity`` (``overflow="truncate"``).
        split_examples: examples cut into pieces of at most ``capacity`` (``overflow="split"``).
        dropped_examples_by_reason: examples (or, under split, pieces) left out, by :data:`DROP_REASONS` key.
        examples_without_targets: of those, the ones of two or more tokens with no target token
            (``dropped_examples_by_reason["no_targets"]``).
        tokenizer: the folder whose tokenizer made the ids, or :data:`BUNDLED_TOKENIZER`.
    """

    examples: int = 0
    documents: int = 0
    truncated_examples: int = 0
    split_examples: int = 0
    dropped_examples_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    tokenizer: str = BUNDLED_TOKENIZER

    @property
    def dropped_examples(self) -> int:
        return sum(self.dropped_examples_by_reason.values())

    @property
    def examples_without_targets(self) -> int:
        return self.dropped_examples_by_reason["no_targets"]

    def to_metrics(self) -> dict[str, Any]:
        return {"examples": self.examples, "documents": self.documents,
                "truncated_examples": self.truncated_examples, "split_examples": self.split_examples,
                "dropped_examples": self.dropped_examples,
                "dropped_examples_by_reason": dict(self.dropped_examples_by_reason),
                "examples_without_targets": self.examples_without_targets, "tokenizer": self.tokenizer}


@dataclass
class TrainingData:
    """Features ready for the sampler and collator (``{"input_ids", "labels"}`` lists of ints, each at most
    ``capacity`` tokens with at least one target), the vocabulary remap (None when the model covers the
    tokenizer's vocabulary), what was lost on the way, and the model's own tokenizer (None: the bundled one)."""

    features: list[dict[str, list[int]]]
    remap: VocabRemap | None
    report: DataReport
    tokenizer: PreTrainedTokenizerBase | None = None


def prepare_data(rows: Sequence[dict[str, Any]], vocab_size: int, *, capacity: int, overflow: str = "error",
                 tokenizer: str | PathLike[str] | PreTrainedTokenizerBase | None = None) -> TrainingData:
    """Tokenize ``rows`` (chats rendered, prompts masked; tokenized rows as given), fit every example to
    ``capacity`` as ``overflow`` says (:func:`~hybrid_pack.plan_packs`' policies: ``"error"``, ``"truncate"``,
    ``"split"``, ``"drop"``) and leave out the ones with nothing to learn from.

    With ``tokenizer`` (a ``transformers`` tokenizer, or the folder ``AutoTokenizer.from_pretrained`` reads it
    from: the model's own), chats are rendered by its chat template and its ids are kept as they are. Without,
    chats are rendered as Qwen3 ChatML by the bundled Qwen3 tokenizer and, for a model with a smaller vocabulary,
    remapped to the ``vocab_size - 1`` most frequent ids.

    Raises:
        InputError: ``overflow="error"`` and an example is longer than ``capacity`` (the message names it); with
            ``tokenizer``, an id outside the model's ``vocab_size``.
    """
    if overflow not in OVERFLOW_POLICIES:
        raise InputError(f"overflow: expected one of {', '.join(map(repr, OVERFLOW_POLICIES))}; got {overflow!r}")
    if isinstance(tokenizer, (str, PathLike)):
        tokenizer = load_chat_tokenizer(tokenizer)
    report = DataReport(examples=len(rows))
    if tokenizer is not None:
        report.tokenizer = str(tokenizer.name_or_path)
    features = []
    examples = _tokenize(rows, tokenizer, vocab_size)
    if tokenizer is not None:
        _check_in_vocabulary(examples, vocab_size, report.tokenizer)
    for index, example in enumerate(examples):
        for document in _fit(index, example, capacity, overflow, report):
            reason = _drop_reason(document)
            if reason is None:
                features.append(document)
            else:
                report.dropped_examples_by_reason[reason] += 1
    report.documents = len(features)
    if not features:
        raise InputError(f"data: no example left to train on ({report.dropped_examples_by_reason})")
    if tokenizer is not None or vocab_size >= TOKENIZER_VOCAB:
        return TrainingData(features, None, report, tokenizer)
    remap = VocabRemap.from_corpus((f[INPUT_IDS] for f in features), size=vocab_size)
    return TrainingData([remap.encode_example(f) for f in features], remap, report)


def build_features(chats: list[dict[str, Any]], vocab_size: int, *, max_length: int, overflow: str = "truncate",
                   tokenizer: str | PathLike[str] | PreTrainedTokenizerBase | None = None
                   ) -> tuple[list[dict], VocabRemap | None]:
    """``(features, remap)`` of :func:`prepare_data` with ``capacity=max_length``; examples are cut to
    ``max_length`` unless ``overflow`` says otherwise. :func:`prepare_data` also counts what was lost."""
    data = prepare_data(chats, vocab_size, capacity=max_length, overflow=overflow, tokenizer=tokenizer)
    return data.features, data.remap


def _tokenize(rows: Sequence[dict[str, Any]], tokenizer: PreTrainedTokenizerBase | None,
              vocab_size: int) -> list[dict[str, list[int]]]:
    """Chats rendered and tokenized in one batch (by ``tokenizer``'s chat template, or as Qwen3 ChatML);
    tokenized rows checked (Qwen3 ids, or with ``tokenizer`` ids below the model's ``vocab_size``) and kept, in
    the order given."""
    chats = [i for i, row in enumerate(rows) if INPUT_IDS not in row]
    chat_rows = [rows[i] for i in chats]
    features = tokenize_chats(chat_rows) if tokenizer is None else tokenize_with_template(chat_rows, tokenizer)
    tokenized = dict(zip(chats, features, strict=True))
    ids = ("Qwen3 token ids", TOKENIZER_VOCAB) if tokenizer is None else ("ids of the model's vocabulary", vocab_size)
    return [tokenized[i] if i in tokenized else _tokenized_row(i, row, *ids) for i, row in enumerate(rows)]


def _check_in_vocabulary(examples: Sequence[dict[str, list[int]]], vocab_size: int, tokenizer: str) -> None:
    """Every id of ``examples`` (in ``tokenizer``'s ids) is a row of the model's embedding."""
    for index, example in enumerate(examples):
        largest = max(example[INPUT_IDS], default=0)
        if largest >= vocab_size:
            raise InputError(f"tokenizer: example {index} holds id {largest} of the tokenizer in {tokenizer!r}, "
                             f"outside the model's vocabulary of {vocab_size} ids (config.vocab_size); give the "
                             f"model the tokenizer it was trained with (--tokenizer PATH)")


def _tokenized_row(index: int, row: dict[str, Any], which: str, vocab: int) -> dict[str, list[int]]:
    ids, labels = row[INPUT_IDS], row.get(LABELS, row[INPUT_IDS])
    for key, values, ignored in ((INPUT_IDS, ids, ()), (LABELS, labels, (IGNORE_INDEX,))):
        if not isinstance(values, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and (0 <= t < vocab or t in ignored) for t in values):
            also = f", or {IGNORE_INDEX} for a token without a target" if ignored else ""
            raise InputError(f"data[{index}].{key}: expected a list of {which} (ints in [0, {vocab}){also}); got "
                             f"{_first_bad(values, vocab, ignored)}")
    if len(labels) != len(ids):
        raise InputError(f"data[{index}].{LABELS}: expected {len(ids)} labels (one per input id); got {len(labels)}")
    return {INPUT_IDS: list(ids), LABELS: list(labels)}


def _first_bad(values: Any, vocab: int, ignored: tuple[int, ...]) -> str:
    """What a person should look at: the type of ``values`` when not a list, else its first bad entry."""
    if not isinstance(values, (list, tuple)):
        return f"{type(values).__name__} {values!r:.40}"
    position, value = next((i, t) for i, t in enumerate(values) if not isinstance(t, int) or isinstance(t, bool)
                           or not (0 <= t < vocab or t in ignored))
    return f"{value!r} at position {position}"


def _fit(index: int, example: dict[str, list[int]], capacity: int, overflow: str,
         report: DataReport) -> list[dict[str, list[int]]]:
    """The documents ``example`` becomes under ``overflow``, counted in ``report``."""
    length = len(example[INPUT_IDS])
    if length <= capacity:
        return [example]
    if overflow == "error":
        raise InputError(f"data: example {index} (counting from 0) has {length} tokens, more than --capacity "
                         f"{capacity}; pass --overflow truncate, split or drop (overflow=...), or raise --capacity")
    if overflow == "drop":
        report.dropped_examples_by_reason["longer_than_capacity"] += 1
        return []
    if overflow == "truncate":
        report.truncated_examples += 1
        return [slice_example(example, 0, capacity)]
    report.split_examples += 1
    return [slice_example(example, start, min(start + capacity, length)) for start in range(0, length, capacity)]


def _drop_reason(document: dict[str, list[int]]) -> str | None:
    """Why ``document`` trains nothing (a :data:`DROP_REASONS` key), or None. Its first token is never a target:
    the collator puts the separator there."""
    if len(document[INPUT_IDS]) == 1:
        return "one_token"
    if all(label == IGNORE_INDEX for label in document[LABELS][1:]):
        return "no_targets"
    return None
