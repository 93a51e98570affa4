"""The public ops reject malformed inputs before any backend runs, naming the argument at fault."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.ops import causal_conv1d, gated_delta_rule, kda, mamba2_ssd, varlen_attention
from hybrid_pack.ops.dispatch.registry import contract_of
from tests import kit

LAYOUT = kit.Layout("three_docs", (3, 5, 2))
BOUNDARIES = LAYOUT.boundaries()
T = BOUNDARIES.total_tokens


def valid(op: str, signature: kit.Signature) -> dict[str, Any]:
    """Well-formed arguments of ``op`` (float32, no gradients) to break one at a time."""
    return kit.op_inputs(op, signature, BOUNDARIES, requires_grad=False).arguments


def attention_inputs(**shapes: tuple[int, ...]) -> dict[str, Any]:
    """q ``[1, T, 4, 8]``, k and v ``[1, T, 2, 8]``, with the tensors named in ``shapes`` replaced."""
    arguments = valid("attention", kit.attention_signature(kv_heads=2, dtype=torch.float32))
    return arguments | {name: torch.randn(*shape) for name, shape in shapes.items()}


def conv_inputs(**shapes: tuple[int, ...]) -> dict[str, Any]:
    """x ``[1, T, 6]``, weight ``[6, 4]``, bias ``[6]``, with the tensors named in ``shapes`` replaced."""
    arguments = valid("conv", kit.conv_signature(dtype=torch.float32))
    return arguments | {name: torch.randn(*shape) for name, shape in shapes.items()}


@pytest.mark.parametrize(("field", "shapes"), [
    ("q", {"q": (2, T, 4, 8)}),
    ("q", {"q": (1, T + 1, 4, 8)}),
    ("q", {"q": (1, T, 32)}),
    ("k", {"k": (2, T, 2, 8), "v": (2, T, 2, 8)}),
    ("k", {"k": (1, T - 1, 2, 8), "v": (1, T - 1, 2, 8)}),
    ("k", {"k": (1, T, 2, 4), "v": (1, T, 2, 4)}),
    ("k", {"k": (1, T, 3, 8), "v": (1, T, 3, 8)}),
    ("v", {"v": (1, T, 2, 16)}),
])
def test_attention_rejects_bad_shapes_naming_the_field(field: str, shapes: dict) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        varlen_attention(**attention_inputs(**shapes), boundaries=BOUNDARIES)


@pytest.mark.parametrize(("field", "shapes", "activation"), [
    ("x", {"x": (2, T, 6)}, None),
    ("x", {"x": (1, T + 2, 6)}, None),
    ("x", {"x": (T, 6)}, None),
    ("weight", {"weight": (5, 4)}, None),
    ("weight", {"weight": (6,)}, None),
    ("bias", {"bias": (4,)}, None),
    ("bias", {"bias": (1, 6)}, None),
    ("activation", {}, "relu"),
])
def test_conv_rejects_bad_inputs_naming_the_field(field: str, shapes: dict, activation: str | None) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        causal_conv1d(**conv_inputs(**shapes) | {"activation": activation}, boundaries=BOUNDARIES)


def test_well_formed_inputs_pass() -> None:
    """The inputs the cases above break are themselves accepted."""
    assert varlen_attention(**attention_inputs(), boundaries=BOUNDARIES).shape == (1, T, 4, 8)
    assert causal_conv1d(**conv_inputs(), boundaries=BOUNDARIES).shape == (1, T, 6)


def test_ops_reject_anything_but_packed_boundaries() -> None:
    with pytest.raises(ValueError, match=r"^boundaries: .*PackedBoundaries"):
        causal_conv1d(**conv_inputs(), boundaries=BOUNDARIES.cu_seqlens)
    with pytest.raises(ValueError, match=r"^boundaries: "):
        varlen_attention(**attention_inputs(), boundaries={"cu_seq_lens_q": BOUNDARIES.cu_seqlens})


SSD_PLAIN = kit.ssd_signature(dtype=torch.float32)  # 4 heads of 3, 4 groups of 5 states


@pytest.mark.parametrize(("field", "shapes"), [
    ("D", {"D": (5,)}),
    ("B", {"B": (1, T, 3, 5), "C": (1, T, 3, 5)}),
    ("initial_states", {"initial_states": (1, 4, 3, 5)}),
    ("x", {"x": (2, T, 4, 3)}),
])
def test_ssd_rejects_bad_shapes_naming_the_field(field: str, shapes: dict) -> None:
    t = valid("ssd", SSD_PLAIN) | {name: torch.zeros(*shape) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=rf"^{field}: "):
        mamba2_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], BOUNDARIES, D=t["D"], initial_states=t["initial_states"],
                   backend="torch")


@pytest.mark.parametrize(("op", "fn"), [("gated_delta", gated_delta_rule), ("kda", kda)])
@pytest.mark.parametrize("name", ["g", "beta"])
@pytest.mark.parametrize("static", [False, True], ids=["packed", "static"])
def test_delta_rules_reject_gates_on_another_device(op: str, fn: Any, name: str, static: bool) -> None:
    """A gate on another device (meta: no data) is named, where it would otherwise be read as garbage."""
    case = kit.op_inputs(op, contract_of(op).default_signature(torch.float32, "cpu"), BOUNDARIES, requires_grad=False)
    boundaries = StaticBoundaries.from_boundaries(BOUNDARIES, BOUNDARIES.num_segments + 1) if static else BOUNDARIES
    with pytest.raises(ValueError, match=rf"^{name}: on meta but q is on cpu"):
        case.call(fn, boundaries, {**case.arguments, name: case.arguments[name].to("meta")})


@pytest.mark.parametrize("op", ["attention", "conv", "gated_delta", "kda", "decay_linear_attention", "ssd",
                                "selective_scan"])
def test_every_tensor_on_another_device_is_named(op: str) -> None:
    """Each tensor argument moved to another device (meta: no data) in turn raises an error naming it, where torch
    raised deep inside a backend naming no argument."""
    from hybrid_pack.ops.dispatch.route import route_of

    case = kit.op_inputs(op, contract_of(op).default_signature(torch.float32, "cpu"), BOUNDARIES, requires_grad=False)
    public = route_of(op).public
    tensors = [name for name, value in case.arguments.items() if isinstance(value, torch.Tensor)]
    assert len(tensors) >= 2
    for name in tensors[1:]:
        with pytest.raises(ValueError, match=rf"\b{name}\b.*meta|meta.*\b{name}\b"):
            case.call(public, BOUNDARIES, {**case.arguments, name: case.arguments[name].to("meta")})


@pytest.mark.parametrize(("op", "name", "size"), [
    ("attention", "q", (1, T, 0, 8)), ("attention", "q", (1, T, 4, 0)), ("conv", "weight", (6, 0)),
    ("conv", "x", (1, T, 0)), ("gated_delta", "v", None), ("ssd", "x", None), ("selective_scan", "x", None)])
def test_a_zero_size_is_named(op: str, name: str, size: tuple[int, ...] | None) -> None:
    """A head count, head dim, channel count or width of 0 raises an error naming the argument (it raised
    ZeroDivisionError or a reshape error deep in a backend)."""
    from hybrid_pack.ops.dispatch.route import route_of

    case = kit.op_inputs(op, contract_of(op).default_signature(torch.float32, "cpu"), BOUNDARIES, requires_grad=False)
    shape = size or (*case.arguments[name].shape[:-1], 0)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        case.call(route_of(op).public, BOUNDARIES, {**case.arguments, name: torch.zeros(shape)})


def test_ssd_chunk_size_must_be_an_int() -> None:
    t = valid("ssd", SSD_PLAIN)
    with pytest.raises(ValueError, match="^chunk_size: expected a positive int; got None"):
        mamba2_ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], BOUNDARIES, chunk_size=None)
