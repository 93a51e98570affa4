"""A non-finite value in one document stays in that document, forward and backward, for every op (the
chunked recurrences above all: a masked chunk slot must never carry it into another document's chunk)."""

from __future__ import annotations

import pytest
import torch

from tests import kit

LAYOUT = kit.Layout("three_docs", (5, 6, 3))
SIGNATURES = {  # float32, at the recurrences' chunk sizes the documents cross (ssd: 4)
    "attention": kit.attention_signature(heads=2, kv_heads=2, dim=8, dtype=torch.float32),
    "conv": kit.conv_signature(width=4, activation="silu", dtype=torch.float32),
    "gated_delta": kit.gated_delta_signature(heads=2, v_heads=2, k_dim=8, v_dim=8, output_final_state=False,
                                             dtype=torch.float32),
    "ssd": kit.ssd_signature(heads=2, head_dim=4, groups=1, state_dim=4, chunk_size=4, dt_softplus=False,
                             return_final_states=False, dtype=torch.float32),
}
POISONED = [("attention", "q"), ("attention", "k"), ("attention", "v"), ("conv", "x"),
            ("gated_delta", "q"), ("gated_delta", "k"), ("gated_delta", "v"),
            ("ssd", "x"), ("ssd", "B"), ("ssd", "C")]


@pytest.mark.parametrize(("op", "poison"), POISONED)
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_input_stays_in_its_document(op: str, poison: str, value: float) -> None:
    boundaries = LAYOUT.boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    with torch.no_grad():
        case.arguments[poison][0, 0] = value  # token 0 of document 0
    out = kit.run(op, kit.public_op(op), case, boundaries)["output"]
    first = LAYOUT.lengths[0]
    assert torch.isfinite(out[0, first:]).all(), "a non-finite value of document 0 reached another document"

    for name, grad in kit.gradients(out[0, first:].sum(), case.arguments, retain_graph=True).items():
        if name[1:] in case.token_inputs:
            assert torch.isfinite(grad[0, first:]).all(), f"{name}: non-finite gradient in the other documents"
    for name, grad in kit.gradients(out[0, :first].sum(), case.arguments).items():
        if name[1:] in case.token_inputs:
            assert (grad[0, first:] == 0).all(), f"{name}: document 0's gradient reached another document"
