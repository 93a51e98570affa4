"""``hybrid-pack train --model DIR`` trains a saved checkpoint in its own tokenizer's ids: the chats rendered by the
folder's chat template, the ids ``AutoTokenizer.from_pretrained(DIR).apply_chat_template`` gives, no remap; a
checkpoint without a tokenizer is refused, never trained in the bundled Qwen3 ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hybrid_pack import cli
from hybrid_pack.data import (
    load_gsm8k,
    load_hf_tokenizer,
    load_toolcall_chats,
    tokenize_chats,
    tokenize_with_template,
)
from hybrid_pack.errors import InputError
from hybrid_pack.integrations.transformers.tiny import tiny_model
from hybrid_pack.schema import IGNORE_INDEX, INPUT_IDS, LABELS
from hybrid_pack.training import TrainConfig
from hybrid_pack.training import trainer as trainer_module
from hybrid_pack.training.data import prepare_data

CHATS = 4
VOCAB = 128  # the tiny Bamba's vocabulary
# ChatML without a think block (so not the bundled Qwen3 rendering): the assistant turns are found by rendering
# the first messages. The {% generation %} markers are only the oracle's: transformers' assistant mask.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{{ '\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


def _chats() -> list[dict]:
    return load_gsm8k("train")[:CHATS]


def _save_tokenizer(directory: Path, template: str | None = TEMPLATE) -> PreTrainedTokenizerFast:
    """A BPE tokenizer of ``VOCAB`` ids learnt from the chats' text (Metaspace words), with ChatML specials."""
    texts = [message["content"] for chat in _chats() for message in chat["messages"]] + ["user assistant\n"]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                                       special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<|im_end|>",
                                        chat_template=template)
    tokenizer.save_pretrained(directory)
    assert len(tokenizer) <= VOCAB
    return tokenizer


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A saved tiny Bamba (weights, 128 ids) with its own tokenizer and chat template."""
    directory = tmp_path / "tiny-bamba"
    tiny_model("bamba").save_pretrained(directory)
    _save_tokenizer(directory)
    return directory


def _template_features(directory: Path, chats: list[dict]) -> list[dict[str, list[int]]]:
    """The oracle: ``apply_chat_template``'s ids and its assistant mask (the template's generation blocks)."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    features = []
    for chat in chats:
        out = tokenizer.apply_chat_template(chat["messages"], return_assistant_tokens_mask=True)
        labels = [t if m else IGNORE_INDEX for t, m in zip(out[INPUT_IDS], out["assistant_masks"], strict=True)]
        features.append({INPUT_IDS: out[INPUT_IDS], LABELS: labels})
    return features


def test_train_feeds_the_folders_chat_template_ids(checkpoint: Path, tmp_path: Path, monkeypatch):
    seen: list[tuple[torch.Tensor, torch.Tensor, list[int]]] = []
    batches: set[int] = set()

    def record(module, args, kwargs):
        if id(kwargs[INPUT_IDS]) in batches:   # the backends' warm-up runs the first batch once before its step
            return
        batches.add(id(kwargs[INPUT_IDS]))
        seen.append((kwargs[INPUT_IDS][0].cpu(), kwargs[LABELS][0].cpu(), kwargs["boundaries"].document_lengths))

    build_model = trainer_module.build_model

    def recorded_model(cfg):
        model = build_model(cfg)
        model.register_forward_pre_hook(record, with_kwargs=True)
        return model

    monkeypatch.setattr(trainer_module, "build_model", recorded_model)
    out = tmp_path / "run"
    code = cli.main(["train", "--model", str(checkpoint), "--max-examples", str(CHATS), "--capacity", "4096",
                     "--max-steps", "1", "--guard-every", "0", "--no-progress", "--device", "cpu",
                     "--out", str(out)])
    assert code == 0
    documents = []
    for input_ids, labels, lengths in seen:
        for ids, labels_of_doc in zip(input_ids.split(lengths), labels.split(lengths), strict=True):
            assert labels_of_doc[0] == IGNORE_INDEX  # the collator's separator: a document's first token
            documents.append((ids.tolist(), labels_of_doc[1:].tolist()))
    expected = [(f[INPUT_IDS], f[LABELS][1:]) for f in _template_features(checkpoint, _chats())]
    assert sorted(documents) == sorted(expected)
    assert all(any(label != IGNORE_INDEX for label in labels) for _, labels in expected)  # the mask is not empty
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["tokenizer"] == str(checkpoint) and metrics["compact_vocabulary"] is None
    assert not (out / "vocab_remap.json").exists()
    saved = AutoTokenizer.from_pretrained(out / "model")  # the trained model keeps its own tokenizer
    assert saved.get_vocab() == AutoTokenizer.from_pretrained(checkpoint).get_vocab()


def test_a_checkpoint_without_a_tokenizer_is_refused(tmp_path: Path, capsys):
    directory = tmp_path / "weights-only"
    tiny_model("bamba").save_pretrained(directory)
    with pytest.raises(InputError, match=r"holds weights but no tokenizer.*--tokenizer PATH"):
        TrainConfig(model=str(directory))
    code = cli.main(["train", "--model", str(directory), "--max-steps", "1", "--out", str(tmp_path / "run")])
    assert code == 2 and "--tokenizer PATH" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything ran
    _save_tokenizer(tmp_path / "tokenizer")
    named = TrainConfig(model=str(directory), tokenizer=str(tmp_path / "tokenizer"))
    assert named.chat_tokenizer == str(tmp_path / "tokenizer")
    with pytest.raises(InputError, match=r"tokenizer: .* is not a folder holding a tokenizer"):
        TrainConfig(model=str(directory), tokenizer=str(tmp_path))


def test_a_config_without_weights_or_tokenizer_keeps_the_compact_vocabulary(tmp_path: Path):
    directory = tmp_path / "config-only"
    tiny_model("bamba").config.save_pretrained(directory)
    assert TrainConfig(model=str(directory)).chat_tokenizer is None
    assert TrainConfig(model="qwen3-next-tiny").chat_tokenizer is None
    data = prepare_data(_chats(), VOCAB, capacity=4096)
    assert data.remap is not None and data.tokenizer is None


def test_multi_turn_masks_match_the_template(tmp_path: Path):
    """Chats with tool turns, several assistant turns each: ids and mask as the template's generation blocks."""
    _save_tokenizer(tmp_path)
    chats = [chat for chat in load_toolcall_chats() if sum(m["role"] == "assistant" for m in chat["messages"]) > 1]
    chats = [{"messages": chat["messages"]} for chat in chats[:6]]
    assert tokenize_with_template(chats, AutoTokenizer.from_pretrained(tmp_path)) == _template_features(tmp_path,
                                                                                                        chats)


def test_the_qwen3_template_gives_the_chatml_features():
    """The bundled Qwen3 tokenizer's own template (think blocks, tools, multi-turn): the ids of
    ``apply_chat_template`` and the masks of :func:`tokenize_chats`."""
    tokenizer = load_hf_tokenizer()
    chats = load_toolcall_chats()[:12] + load_gsm8k("train")[:4]
    features = tokenize_with_template(chats, tokenizer)
    assert features == tokenize_chats(chats)
    for chat, feature in zip(chats, features, strict=True):
        assert feature[INPUT_IDS] == tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"))[
            INPUT_IDS]


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path):
    """A template that renders a turn differently once later ones follow: its turns cannot be located."""
    _save_tokenizer(tmp_path, TEMPLATE.replace("{{ m.content }}<|im_end|>{% endgeneration %}",
                                               "{% if loop.last %}[final] {% endif %}{{ m.content }}<|im_end|>"
                                               "{% endgeneration %}"))
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    with pytest.raises(InputError, match=r"messages\[:2\] render differently"):
        tokenize_with_template([chat], AutoTokenizer.from_pretrained(tmp_path))


def test_ids_outside_the_models_vocabulary_are_refused(tmp_path: Path):
    _save_tokenizer(tmp_path)
    with pytest.raises(InputError, match="outside the model's vocabulary of 8 ids"):
        prepare_data(_chats(), 8, capacity=4096, tokenizer=tmp_path)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path):
    _save_tokenizer(tmp_path, template=None)
    with pytest.raises(InputError, match="has no chat template"):
        prepare_data(_chats(), VOCAB, capacity=4096, tokenizer=tmp_path)
