"""fla's ``chunk_kda`` adapter against the pure-torch KDA, forward and backward, on adversarial packed layouts
(the real Triton kernel, interpreted): documents of one token, one under, at and over the kernel's 64-token
chunk, grouped value heads, initial and final states, and a trailing padding segment."""

from __future__ import annotations

import functools

import pytest
import torch

from hybrid_pack.ops import kda
from hybrid_pack.ops.selfcheck.contract import make_signature
from tests import kit

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("without_selfcheck")]

TOL = 1e-4  # float32 kernel against the float32 torch backend
LAYOUT = kit.Layout("one_token_docs_and_chunk_edges", (1, 65, 1, 3), num_pad_tokens=5)


@pytest.mark.parametrize("initial_state", [False, True], ids=["zero_states", "initial_states"])
def test_fla_chunk_kda_matches_torch(initial_state: bool) -> None:
    boundaries = LAYOUT.boundaries()
    dtype = torch.float32
    signature = make_signature(H=1, K=16, HV=2, V=8, use_qk_l2norm=True, output_final_state=True, q=dtype, k=dtype,
                               v=dtype, g=dtype, beta=dtype, initial_state=dtype if initial_state else None)
    case = kit.op_inputs("kda", signature, boundaries)
    got = kit.forward_backward("kda", functools.partial(kda, backend="fla"), case, boundaries)
    want = kit.forward_backward("kda", functools.partial(kda, backend="torch"), case, boundaries)
    expected = {"output", "final_state", "dq", "dk", "dv", "dg", "dbeta"} | ({"dinitial_state"} if initial_state
                                                                              else set())
    assert set(got) == set(want) == expected
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=TOL)
