"""The bundled Qwen3 tokenizer, loaded offline; and a model folder's own chat tokenizer."""

from __future__ import annotations

import functools
import gzip
import shutil
import tempfile
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from hybrid_pack.errors import InputError, MissingExtraError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["QWEN3_DIR", "TOKENIZER_FILES", "has_tokenizer", "load_chat_tokenizer", "load_hf_tokenizer",
           "load_tokenizer", "save_tokenizer"]

QWEN3_DIR = Path(__file__).resolve().parent / "assets" / "qwen3"
"""``tokenizer.json.gz`` (151,643 BPE tokens + 26 added tokens) and ``tokenizer_config.json``."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""The files of which a folder holding a tokenizer has one (``save_pretrained`` writes them)."""


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
    AutoTokenizer = _auto_tokenizer("load_hf_tokenizer")

    with tempfile.TemporaryDirectory(prefix="hybrid_pack_qwen3_") as folder:
        save_tokenizer(folder)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _auto_tokenizer(feature: str) -> type:
    """transformers' ``AutoTokenizer``; MissingExtraError naming ``feature`` without the ``hf`` extra."""
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise MissingExtraError(feature, "hf", err) from err
    return AutoTokenizer


def has_tokenizer(directory: str | PathLike[str]) -> bool:
    """Whether ``directory`` holds a saved tokenizer (one of :data:`TOKENIZER_FILES`)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_chat_tokenizer(directory: str | PathLike[str]) -> PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(directory)`` (offline), checked to hold a chat template.

    Args:
        directory: a folder holding a tokenizer saved with ``save_pretrained`` (a model checkpoint's, or one alone).

    Raises:
        InputError: no tokenizer there, or no chat template.
        MissingExtraError: without the ``hf`` extra.
    """
    AutoTokenizer = _auto_tokenizer(f"the tokenizer in {str(directory)!r}")

    if not has_tokenizer(directory):
        raise InputError(f"tokenizer: {str(directory)!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                         f"save one there with tokenizer.save_pretrained, or name a folder that has one")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as err:
        raise InputError(f"tokenizer: AutoTokenizer.from_pretrained({str(directory)!r}) failed: {err}") from err
    if not tokenizer.chat_template:
        raise InputError(f"tokenizer: the tokenizer in {str(directory)!r} has no chat template; set "
                         f"tokenizer.chat_template and save it there (chat_template.jinja)")
    return tokenizer
