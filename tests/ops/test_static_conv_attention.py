"""The causal conv and attention on static boundaries (``ops/conv/torch_static.py``,
``ops/attention/torch_static.py``): the pure-torch backends' results on the plain boundaries of the same
documents, forward and backward; no gradient across segments; one compiled graph, with no break, for every
layout of the same (T, S).

Every layout holds S = 9 slots (8 documents at most, then the padding slot). The conv's rows hold 40 tokens
with documents shorter than, as long as and one longer than its taps reach; attention's hold 600 tokens
with documents ending one short of, on and one past its 256-token query blocks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries import StaticBoundaries
from hybrid_pack.ops.attention import torch_backend as attention_backend
from hybrid_pack.ops.attention import torch_static as attention_static
from hybrid_pack.ops.conv import torch_backend as conv_backend
from hybrid_pack.ops.conv import torch_static as conv_static
from tests import kit
from tests.kit import Layout

MAX_DOCUMENTS = 8
CONV_LAYOUTS = kit.named(  # 40 tokens
    Layout("one_token_docs", (1,) * 8, num_pad_tokens=32),
    Layout("width_edges", (3, 4, 5, 1, 2, 25)),  # W - 1, W and W + 1 tokens for W = 4
    Layout("long_beside_short", (1, 33, 2, 4)),
    Layout("padding_and_unused_slots", (5, 9, 3), num_pad_tokens=23),
    Layout("single_document", (40,)),
    Layout("every_slot", (4, 4, 1, 7, 2, 6, 3, 5), num_pad_tokens=8),
)
ATTENTION_LAYOUTS = kit.named(  # 600 tokens, query blocks of QUERY_BLOCK = 256
    Layout("block_edges", (255, 1, 257, 1, 86)),  # ends on 255, 256, 513, 514, 600
    Layout("one_token_docs", (1,) * 8, num_pad_tokens=592),
    Layout("long_beside_short", (1, 520, 2, 3), num_pad_tokens=74),
    Layout("padding_and_unused_slots", (100, 200), num_pad_tokens=300),
    Layout("single_document", (600,)),
    Layout("every_slot", (75,) * 7 + (70,), num_pad_tokens=5),
)
LAYOUTS = {"conv": CONV_LAYOUTS, "attention": ATTENTION_LAYOUTS}
BACKENDS = {"conv": conv_backend.causal_conv1d, "attention": attention_backend.varlen_attention}


def on_plain_boundaries(static_fn: kit.OpFn) -> kit.OpFn:
    """``static_fn`` called like the torch backend: on the static form of the plain boundaries it is given."""

    def call(*args: Any, **options: Any) -> Any:
        *tensors, boundaries = args
        return static_fn(*tensors, StaticBoundaries.from_boundaries(boundaries, MAX_DOCUMENTS), **options)

    return call


STATIC = {"conv": on_plain_boundaries(conv_static.causal_conv1d),
          "attention": on_plain_boundaries(attention_static.varlen_attention)}


def signature(op: str, *, dtype: torch.dtype = torch.float64, variant: int = 0) -> kit.Signature:
    """Variant 0: the conv with silu and bias, width 4; causal attention, 2 query heads per key/value head.
    Variant 1: no activation, no bias, width 2; non-causal attention, one key/value head for 4 query heads.
    Variant 2: width 8 with silu, no bias; causal attention without grouping."""
    if op == "conv":
        width, activation, bias = ((4, "silu", True), (2, None, False), (8, "silu", False))[variant]
        return kit.conv_signature(width=width, activation=activation, bias=bias, dtype=dtype)
    kv_heads, causal = ((2, True), (1, False), (4, True))[variant]
    return kit.attention_signature(heads=4, kv_heads=kv_heads, causal=causal, dtype=dtype)


def inputs(op: str, layout: str, *, dtype: torch.dtype = torch.float64, variant: int = 0
           ) -> tuple[kit.CheckCase, PackedBoundaries]:
    boundaries = LAYOUTS[op][layout].boundaries()
    return kit.op_inputs(op, signature(op, dtype=dtype, variant=variant), boundaries), boundaries


def assert_all_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], *, tol: float, what: str) -> None:
    assert set(got) == set(want), what
    for name, value in want.items():
        kit.assert_close(got[name], value, f"{what}: {name}", tol=tol)


def one_token_softmax(name: str, length: int) -> bool:
    """A one-token segment's softmax is constant: no gradient reaches its q or k."""
    return length == 1 and name in ("q", "k")


CASES = [(op, layout, variant) for op in LAYOUTS for layout in LAYOUTS[op] for variant in range(3)]


@pytest.mark.parametrize(("op", "layout", "variant"), CASES)
def test_matches_torch_backend(op: str, layout: str, variant: int) -> None:
    """Output and the gradient of every floating input in float64."""
    case, boundaries = inputs(op, layout, variant=variant)
    want = kit.forward_backward(op, BACKENDS[op], case, boundaries)
    got = kit.forward_backward(op, STATIC[op], case, boundaries)
    assert len(want) == 1 + sum(isinstance(v, torch.Tensor) for v in case.arguments.values())
    assert_all_close(got, want, tol=1e-10, what=f"{op}, {layout}")


@pytest.mark.parametrize(("op", "layout", "variant"), [c for c in CASES if c[2] < 2])
def test_no_gradient_crosses_segments(op: str, layout: str, variant: int) -> None:
    case, boundaries = inputs(op, layout, variant=variant)
    kit.assert_no_gradient_crosses_segments(op, STATIC[op], case, boundaries, may_vanish=one_token_softmax)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", list(LAYOUTS))
def test_lower_precision_is_close_to_torch_backend(op: str, dtype: torch.dtype) -> None:
    """Outputs in the input's dtype, gradients in their inputs' dtypes, close to the torch backend's."""
    case, boundaries = inputs(op, "every_slot", dtype=dtype)
    want = kit.forward_backward(op, BACKENDS[op], case, boundaries)
    got = kit.forward_backward(op, STATIC[op], case, boundaries)
    assert got["output"].dtype == dtype
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        scale = value.abs().max().double()
        kit.assert_close(got[name].double() / scale, value.double() / scale, name,
                         tol=1e-5 if dtype == torch.float32 else 2e-2)


STATIC_FUNCTIONS = {"conv": conv_static.causal_conv1d, "attention": attention_static.varlen_attention}


@pytest.mark.parametrize(("op", "variant", "backend", "layouts"), [
    ("conv", 0, "aot_eager", list(CONV_LAYOUTS)),
    ("conv", 1, "inductor", ["padding_and_unused_slots", "width_edges", "one_token_docs"]),
    ("attention", 0, "aot_eager", list(ATTENTION_LAYOUTS)),
    ("attention", 1, "aot_eager", ["block_edges", "single_document", "every_slot"]),
    ("attention", 0, "inductor", ["padding_and_unused_slots", "block_edges", "one_token_docs"]),
])
def test_one_graph_for_every_layout(op: str, variant: int, backend: str, layouts: list[str]) -> None:
    """``fullgraph=True`` (no graph break, no host read) compiles one graph for every layout of the same (T, S),
    and the compiled forward and backward match eager in float32."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = on_plain_boundaries(torch.compile(STATIC_FUNCTIONS[op], backend=backend, fullgraph=True,
                                                 dynamic=False))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layout in layouts:
            case, boundaries = inputs(op, layout, dtype=torch.float32, variant=variant)
            want = kit.forward_backward(op, STATIC[op], case, boundaries)
            assert_all_close(kit.forward_backward(op, compiled, case, boundaries), want, tol=1e-5,
                             what=f"{op}, {backend}, {layout}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
