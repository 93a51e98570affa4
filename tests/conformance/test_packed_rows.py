"""The conformance tier's forward check, packed: the inputs transformers' ``ModelTesterMixin`` starts every test
from (``FamilyTester.prepare_config_and_inputs_for_common()``: a batch of 13 rows of 7 tokens), repacked by
``hybrid_pack.PackingCollator`` into ONE row of the rows' real tokens, through the patched causal LM, give every
row the logits the unpacked batch gives it, patched and unpatched (float32, ``initializer_range`` 0.2, relative
error ``max |packed - batch| / max |batch|`` at most 1e-5 per row).

Three layouts of the batch: no attention mask (13 full rows), the mixin's mask (row ``i`` holds ``min(i + 1, 7)``
real tokens, then right padding) and that mask flipped (left padding); a padded row is compared on its real tokens.
One test per family of ``TINY_CONFIGS``; another per family of ``FAMILIES`` checks that it has a tiny config, so
the tier covers it.
"""

from __future__ import annotations

import zlib

import pytest

pytest.importorskip("transformers")

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, set_seed

from hybrid_pack import PackingCollator
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.families import FAMILIES
from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS, pure_torch_transformers, tiny_config
from hybrid_pack.isolation import relative_error
from tests.conformance.family_tester import FamilyTester, common

pytestmark = pytest.mark.conformance

LAYOUTS = ("no_mask", "right_padded", "left_padded")
INITIALIZER_RANGE = 0.2
TOLERANCE = 1e-5


def _batch(family: str, layout: str) -> tuple[object, torch.Tensor, torch.Tensor | None]:
    """The mixin's ``(config, input_ids [13, 7], attention_mask [13, 7] or None)`` in ``layout``."""
    seed = zlib.crc32(f"{family}/{layout}".encode())
    set_seed(seed)
    common.global_rng.seed(seed)
    config, inputs = FamilyTester(None, family).prepare_config_and_inputs_for_common()
    mask = {"no_mask": None, "right_padded": inputs["attention_mask"],
            "left_padded": inputs["attention_mask"].flip(-1)}[layout]
    return config, inputs["input_ids"], mask


def _rows_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's logits ``[real tokens, vocab]`` of a batch's ``logits [B, T, vocab]``."""
    if mask is None:
        return list(logits)
    return [row[keep.bool()] for row, keep in zip(logits, mask)]


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_packed_row_matches_batch_rows(family: str) -> None:
    for layout in LAYOUTS:
        config, input_ids, mask = _batch(family, layout)
        config.initializer_range = INITIALIZER_RANGE
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        torch.manual_seed(0)
        model = model_class(config).eval()
        rows = list(input_ids) if mask is None else [ids[keep.bool()] for ids, keep in zip(input_ids, mask)]
        packed = PackingCollator()([{"input_ids": row.tolist()} for row in rows])
        packed.pop("labels")
        batch = {"input_ids": input_ids} if mask is None else {"input_ids": input_ids, "attention_mask": mask}
        with torch.no_grad(), pure_torch_transformers(model_class):
            unpatched = _rows_logits(model(**batch).logits, mask)
            patch_model(model)
            patched = _rows_logits(model(**batch).logits, mask)
            packed_logits = model(**packed).logits[0].split([len(row) for row in rows])
        assert packed["input_ids"].shape == (1, sum(len(row) for row in rows))
        for i, row in enumerate(packed_logits):
            for name, expected in (("unpatched", unpatched[i]), ("patched", patched[i])):
                error = relative_error(row, expected)
                assert error <= TOLERANCE, (f"{family}, {layout}: row {i} ({len(row)} tokens) of the packed row vs "
                                            f"the {name} model on the batch: relative error {error:.2e}")


@pytest.mark.parametrize("name", [family.name for family in FAMILIES])
def test_family_has_a_tiny_config(name: str) -> None:
    """Every supported family is in the tier: some tiny config's ``model_type`` is one of the family's."""
    family = next(family for family in FAMILIES if family.name == name)
    model_types = {}
    for key in TINY_CONFIGS:
        try:
            model_types[tiny_config(key).model_type] = key
        except Exception:  # a broken tiny config fails its own family's tests, not this family's
            continue
    assert set(family.model_types) & set(model_types), (
        f"{name}: no tiny config of model_type {'/'.join(family.model_types)} in TINY_CONFIGS "
        f"(hybrid_pack/integrations/transformers/tiny.py), so the conformance tier does not run this family; "
        f"add a _<family>() builder and its key")
