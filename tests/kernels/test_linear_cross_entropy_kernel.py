"""fla's fused linear cross-entropy, interpreted on CPU: it passes its self-check, then serves, and agrees with
the chunked pure-torch backend (loss, gradients of hidden and weight) on small shapes."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack.backends import available, select, verify
from hybrid_pack.ops import linear_cross_entropy
from hybrid_pack.schema import IGNORE_INDEX
from tests.kit import assert_close

pytestmark = pytest.mark.kernels

OP = "linear_cross_entropy"
TOL = 1e-5  # float32 kernel against the float32 torch backend


def test_fla_passes_its_self_check_and_serves() -> None:
    results = {r.backend: r for r in verify(OP, device="cpu", dtype=torch.float32)}
    assert results["fla"].ok and results["fla"].max_error < 1e-5, results["fla"].reason
    assert select(OP, device="cpu", dtype=torch.float32, requires_grad=True) == "fla"
    assert select(OP, device="cpu", dtype=torch.bfloat16) == "torch"
    assert {r.backend: r.usable for r in available(OP)}["fla"]


@pytest.mark.usefixtures("without_selfcheck")
@pytest.mark.parametrize(("tokens", "chunk_size", "num_items"), [(45, 8, None), (7, 64, 3), (33, 33, None)])
def test_fla_matches_torch(tokens: int, chunk_size: int, num_items: int | None) -> None:
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(1, tokens, 16, generator=g)
    weight = torch.randn(300, 16, generator=g) * 0.5
    targets = torch.randint(0, 300, (1, tokens), generator=g)
    targets[:, ::4] = IGNORE_INDEX
    results = {}
    for backend in ("fla", "torch"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(h, w, targets, num_items=num_items, chunk_size=chunk_size, backend=backend) * 1.5
        results[backend] = [loss.detach(), *torch.autograd.grad(loss, (h, w))]
    for name, got, want in zip(("loss", "gradient of hidden", "gradient of weight"), results["fla"],
                               results["torch"], strict=True):
        assert_close(got, want, name, tol=TOL)
