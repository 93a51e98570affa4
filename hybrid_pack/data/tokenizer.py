"""The bundled Qwen3 tokenizer, loaded offline."""

from __future__ import annotations

import functools
import gzip
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

__all__ = ["QWEN3_DIR", "load_hf_tokenizer", "load_tokenizer"]

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


def load_hf_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen3 tokenizer as a ``transformers`` fast tokenizer, with its chat template (offline).

    Unpacks ``tokenizer.json`` beside ``tokenizer_config.json`` in a temporary folder and loads it
    with ``AutoTokenizer.from_pretrained``; needs the ``hf`` extra (``transformers``).
    """
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="hybrid_pack_qwen3_") as folder:
        with (gzip.open(QWEN3_DIR / "tokenizer.json.gz", "rb") as packed,
              open(Path(folder) / "tokenizer.json", "wb") as unpacked):
            shutil.copyfileobj(packed, unpacked)
        shutil.copy(QWEN3_DIR / "tokenizer_config.json", folder)
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
