"""The bundled Qwen3 tokenizer: offline, cached, lossless, and what transformers loads from the same files."""

from __future__ import annotations

from tokenizers import Tokenizer

from hybrid_pack.data import load_hf_tokenizer, load_tokenizer
from tests.data.chats import ENDOFTEXT, IM_END, IM_START


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
