"""The bundled datasets and length tables: sizes, contents, token lengths equal to the tables, and
every asset shipped as package data with its license."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import numpy as np
import pytest

from hybrid_pack.data import ASSETS_DIR, LENGTH_TABLES, load_gsm8k, load_lengths, tokenize_chats
from tests.data.chats import EMPTY_THINK_TOKENS


def test_gsm8k_splits() -> None:
    test = load_gsm8k("test")
    assert len(test) == 1319
    assert set(test[0]) == {"question", "answer", "messages"}
    assert test[0]["messages"] == [{"role": "user", "content": test[0]["question"]},
                                   {"role": "assistant", "content": test[0]["answer"]}]
    assert all("####" in row["answer"] for row in test)
    with pytest.raises(ValueError, match=r"split: expected 'train' or 'test'"):
        load_gsm8k("validation")


def test_gsm8k_train_lengths_equal_the_table(gsm8k_train) -> None:
    assert len(gsm8k_train) == 7473
    lengths = np.array([len(f["input_ids"]) for f in tokenize_chats(gsm8k_train, empty_think=False)])
    table = load_lengths("gsm8k_train")["full_chatml"]
    np.testing.assert_array_equal(lengths, table)
    # The template's empty think block adds exactly four tokens to each single-turn chat.
    with_think = np.array([len(f["input_ids"]) for f in tokenize_chats(gsm8k_train[:100])])
    np.testing.assert_array_equal(with_think, table[:100] + EMPTY_THINK_TOKENS)


def test_arena_hard_lengths_equal_the_table(arena_chats) -> None:
    assert len(arena_chats) == 748
    lengths = [len(f["input_ids"]) for f in tokenize_chats(arena_chats[:60], empty_think=False)]
    np.testing.assert_array_equal(lengths, load_lengths("arena_hard_v2_sky_t1_32b")["full_chatml"][:60])


def test_toolcall_chats(toolcall_chats) -> None:
    assert len(toolcall_chats) == 300
    roles = {m["role"] for chat in toolcall_chats for m in chat["messages"]}
    assert roles == {"user", "assistant", "tool"}
    calls = [m for chat in toolcall_chats for m in chat["messages"] if m.get("tool_calls")]
    assert len(calls) == 211 and all(isinstance(m["tool_calls"][0]["function"]["arguments"], dict) for m in calls)
    assert sum("tools" in chat for chat in toolcall_chats) == 191


def test_load_lengths() -> None:
    for name in LENGTH_TABLES:
        table = load_lengths(name)
        assert set(table) == {"full_chatml", "last_turn_prompt", "last_turn_response"}
        assert all(v.dtype == np.int32 and v.ndim == 1 for v in table.values())
        assert (table["full_chatml"] >= table["last_turn_prompt"] + table["last_turn_response"]).all()
    with pytest.raises(ValueError, match=r"name: expected one of"):
        load_lengths("gsm8k")


def test_every_asset_is_package_data_with_its_license() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["tool"]["setuptools"]
    files = [p for p in ASSETS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert files
    for path in files:
        package = ".".join(("hybrid_pack", "data", *path.parent.relative_to(ASSETS_DIR.parent).parts))
        assert package in setuptools["packages"], f"{package} is not declared in [tool.setuptools] packages"
        globs = setuptools["package-data"].get(package, [])
        assert any(fnmatch.fnmatch(path.name, g) for g in globs), f"{path} is not matched by package-data {globs}"
    for folder in {p.parent for p in files} - {ASSETS_DIR / "lengths"}:
        assert list(folder.glob("LICENSE*")), f"{folder} has no LICENSE file"
