"""A non-finite value in one document stays in that document, forward and backward, for the chunked
recurrences (a masked chunk slot must never carry it into another document's chunk)."""

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import gated_delta_rule, mamba2_ssd

LENGTHS = [5, 6, 3]


def _gdn(poison: str, value: float):
    b = PackedBoundaries.from_lengths(LENGTHS)
    t = b.total_tokens
    g = torch.Generator().manual_seed(0)
    q, k = (torch.nn.functional.normalize(torch.randn(1, t, 2, 8, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(1, t, 2, 8, generator=g)
    decay = -torch.rand(1, t, 2, generator=g)
    beta = torch.rand(1, t, 2, generator=g)
    inputs = {"q": q, "k": k, "v": v, "g": decay, "beta": beta}
    for x in inputs.values():
        x.requires_grad_(True)
    with torch.no_grad():
        inputs[poison][0, 0] = value  # token 0 of document 0
    out, _ = gated_delta_rule(*inputs.values(), b, backend="torch")
    return b, inputs, out


def _ssd(poison: str, value: float):
    b = PackedBoundaries.from_lengths(LENGTHS)
    t = b.total_tokens
    g = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(1, t, 2, 4, generator=g), "dt": torch.rand(1, t, 2, generator=g),
              "B": torch.randn(1, t, 1, 4, generator=g), "C": torch.randn(1, t, 1, 4, generator=g)}
    for x in inputs.values():
        x.requires_grad_(True)
    with torch.no_grad():
        inputs[poison][0, 0] = value
    out = mamba2_ssd(inputs["x"], inputs["dt"], -torch.ones(2), inputs["B"], inputs["C"], b, chunk_size=4,
                     dt_softplus=False, backend="torch")
    return b, inputs, out


@pytest.mark.parametrize("run, poison", [(_gdn, "k"), (_gdn, "v"), (_gdn, "q"), (_ssd, "x"), (_ssd, "B"),
                                         (_ssd, "C")])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_input_stays_in_its_document(run, poison, value):
    b, inputs, out = run(poison, value)
    first = LENGTHS[0]
    assert torch.isfinite(out[0, first:]).all(), "a non-finite value of document 0 reached another document"
    out[0, first:].sum().backward(retain_graph=True)
    for name, x in inputs.items():
        assert torch.isfinite(x.grad[0, first:]).all(), f"d{name}: non-finite gradient in the other documents"
        x.grad = None
    out[0, :first].sum().backward()
    for name, x in inputs.items():
        assert (x.grad[0, first:] == 0).all(), f"d{name}: document 0's gradient reached another document"
