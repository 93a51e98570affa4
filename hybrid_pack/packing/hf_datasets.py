"""Tokenize a Hugging Face ``datasets.Dataset`` and plan its packs, in bounded memory.

:func:`tokenize_and_plan` maps a tokenizer over the dataset with ``Dataset.map`` (batched,
``num_proc`` worker processes, results written to Arrow files on disk and memory-mapped back),
adds a ``length`` column, reads that one column as a numpy array and plans the packs. Host memory
therefore holds one tokenizer batch per worker, the lengths (4 bytes per example) and the plan
(about 24 bytes per document), never the token ids of the whole dataset. The result feeds
``DataLoader(result.dataset, batch_sampler=PackedBatchSampler(result.lengths, capacity, ...),
collate_fn=PackingCollator())``.

For bounded memory the dataset must live on disk (``load_dataset``, ``Dataset.from_generator``,
``load_from_disk``) or ``cache_file_name`` must be given: ``map`` over an in-memory dataset keeps
its output in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.packing.plan import PackPlan, check_plan_settings, plan_packs
from hybrid_pack.schema import INPUT_IDS

if TYPE_CHECKING:
    import datasets

__all__ = ["TokenizedPlan", "tokenize_and_plan"]


class TokenizedPlan(NamedTuple):
    """What :func:`tokenize_and_plan` returns.

    Attributes:
        dataset: the tokenized ``datasets.Dataset``: the input's columns minus the text column, plus
            ``input_ids`` (int32 lists) and ``length`` (int32).
        lengths: int64 ``[N]``, token count of every example (the ``length`` column).
        plan: the :class:`~hybrid_pack.PackPlan` of ``lengths``.
    """

    dataset: datasets.Dataset
    lengths: np.ndarray
    plan: PackPlan


class _TokenizeBatch:
    """Picklable ``Dataset.map`` function: a batch of texts -> ``input_ids`` and ``length``."""

    def __init__(self, tokenizer: Any, text_column: str) -> None:
        self.tokenizer = tokenizer
        self.text_column = text_column

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        texts = batch[self.text_column]
        if hasattr(self.tokenizer, "encode_batch"):
            ids = [encoding.ids for encoding in self.tokenizer.encode_batch(texts)]
        else:
            out = self.tokenizer(texts)
            ids = out[INPUT_IDS] if isinstance(out, Mapping) else out
        return {INPUT_IDS: ids, "length": [len(x) for x in ids]}


def tokenize_and_plan(
    dataset: datasets.Dataset,
    tokenizer: Any | Callable[[list[str]], Sequence[Sequence[int]]],
    capacity: int,
    *,
    text_column: str = "text",
    num_proc: int | None = None,
    batch_size: int = 1000,
    strategy: str = "bfd",
    overflow: str = "error",
    cache_file_name: str | None = None,
) -> TokenizedPlan:
    """Tokenize ``dataset[text_column]`` and plan packs of at most ``capacity`` tokens.

    Args:
        dataset: a map-style ``datasets.Dataset`` with a string column ``text_column``.
        tokenizer: a ``tokenizers.Tokenizer`` (``encode_batch``), a ``transformers`` tokenizer (called
            on a list of texts, its ``input_ids`` read), or any picklable callable mapping a list of
            texts to a list of token-id lists.
        capacity: tokens per pack.
        text_column: the column holding the text; it is removed from the output.
        num_proc: worker processes for ``Dataset.map`` (``None``: this process).
        batch_size: texts per tokenizer call (and rows per Arrow write).
        strategy, overflow: passed to :func:`~hybrid_pack.plan_packs`.
        cache_file_name: where ``map`` writes its Arrow output (see the module note on memory).

    Returns:
        A :class:`TokenizedPlan` ``(dataset, lengths, plan)``. An example with no token raises
        :class:`~hybrid_pack.errors.InputError` (filter empty texts first).
    """
    try:
        import datasets
    except ImportError as err:
        raise MissingExtraError("tokenize_and_plan", "hf", err) from err

    check_plan_settings(capacity, strategy, overflow, None)  # before the tokenization pass, which is long
    if not isinstance(dataset, datasets.Dataset):
        raise InputError(f"dataset: expected a datasets.Dataset (map-style); got {type(dataset).__name__} (build "
                         "one with datasets.Dataset.from_dict or from_list)")
    if text_column not in dataset.column_names:
        raise InputError(f"text_column: expected one of the dataset's columns {dataset.column_names}; "
                         f"got {text_column!r}")
    features = datasets.Features({
        **{name: feature for name, feature in dataset.features.items() if name != text_column},
        INPUT_IDS: datasets.List(datasets.Value("int32")),
        "length": datasets.Value("int32"),
    })
    tokenized = dataset.map(_TokenizeBatch(tokenizer, text_column), batched=True, batch_size=batch_size,
                            num_proc=num_proc, remove_columns=[text_column], features=features,
                            writer_batch_size=batch_size, cache_file_name=cache_file_name, desc="tokenize")
    lengths = np.asarray(tokenized.with_format("numpy")["length"], dtype=np.int64)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise InputError(f"{text_column}[{int(empty[0])}]: tokenized to no token ({empty.size} example(s) affected); "
                         f"filter empty texts out first (dataset.filter(lambda row: row[{text_column!r}] != ''))")
    return TokenizedPlan(tokenized, lengths, plan_packs(lengths, capacity, strategy=strategy, overflow=overflow))
