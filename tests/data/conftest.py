"""Fixtures of the data tests: the bundled tokenizer (ours and transformers' loader on the same files)
and the bundled chat datasets, each loaded once per session."""

from __future__ import annotations

import gzip
import shutil

import pytest
from tokenizers import Tokenizer

from hybrid_pack.data import QWEN3_DIR, load_arena_hard_chats, load_gsm8k, load_tokenizer, load_toolcall_chats


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The reference: transformers' own loader on tokenizer.json unpacked beside tokenizer_config.json."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3")
    with gzip.open(QWEN3_DIR / "tokenizer.json.gz", "rb") as src, open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(QWEN3_DIR / "tokenizer_config.json", folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="session")
def gsm8k_train() -> list[dict]:
    return load_gsm8k("train")


@pytest.fixture(scope="session")
def toolcall_chats() -> list[dict]:
    return load_toolcall_chats()


@pytest.fixture(scope="session")
def arena_chats() -> list[dict]:
    return load_arena_hard_chats()
