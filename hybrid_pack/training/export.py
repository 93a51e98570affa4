"""The trained model, saved the usual way: a ``save_pretrained`` directory in its tokenizer's id space.

A native preset becomes ``config.json`` + ``model.safetensors`` (load with
``HybridForCausalLM.from_pretrained``); a Hugging Face model is saved in its own format (load with
``AutoModelForCausalLM.from_pretrained``); the tokenizer it was trained with (its own, or the bundled
Qwen3 one) is saved beside it (``AutoTokenizer.from_pretrained`` reads it). A model trained on a compact
vocabulary (the tiny presets' at most 8,192 ids) is expanded back to the tokenizer's ids first
(:func:`~hybrid_pack.modeling.expand_vocabulary`), so it takes Qwen3 tokenizer ids and gives logits over them;
its ``VOCABULARY_NOTE`` file says so.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybrid_pack.data.tokenizer import save_tokenizer
from hybrid_pack.modeling.vocab import VocabRemap, expand_vocabulary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MODEL_DIR = "model"
VOCABULARY_NOTE = "COMPACT_VOCABULARY.md"


def save_trained_model(model: torch.nn.Module, remap: VocabRemap | None, directory: Path,
                       tokenizer_vocab: int, tokenizer: PreTrainedTokenizerBase | None = None) -> dict[str, object]:
    """Write ``model`` to ``directory`` with ``save_pretrained``, in the tokenizer's ``tokenizer_vocab`` ids, and
    ``tokenizer`` beside it (None: the bundled Qwen3 one); return what ``metrics.json`` records about it
    (``model_dir``, ``compact_vocabulary``: the trained rows, or None when the model was trained on every
    tokenizer id)."""
    if remap is not None:
        model = copy.deepcopy(model)
        expand_vocabulary(model, remap, tokenizer_vocab)
    model.save_pretrained(directory)
    if tokenizer is None:
        save_tokenizer(directory)
    else:
        tokenizer.save_pretrained(directory)
    if remap is not None:
        (directory / VOCABULARY_NOTE).write_text(
            f"# A small-vocabulary demo model\n\nTrained on a compact vocabulary: the {remap.size - 1:,} most frequent "
            f"token ids of its training data, plus one `<unk>` row for every other id. Saved expanded to the "
            f"tokenizer's {tokenizer_vocab:,} ids: it takes Qwen3 tokenizer ids and gives logits over them. A kept "
            f"id has its own embedding and logit; the other {tokenizer_vocab - remap.size + 1:,} ids share the "
            f"`<unk>` row, so as inputs they are indistinguishable and as outputs each gets the `<unk>` logit. The "
            f"probabilities over all tokenizer ids are therefore not the trained model's: the softmax counts the "
            f"`<unk>` logit once per other id, so those ids together take far more probability than `<unk>` had "
            f"(a loss, perplexity or sample of this model differs from the trained one's; compare logits of kept "
            f"ids). Train a model with the full vocabulary for real use.\n")
    return {"model_dir": str(directory), "compact_vocabulary": None if remap is None else remap.size}
