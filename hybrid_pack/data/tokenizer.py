"""The bundled Qwen3 tokenizer, loaded offline."""

from __future__ import annotations

import functools
import gzip
import shutil
import tempfile
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["QWEN3_DIR", "load_hf_tokenizer", "load_tokenizer", "save_tokenizer"]

QWEN3_DIR = Path(__file__).resolve().parent / "assets" / "qwen3"
"""``tokenizer.json.gz`` (151,643 BPE tokens + 26 added tokens) and ``tokenizer_config.json``."""


@functools.cache
def load_tokenizer() -> Tokenizer:
    """The Qwen3 tokenizer as a ``tokenizers.Tokenizer`` (loaded once, ~1 s, then cached).

    The object is shared: do not enable padding or truncation on it; copy it first with
    ``Tokenizer.from_str(tok.to_str())``.
    """
    with gzip.open(QWEN3_DIR / "tokenizer.json.gz", "rt", encoding="utf-8") as f:
        return Tokenizer.from_str(f.read())


def save_tokenizer(directory: str | PathLike[str]) -> None:
    """Write the Qwen3 tokenizer as ``AutoTokenizer.from_pretrained(directory)`` reads it: ``tokenizer.json``,
    ``tokenizer_config.json`` (with the chat template) and its licence."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with gzip.open(QWEN3_DIR / "tokenizer.json.gz", "rb") as packed, open(directory / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(packed, out)
    shutil.copy(QWEN3_DIR / "tokenizer_config.json", directory)
    shutil.copy(QWEN3_DIR / "LICENSE", directory / "LICENSE.tokenizer")


def load_hf_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen3 tokenizer as a ``transformers`` fast tokenizer, with its chat template (offline).

    Writes it to a temporary folder with :func:`save_tokenizer` and loads it with
    ``AutoTokenizer.from_pretrained``; needs the ``hf`` extra (``transformers``).
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="hybrid_pack_qwen3_") as folder:
        save_tokenizer(folder)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
