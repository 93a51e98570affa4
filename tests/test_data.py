"""Bundled data: the Qwen3 tokenizer offline, ChatML equal to the real chat template, prompt
masking, dataset loaders, and token lengths equal to the precomputed tables."""

from __future__ import annotations

import fnmatch
import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from hybrid_pack import PackingCollator
from hybrid_pack.data import (
    ASSETS_DIR,
    LENGTH_TABLES,
    QWEN3_DIR,
    format_chat,
    load_arena_hard_chats,
    load_gsm8k,
    load_hf_tokenizer,
    load_lengths,
    load_tokenizer,
    load_toolcall_chats,
    tokenize_chats,
)

IM_START, IM_END, ENDOFTEXT = 151644, 151645, 151643
EMPTY_THINK_TOKENS = 4  # "<think>", "\n\n", "</think>", "\n\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The reference: transformers' own loader on tokenizer.json unpacked beside tokenizer_config.json."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen3")
    with gzip.open(QWEN3_DIR / "tokenizer.json.gz", "rb") as src, open(folder / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(QWEN3_DIR / "tokenizer_config.json", folder)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def gsm8k_train() -> list[dict]:
    return load_gsm8k("train")


@pytest.fixture(scope="module")
def toolcall_chats() -> list[dict]:
    return load_toolcall_chats()


@pytest.fixture(scope="module")
def arena_chats() -> list[dict]:
    return load_arena_hard_chats()


# ------------------------------------------------------------------ tokenizer
def test_tokenizer_loads_offline_cached_and_round_trips(tokenizer: Tokenizer) -> None:
    assert load_tokenizer() is tokenizer
    assert tokenizer.get_vocab_size() == 151_669
    assert [tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")] == \
        [IM_START, IM_END, ENDOFTEXT]
    for text in ["Natalia sold 48/2 = <<48/2=24>>24 clips.", "Phương trình chuyển động 你好 😀 \t\n x",
                 "<|im_start|>user\nhi<|im_end|>\n"]:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert len(tokenizer.encode("12345", add_special_tokens=False).ids) == 5  # one token per digit


def test_hf_tokenizer_loads_offline_and_agrees(tokenizer: Tokenizer, hf_tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast

    loaded = load_hf_tokenizer()
    assert isinstance(loaded, PreTrainedTokenizerFast)
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token_id == ENDOFTEXT
    assert loaded.chat_template == hf_tokenizer.chat_template
    text = "Weng earns $12 an hour.<|im_end|> Ünïcödé"
    assert loaded(text)["input_ids"] == tokenizer.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------ ChatML = the template
TEMPLATE_CASES = {
    "single turn": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    "system and multi turn": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "\n\nBye."}],
    "reasoning_content": [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning_content": "\nLet me think.\n"}],
    "think inside content": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nb"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>x</think>d"}],
    "tool calls and responses": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "é": "<b>"}}},
            {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}]},
        {"role": "tool", "content": "{\"t\": 21}"}, {"role": "tool", "content": "{\"t\": 25}"},
        {"role": "assistant", "content": "21 and 25 degrees."}],
    "user-wrapped tool response": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
            {"name": "f", "arguments": {}}]},
        {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        {"role": "assistant", "content": "done"}],
    "system later and tool first": [
        {"role": "tool", "content": "r"}, {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"}],
    "no user turn": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
    "ends on user": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "u2"}],
}
TEMPLATE_TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now>",
                                                    "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("case", list(TEMPLATE_CASES))
@pytest.mark.parametrize("with_tools", [False, True])
def test_format_chat_equals_the_chat_template(case: str, with_tools: bool, hf_tokenizer) -> None:
    messages = TEMPLATE_CASES[case]
    tools = TEMPLATE_TOOLS if with_tools else None
    expected = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert format_chat(messages, tools=tools).text == expected
    assert format_chat({"messages": messages, "tools": tools}).text == expected


def test_bundled_chats_render_and_tokenize_like_the_template(gsm8k_train, toolcall_chats, arena_chats,
                                                            hf_tokenizer) -> None:
    chats = gsm8k_train[:20] + toolcall_chats + arena_chats[:20]
    for chat in chats:
        expected = hf_tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=False)
        assert format_chat(chat).text == expected
    sample = gsm8k_train[:5] + toolcall_chats[:10] + arena_chats[:5]
    features = tokenize_chats(sample)
    for chat, feature in zip(sample, features):
        expected_ids = hf_tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"),
                                                        tokenize=True, return_dict=True)["input_ids"]
        assert feature["input_ids"] == expected_ids


def test_empty_think_false_is_plain_chatml() -> None:
    messages = TEMPLATE_CASES["single turn"]
    assert format_chat(messages).text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    assert format_chat(messages, empty_think=False).text == \
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    with_reasoning = [messages[0], {**messages[1], "reasoning_content": "r"}]
    assert "<think>\nr\n</think>" in format_chat(with_reasoning, empty_think=False).text


# ------------------------------------------------------------------ masking
def test_only_assistant_turns_are_trained(tokenizer: Tokenizer, toolcall_chats) -> None:
    chats = [{"messages": TEMPLATE_CASES["tool calls and responses"], "tools": TEMPLATE_TOOLS},
             {"messages": TEMPLATE_CASES["system and multi turn"]}, *toolcall_chats[:40]]
    for chat, feature in zip(chats, tokenize_chats(chats)):
        rendered = format_chat(chat)
        ids, labels = np.array(feature["input_ids"]), np.array(feature["labels"])
        trained = labels != -100
        assert np.array_equal(labels[trained], ids[trained])
        trained_text = tokenizer.decode(ids[trained].tolist(), skip_special_tokens=False)
        assert trained_text == "".join(rendered.text[a:b] for a, b in rendered.assistant_spans)
        # <|im_end|> is trained where it closes an assistant turn, and only there.
        ends = np.flatnonzero(ids == IM_END)
        turn_roles = [tokenizer.decode([ids[np.flatnonzero(ids[:end] == IM_START)[-1] + 1]]) for end in ends]
        assert [bool(trained[end]) for end in ends] == [role == "assistant" for role in turn_roles]
        assert not trained[ids == IM_START].any() and not trained[-1]  # the final "\n" is prompt


def test_gsm8k_prompt_and_response_match_the_length_table(gsm8k_train) -> None:
    table = load_lengths("gsm8k_train")
    for i, feature in enumerate(tokenize_chats(gsm8k_train[:200], empty_think=False)):
        labels = np.array(feature["labels"])
        trained = np.flatnonzero(labels != -100)
        # The table counts "<|im_end|>\n" in the response; the newline after <|im_end|> is not trained.
        assert trained[0] == table["last_turn_prompt"][i]
        assert len(trained) == table["last_turn_response"][i] - 1
        assert trained[-1] == len(labels) - 2 and labels[trained[-1]] == IM_END


def test_max_length_keeps_the_start(gsm8k_train) -> None:
    full = tokenize_chats(gsm8k_train[:3])
    cut = tokenize_chats(gsm8k_train[:3], max_length=50)
    for a, b in zip(full, cut):
        assert b["input_ids"] == a["input_ids"][:50] and b["labels"] == a["labels"][:50]


def test_tokenize_chats_rejects_bad_arguments(gsm8k_train) -> None:
    with pytest.raises(ValueError, match=r"max_length: expected a positive int"):
        tokenize_chats(gsm8k_train[:1], max_length=0)
    padded = Tokenizer(WordLevel({"<pad>": 0}, unk_token="<pad>"))
    padded.enable_padding(length=8)
    with pytest.raises(ValueError, match=r"tokenizer: expected padding and truncation off"):
        tokenize_chats(gsm8k_train[:1], padded)


@pytest.mark.parametrize(("chat", "message"), [
    ([], r"messages: expected a non-empty list"),
    ({"conversations": []}, r"chat: expected a 'messages' key"),
    ([{"role": "bot", "content": "x"}], r"messages\[0\]\.role: expected one of"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
     r"messages\[1\]\.content: expected a string"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}],
     r"messages\[1\]\.tool_calls\[0\]: expected 'name' and 'arguments'"),
])
def test_format_chat_rejects_malformed_chats(chat, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        format_chat(chat)


# ------------------------------------------------------------------ loaders and lengths
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


def test_collating_tokenized_chats(gsm8k_train) -> None:
    features = tokenize_chats(gsm8k_train[:8])
    batch = PackingCollator(pad_to_multiple_of=128, pad_token_id=ENDOFTEXT)(features)
    starts = batch["cu_seq_lens_q"][:-1].tolist()
    assert batch["input_ids"][0, starts[:-1]].tolist() == [IM_START] * 8
    assert (batch["labels"][0, starts] == -100).all()
    assert int((batch["labels"] != -100).sum()) == sum(sum(l != -100 for l in f["labels"]) for f in features)


# ------------------------------------------------------------------ packaging
def test_every_asset_is_package_data_with_its_license() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    setuptools = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    files = [p for p in ASSETS_DIR.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert files
    for path in files:
        package = ".".join(("hybrid_pack", "data", *path.parent.relative_to(ASSETS_DIR.parent).parts))
        assert package in setuptools["packages"], f"{package} is not declared in [tool.setuptools] packages"
        globs = setuptools["package-data"].get(package, [])
        assert any(fnmatch.fnmatch(path.name, g) for g in globs), f"{path} is not matched by package-data {globs}"
    for folder in {p.parent for p in files} - {ASSETS_DIR / "lengths"}:
        assert list(folder.glob("LICENSE*")), f"{folder} has no LICENSE file"
