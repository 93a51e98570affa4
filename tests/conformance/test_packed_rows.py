"""The conformance tier's forward check, packed: the inputs transformers' ``ModelTesterMixin`` starts every test
from (``FamilyTester.prepare_config_and_inputs_for_common()``: a batch of 13 rows of 7 tokens), repacked by
``hybrid_pack.PackingCollator`` into ONE row of the rows' real tokens, through the patched model (float32,
``initializer_range`` 0.2; relative error ``max |packed - ref| / max |ref|`` per row, on the row's real tokens).

Three layouts of the batch: no attention mask (13 full rows), the mixin's mask (row ``i`` holds ``min(i + 1, 7)``
real tokens, then right padding) and that mask flipped (left padding).

Each row of the packed row is compared with two references:

* the same row packed ALONE through the patched model (the same algorithms, only the neighbours differ): at most
  ``TOLERANCE`` (1e-5). This is the isolation proof.
* the unpacked batch through the unpatched model and through the patched one (transformers' algorithms: its
  chunked delta rule, its SSM scans, its attention with a padding mask): at most ``TWO_ALGORITHMS_TOLERANCE``.
  Two algorithms round float32 differently, and some rows amplify round-off: on the mixin's 7-token rows
  (measured over every family and layout, transformers 5.24, CPU) the packed row differs from the batch by at
  most 1.3e-4 (lara_mini, right padding, row 12; qwen3_5_moe up to 3.8e-5; every other family below 1e-5), while
  the same row packed alone differs by at most 7e-6. The same comparison in float64 (every float32 cast of both
  models' code kept at float64) agrees to 1.1e-13 on every row of both families, and transformers' own
  chunked vs recurrent delta rule differ by 3.1e-5 on the same qwen3_5_moe rows: round-off, not a packing error
  (an MoE top-k flip is excluded too: the smallest top-k margin on those rows is 3e-3, the router's probabilities
  move by at most 4e-5). 5e-4 leaves about 4x margin over the worst row for other CPUs' round-off.

One test per family of :data:`~tests.conformance.family_tester.CONFORMANCE_FAMILIES` (the causal LMs of
``TINY_CONFIGS``, and GLM-5-Next's ``...ForConditionalGeneration`` on text-only rows); another per family of
``FAMILIES`` checks that the tier covers it.
"""

from __future__ import annotations

import zlib

import pytest

pytest.importorskip("transformers")

import torch
from transformers import set_seed

from hybrid_pack import PackingCollator
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.families import FAMILIES
from hybrid_pack.isolation import relative_error
from tests.conformance.family_tester import (
    CONFORMANCE_FAMILIES,
    FamilyTester,
    common,
    conformance_config,
    language_model_class,
)
from tests.support.torch_path import pure_torch_transformers

pytestmark = pytest.mark.conformance

LAYOUTS = ("no_mask", "right_padded", "left_padded")
INITIALIZER_RANGE = 0.2
TOLERANCE = 1e-5
TWO_ALGORITHMS_TOLERANCE = 5e-4


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


def _packed(rows: list[torch.Tensor]) -> dict[str, object]:
    """``rows`` (1-D id tensors) as the model inputs of one packed row (``PackingCollator``, labels dropped)."""
    packed = PackingCollator()([{"input_ids": row.tolist()} for row in rows])
    packed.pop("labels")
    assert packed["input_ids"].shape == (1, sum(len(row) for row in rows))
    return packed


@pytest.mark.parametrize("family", sorted(CONFORMANCE_FAMILIES))
def test_packed_row_matches_batch_rows(family: str) -> None:
    for layout in LAYOUTS:
        config, input_ids, mask = _batch(family, layout)
        config.get_text_config().initializer_range = INITIALIZER_RANGE
        model_class = language_model_class(config)
        torch.manual_seed(0)
        model = model_class(config).eval()
        rows = list(input_ids) if mask is None else [ids[keep.bool()] for ids, keep in zip(input_ids, mask)]
        batch = {"input_ids": input_ids} if mask is None else {"input_ids": input_ids, "attention_mask": mask}
        with torch.no_grad(), pure_torch_transformers(model_class):
            unpatched = _rows_logits(model(**batch).logits, mask)
            patch_model(model)
            patched = _rows_logits(model(**batch).logits, mask)
            packed_logits = model(**_packed(rows)).logits[0].split([len(row) for row in rows])
            alone = [model(**_packed([row])).logits[0] for row in rows]
        for i, row in enumerate(packed_logits):
            for name, expected, tolerance in (("the row packed alone", alone[i], TOLERANCE),
                                              ("the unpatched model on the batch", unpatched[i],
                                               TWO_ALGORITHMS_TOLERANCE),
                                              ("the patched model on the batch", patched[i],
                                               TWO_ALGORITHMS_TOLERANCE)):
                error = relative_error(row, expected)
                assert error <= tolerance, (f"{family}, {layout}: row {i} ({len(row)} tokens) of the packed row vs "
                                            f"{name}: relative error {error:.2e} (limit {tolerance:.0e})")


@pytest.mark.parametrize("name", [family.name for family in FAMILIES])
def test_family_has_a_tiny_config(name: str) -> None:
    """Every supported family is in the tier: some tiny config's ``model_type`` (or its text config's) is one of
    the family's; a vision-language config counts (the tier runs it when the family has no causal-LM config)."""
    family = next(family for family in FAMILIES if family.name == name)
    model_types = set()
    for key in CONFORMANCE_FAMILIES:
        try:
            config = conformance_config(key)
        except Exception:  # a broken tiny config fails its own family's tests, not this family's
            continue
        model_types |= {config.model_type, config.get_text_config().model_type}
    assert set(family.model_types) & model_types, (
        f"{name}: no tiny config of model_type {'/'.join(family.model_types)} in TINY_CONFIGS or TINY_VLM_CONFIGS "
        f"(hybrid_pack/integrations/transformers/tiny.py), so the conformance tier does not run this family; "
        f"add a _<family>() builder and its key")
