"""Padded RL batches (docs/api.md §7c): where a trainer pads instead of packing (TRL's GRPO and DPO, verl's
padded path), a patched hybrid's padded rows, left padding included, equal each sequence run alone.

The convolutions get non-zero biases first: with the tiny models' zero biases a conv that runs over the
padding (and carries it into the next token's window or a recurrent state) would add nothing and hide the
leak. Unpacked calls run the family's own code, so this proves transformers' torch path on CPU; a fused CUDA
kernel that skipped the padding mask would need the GPU tier.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, VOCAB, tiny_model
from tests.support.torch_path import pure_torch_transformers

LENGTHS = [7, 12, 3, 1]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_padded_rows_equal_each_sequence_alone(family: str, side: str) -> None:
    model = patch_model(tiny_model(family))
    generator = torch.Generator().manual_seed(0)
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Conv1d) and m.bias is not None]
    with torch.no_grad():
        for bias in biases:
            bias.copy_(torch.randn(bias.shape, generator=generator))
    sequences = [torch.randint(3, VOCAB, (n,), generator=generator) for n in LENGTHS]
    width = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, sequence in enumerate(sequences):
        where = slice(width - len(sequence), width) if side == "left" else slice(0, len(sequence))
        ids[row, where], mask[row, where] = sequence, 1
    with torch.no_grad(), pure_torch_transformers(model):
        padded = model(input_ids=ids, attention_mask=mask).logits
        for row, sequence in enumerate(sequences):
            where = slice(width - len(sequence), width) if side == "left" else slice(0, len(sequence))
            alone = model(input_ids=sequence[None]).logits[0]
            torch.testing.assert_close(padded[row, where], alone, rtol=1e-5, atol=1e-5)
