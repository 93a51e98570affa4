"""Kimi Delta Attention on packed rows: exact per document, forward and backward, and the semantics of
transformers' Kimi Linear layer.

Every check goes through the public op, ``hybrid_pack.ops.kda(..., backend="torch")``, except the chunk-size
check, which calls the backend with its ``chunk_size``.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack import PackedBoundaries, backends
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops import kda
from hybrid_pack.ops.dispatch import registry, selector
from hybrid_pack.ops.dispatch.registry import contract_of, reference_of
from hybrid_pack.ops.kda import torch_backend
from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.ops.selfcheck.contract import make_signature
from tests import kit
from tests.kit import Layout
from tests.ops.reference.kda import kda_reference

OP = "kda"
TORCH = functools.partial(kda, backend="torch")
_C = torch_backend.CHUNK_SIZE
LAYOUTS = kit.named(
    Layout("one_token_docs", (1, 1, 1, 1, 1)),
    Layout("many_tiny_docs", (3, 1, 5, 2, 7, 1, 4, 2)),
    Layout("chunk_edges", (_C - 1, _C, _C + 1, 2 * _C, 2 * _C + 1)),
    Layout("long_among_short", (5, 90, 2, 17, 1)),
    Layout("trailing_padding", (20, 35, 9), num_pad_tokens=13),
)
"""16-token chunks: documents ending on, one short of and one past chunk edges, one over several chunks."""
TOLERANCE = {torch.float64: 1e-10, torch.float32: 5e-6}
CONFIGS = {  # q/k heads, value heads, q/k normalised in the op, initial states given
    "mha": {"heads": 2, "v_heads": 2, "use_qk_l2norm": False, "initial_state": False},
    "gva_l2norm_h0": {"heads": 2, "v_heads": 4, "use_qk_l2norm": True, "initial_state": True},
}


def signature(*, heads: int = 2, v_heads: int = 2, k_dim: int = 8, v_dim: int = 6, use_qk_l2norm: bool = False,
              initial_state: bool = False, output_final_state: bool = True,
              dtype: torch.dtype = torch.float64) -> kit.Signature:
    return make_signature(H=heads, K=k_dim, HV=v_heads, V=v_dim, use_qk_l2norm=use_qk_l2norm,
                              output_final_state=output_final_state, q=dtype, k=dtype, v=dtype, g=dtype, beta=dtype,
                              initial_state=dtype if initial_state else None)


def inputs(layout: str | PackedBoundaries, config: str, dtype: torch.dtype = torch.float64, *,
           requires_grad: bool = True, **flags) -> tuple[kit.CheckCase, PackedBoundaries]:
    """The op's inputs on a layout (by name) or on given boundaries, for ``CONFIGS[config]`` changed by ``flags``."""
    boundaries = LAYOUTS[layout].boundaries() if isinstance(layout, str) else layout
    case = kit.op_inputs(OP, signature(**CONFIGS[config] | flags, dtype=dtype), boundaries,
                         requires_grad=requires_grad)
    return case, boundaries


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_per_token_reference(layout: str, config: str) -> None:
    case, boundaries = inputs(layout, config)
    arguments = {**case.arguments, "scale": 0.3}
    got = kit.forward_backward(OP, TORCH, case, boundaries, arguments=arguments)
    want = kit.forward_backward(OP, kda_reference, case, boundaries, arguments=arguments)
    v_heads, k_dim, v_dim = case.arguments["v"].shape[2], case.arguments["k"].shape[3], case.arguments["v"].shape[3]
    assert got["output"].dtype == torch.float64
    assert got["final_state"].shape == (boundaries.num_docs, v_heads, k_dim, v_dim)
    assert set(got) == set(want)
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, config: str, dtype: torch.dtype) -> None:
    case, boundaries = inputs(layout, config, dtype)
    kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=TOLERANCE[dtype], seed=2)


@pytest.mark.parametrize("layout", ["many_tiny_docs", "chunk_edges", "trailing_padding"])
def test_no_gradient_crosses_documents(layout: str) -> None:
    case, boundaries = inputs(layout, "gva_l2norm_h0", torch.float32)
    kit.assert_no_gradient_crosses_segments(OP, TORCH, case, boundaries)


def test_decay_is_per_key_channel() -> None:
    """Decaying one key channel changes the output (so g is not reduced to one decay per head)."""
    case, boundaries = inputs(PackedBoundaries.from_lengths([20]), "mha", requires_grad=False)
    o, _ = case.call(TORCH, boundaries)
    g = case.arguments["g"].detach().clone()
    g[..., 0] -= 3.0
    o_changed, _ = case.call(TORCH, boundaries, {**case.arguments, "g": g})
    assert (o - o_changed).abs().max() > 1e-3


def test_strong_decays_stay_finite() -> None:
    """Log decays of -50 per token (Kimi's gate reaches them) overflow a factored ``e^γ_i e^-γ_j``, not the op."""
    case, boundaries = inputs(PackedBoundaries.from_lengths([2 * _C + 3]), "mha")
    strong = {**case.arguments, "g": (case.arguments["g"] * 0 - 50.0).detach().requires_grad_()}
    got = kit.forward_backward(OP, TORCH, case, boundaries, arguments=strong)
    want = kit.forward_backward(OP, kda_reference, case, boundaries, arguments=strong)
    for name in got:
        assert torch.isfinite(got[name]).all(), name
        kit.assert_close(got[name], want[name], name, tol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 8, 64])
def test_chunk_size_does_not_change_the_result(chunk_size: int) -> None:
    case, boundaries = inputs("long_among_short", "gva_l2norm_h0")
    chunked = functools.partial(torch_backend.kda, chunk_size=chunk_size)
    o, final = case.call(chunked, boundaries)
    o_default, final_default = case.call(TORCH, boundaries)
    kit.assert_close(o, o_default, "output", tol=1e-12)
    kit.assert_close(final, final_default, "final state", tol=1e-12)


@pytest.mark.parametrize("name", ["chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"])
def test_matches_transformers_kimi_linear_torch_code(name: str) -> None:
    """One document: the op equals transformers' own torch KDA (float32), with the gate of Kimi Linear's
    ``KimiLinearForgetGate`` (``-exp(A_log) * softplus(f + dt_bias)``) and q/k L2-normalised in the op."""
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    hf = getattr(modeling, name)
    hf = getattr(hf, "__wrapped__", hf)  # transformers' torch code, not a hub kernel
    generator = torch.Generator().manual_seed(0)
    t, heads, k_dim, v_dim = 2 * 64 + 5, 2, 8, 8
    q, k = (torch.randn(1, t, heads, k_dim, generator=generator) for _ in range(2))
    v = torch.randn(1, t, heads, v_dim, generator=generator)
    a_log = torch.rand(1, 1, heads, 1, generator=generator) * 2
    f = torch.randn(1, t, heads, k_dim, generator=generator)
    g = -a_log.exp() * F.softplus(f)
    beta = torch.rand(1, t, heads, generator=generator)
    h0 = torch.randn(1, heads, k_dim, v_dim, generator=generator) * 0.1
    want, want_final = hf(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    got, got_final = TORCH(q, k, v, g, beta, PackedBoundaries.from_lengths([t]), initial_state=h0,
                           output_final_state=True, use_qk_l2norm=True)
    kit.assert_close(got, want, "output", tol=1e-5)
    kit.assert_close(got_final, want_final, "final state", tol=1e-5)


def test_static_boundaries_run_the_opaque_node_with_the_plain_results() -> None:
    """No static form: with StaticBoundaries (what a compiled graph holds) the op runs as ``hybrid_pack::kda``;
    same outputs and gradients as the plain call."""
    case, boundaries = inputs("trailing_padding", "gva_l2norm_h0", initial_state=False, output_final_state=False)
    plain = kit.forward_backward(OP, TORCH, case, boundaries)
    static = kit.forward_backward(OP, TORCH, case, StaticBoundaries.from_boundaries(boundaries, 5))
    for name, expected in plain.items():
        kit.assert_close(static[name], expected, name, tol=1e-10)


def test_compiles_as_one_graph_with_the_plain_results() -> None:
    """``torch.compile(fullgraph=True)`` on StaticBoundaries: no graph break, outputs and gradients as eager."""
    torch._dynamo.reset()
    compiled = torch.compile(TORCH, backend="aot_eager", fullgraph=True)
    case, boundaries = inputs("chunk_edges", "gva_l2norm_h0", initial_state=False, output_final_state=False)
    plain = kit.forward_backward(OP, TORCH, case, boundaries)
    static = kit.forward_backward(OP, compiled, case, StaticBoundaries.from_boundaries(boundaries, 6))
    for name, expected in plain.items():
        kit.assert_close(static[name], expected, name, tol=1e-10)


def test_bad_shapes_name_the_field() -> None:
    case, boundaries = inputs("many_tiny_docs", "mha", requires_grad=False)
    per_head = case.arguments["g"][..., 0]
    with pytest.raises(InputError, match=r"^g: expected shape"):
        case.call(TORCH, boundaries, {**case.arguments, "g": per_head})
    with pytest.raises(InputError, match=r"^v: expected a number of value heads"):
        case.call(TORCH, boundaries, {**case.arguments, "v": case.arguments["v"][:, :, :1].expand(-1, -1, 3, -1)})


def test_final_state_is_optional() -> None:
    case, boundaries = inputs("many_tiny_docs", "mha", torch.float32, output_final_state=False)
    o, final = case.call(TORCH, boundaries)
    o_with, _ = case.call(TORCH, boundaries, {**case.arguments, "output_final_state": True})
    assert final is None
    assert torch.equal(o, o_with)


@pytest.mark.parametrize(("defect", "reason"), [("ignores_boundaries", "differs"),
                                               ("gradient_leak", "reaches other segments")])
def test_self_check_refuses_a_kernel_that_mixes_documents(defect: str, reason: str, tmp_path, monkeypatch) -> None:
    """The op's self-check contract (check.py) catches a backend leaking across documents; the call falls back."""
    monkeypatch.setenv(kept.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    monkeypatch.setattr(kept, "_memory", {})
    monkeypatch.setattr(kept, "_loaded_from", None)
    planted = kit.with_defect(reference_of(OP).fn, defect)
    backends.register(OP, "planted", planted, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    try:
        boundaries = LAYOUTS["trailing_padding"].boundaries()
        case = kit.op_inputs(OP, contract_of(OP).default_signature(torch.float32, "cpu"), boundaries)
        o, _ = case.call(kda, boundaries)
        want, _ = case.call(TORCH, boundaries)
        assert torch.equal(o, want)
        row = next(row for row in backends.available(OP) if row.backend == "planted")
        assert not row.usable and reason in row.reason, row.reason
    finally:
        registry.unregister(OP, "planted")
