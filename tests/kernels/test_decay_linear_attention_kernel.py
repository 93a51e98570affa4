"""fla's ``chunk_simple_gla`` adapter for decay linear attention against the pure-torch oracle, forward and backward,
on adversarial packed layouts (the real Triton kernels, interpreted), and its self-check verdict."""

from __future__ import annotations

import functools

import pytest
import torch

from hybrid_pack.ops import decay_linear_attention
from hybrid_pack.ops.selfcheck.contract import make_signature
from tests import kit
from tests.kit import KERNEL_LAYOUTS as LAYOUTS

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("without_selfcheck")]

OP = "decay_linear_attention"
TOL = 1e-4  # float32 kernel against the float32 torch backend


@pytest.mark.parametrize("layout", ["one_token_docs_and_chunk_edges", "long_next_to_short"])
def test_fla_matches_torch(layout: str) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    signature = make_signature(H=2, K=16, V=8, output_final_state=True, q=torch.float32, k=torch.float32,
                               v=torch.float32, g=torch.float32, initial_state=torch.float32)
    case = kit.op_inputs(OP, signature, boundaries)
    got = kit.forward_backward(OP, functools.partial(decay_linear_attention, backend="fla"), case, boundaries)
    want = kit.forward_backward(OP, functools.partial(decay_linear_attention, backend="torch"), case, boundaries)
    assert set(got) == set(want) == {"output", "final_state", "dq", "dk", "dv", "dg", "dinitial_state"}
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=TOL)


def test_fla_keeps_documents_apart() -> None:
    """Packed equals each document alone through the kernel, forward and backward (MiniMax's call: a constant
    decay per head, no scale, no states)."""
    boundaries = LAYOUTS["one_token_docs_and_chunk_edges"].boundaries()
    signature = make_signature(H=2, K=16, V=8, output_final_state=False, q=torch.float32, k=torch.float32,
                               v=torch.float32, g=torch.float32, initial_state=None)
    case = kit.op_inputs(OP, signature, boundaries)
    fla = functools.partial(decay_linear_attention, backend="fla")
    kit.assert_packed_equals_segments_alone(OP, fla, case, boundaries, tol=TOL)
