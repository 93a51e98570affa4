"""Backend selection: priority, inputs a backend refuses, forcing (argument, context, environment), the
list of usable backends and the report; exercised with the torch backends of attention and conv and a
fake conv kernel."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from hybrid_pack import use_backends
from hybrid_pack.backends import ENV_VAR, Backend, available, register, report, select
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import causal_conv1d, varlen_attention
from hybrid_pack.ops.attention.torch_backend import varlen_attention as torch_varlen_attention
from hybrid_pack.ops.conv.torch_backend import causal_conv1d as torch_causal_conv1d
from hybrid_pack.ops.dispatch import registry, selector
from tests import kit

BOUNDARIES = kit.Layout("three_docs", (3, 5, 2)).boundaries()
T = BOUNDARIES.total_tokens


@pytest.fixture(autouse=True)
def no_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)


def attention_inputs(*, requires_grad: bool = False) -> dict[str, Any]:
    """q ``[1, T, 4, 8]``, k and v ``[1, T, 2, 8]`` in float32, causal."""
    signature = kit.attention_signature(kv_heads=2, dtype=torch.float32)
    return kit.op_inputs("attention", signature, BOUNDARIES, requires_grad=requires_grad).arguments


def conv_inputs(width: int = 4) -> dict[str, Any]:
    """x ``[1, T, 6]``, weight ``[6, width]``, bias ``[6]`` in float32, no activation."""
    return kit.op_inputs("conv", kit.conv_signature(width=width, dtype=torch.float32), BOUNDARIES,
                         requires_grad=False).arguments


FAKE_KERNEL_CALLS: list[int] = []
FAKE_ATTENTION_CALLS: list[int] = []


def fake_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: PackedBoundaries, *,
              activation: str | None) -> torch.Tensor:
    """Stands in for a conv kernel: records the width it was called with and returns the torch result."""
    FAKE_KERNEL_CALLS.append(weight.shape[1])
    return torch_causal_conv1d(x, weight, bias, boundaries, activation=activation)


def fake_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                   causal: bool, softmax_scale: float, window: int | None = None) -> torch.Tensor:
    """Stands in for an attention kernel: records the call and returns the torch result."""
    FAKE_ATTENTION_CALLS.append(q.shape[1])
    return torch_varlen_attention(q, k, v, boundaries, causal=causal, softmax_scale=softmax_scale, window=window)


@pytest.fixture
def torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """For one test, attention and conv have only their torch backends (whatever kernels this machine has)."""
    for op in ("attention", "conv"):
        monkeypatch.setitem(registry._BACKENDS, op, [registry.get_backend(op, "torch")])
    monkeypatch.setattr(selector, "_logged", set())


@pytest.fixture
def fake_conv_backend(torch_only: None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Registers, for one test only, a conv backend ranked above torch that takes widths up to 4.

    Its self-check is off (tests/ops/test_selfcheck.py covers it): these tests count the calls it serves.
    """
    FAKE_KERNEL_CALLS.clear()
    monkeypatch.setenv(selector.VERIFY_ENV, "0")

    def accepts(inputs: Mapping[str, Any]) -> str:
        width = inputs["weight"].shape[1]
        return "" if width <= 4 else f"test kernel takes widths up to 4, not {width}"

    register(Backend(op="conv", name="fake_kernel", impl=f"{__name__}:fake_conv", boundary_arg="seq_idx (test)",
                     priority=100, devices=("cpu",), accepts=accepts))
    return FAKE_KERNEL_CALLS


@pytest.fixture
def fake_attention_backend(torch_only: None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Registers, for one test only, an attention backend ranked above torch (self-check off)."""
    FAKE_ATTENTION_CALLS.clear()
    monkeypatch.setenv(selector.VERIFY_ENV, "0")
    register(Backend(op="attention", name="fake_kernel", impl=f"{__name__}:fake_attention",
                     boundary_arg="cu_seqlens (test)", priority=100, devices=("cpu",)))
    return FAKE_ATTENTION_CALLS


def test_higher_priority_backend_runs_when_it_accepts_the_inputs(fake_conv_backend: list[int]) -> None:
    assert select("conv", device="cpu", dtype=torch.float32) == "fake_kernel"
    causal_conv1d(**conv_inputs(width=4), boundaries=BOUNDARIES)
    assert fake_conv_backend == [4]


def test_rejected_inputs_fall_back_to_torch_and_log_once(fake_conv_backend: list[int],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    inputs = conv_inputs(width=6)
    with caplog.at_level(logging.WARNING, logger="hybrid_pack.backends"):
        first = causal_conv1d(**inputs, boundaries=BOUNDARIES)
        second = causal_conv1d(**inputs, boundaries=BOUNDARIES)
    assert fake_conv_backend == []
    skips = [r.getMessage() for r in caplog.records if "fake_kernel" in r.getMessage()]
    assert len(skips) == 1 and "widths up to 4, not 6" in skips[0]
    expected = torch_causal_conv1d(inputs["x"], inputs["weight"], inputs["bias"], BOUNDARIES, activation=None)
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_forcing_a_backend_that_rejects_the_inputs_raises(fake_conv_backend: list[int]) -> None:
    with pytest.raises(RuntimeError, match="fake_kernel.*widths up to 4, not 6"):
        causal_conv1d(**conv_inputs(width=6), boundaries=BOUNDARIES, backend="fake_kernel")
    with use_backends(conv="torch"):
        causal_conv1d(**conv_inputs(width=4), boundaries=BOUNDARIES)
    assert fake_conv_backend == []


@pytest.mark.parametrize("how", ["argument", "context", "environment"])
def test_torch_backends_can_be_forced(how: str, fake_conv_backend: list[int], fake_attention_backend: list[int],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With fake kernels ranked above torch, each way of forcing torch keeps them from serving the calls
    (``HYBRID_PACK_BACKENDS`` is read when a call key is first chosen: set before the run)."""
    if how == "environment":
        monkeypatch.setenv(ENV_VAR, "attention=torch, conv=torch")
    else:
        varlen_attention(**attention_inputs(), boundaries=BOUNDARIES)
        assert fake_attention_backend == [T]  # unforced, the fake kernel serves
    fake_attention_backend.clear()
    attention, conv = attention_inputs(), conv_inputs()
    if how == "argument":
        out_a = varlen_attention(**attention, boundaries=BOUNDARIES, backend="torch")
        out_c = causal_conv1d(**conv, boundaries=BOUNDARIES, backend="torch")
    elif how == "context":
        with use_backends(attention="torch", conv="torch"):
            out_a = varlen_attention(**attention, boundaries=BOUNDARIES)
            out_c = causal_conv1d(**conv, boundaries=BOUNDARIES)
    else:
        out_a = varlen_attention(**attention, boundaries=BOUNDARIES)
        out_c = causal_conv1d(**conv, boundaries=BOUNDARIES)
    assert fake_conv_backend == [] and fake_attention_backend == []
    assert out_a.shape == (1, T, 4, 8) and out_c.shape == (1, T, 6)


def test_forced_backend_outranks_a_higher_priority_one(fake_conv_backend: list[int],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "conv=torch")
    causal_conv1d(**conv_inputs(), boundaries=BOUNDARIES)
    with use_backends(conv="fake_kernel"):
        causal_conv1d(**conv_inputs(), boundaries=BOUNDARIES)
    assert fake_conv_backend == [4]


def test_unknown_backend_names_raise() -> None:
    with pytest.raises(ValueError, match="'nope' is not a backend of op 'attention'.*torch"):
        varlen_attention(**attention_inputs(), boundaries=BOUNDARIES, backend="nope")
    with pytest.raises(ValueError, match="^use_backends: .*'nope'"), use_backends(conv="nope"):
        pass
    with pytest.raises(ValueError, match="^use_backends: unknown op 'convolution'"), \
            use_backends(convolution="torch"):
        pass


@pytest.mark.parametrize(("value", "message"), [
    ("conv=nope", "'nope' is not a backend of op 'conv'"),
    ("conv", "expected comma-separated op=backend pairs"),
    ("attn=torch", "unknown op 'attn'"),
])
def test_bad_environment_override_raises(value: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=rf"^{ENV_VAR}: .*{message}"):
        causal_conv1d(**conv_inputs(), boundaries=BOUNDARIES)


def test_available_lists_usable_torch_backends() -> None:
    rows = {(r.op, r.backend): r for r in available()}
    for op in ("attention", "conv"):
        row = rows[(op, "torch")]
        assert row.usable and row.reason == "" and row.backward and row.priority == 0
    assert {r.op for r in available("conv")} == {"conv"}


def test_unusable_backends_say_why(torch_only: None) -> None:
    register(Backend(op="attention", name="missing_pkg", impl="no_such_module:fn", boundary_arg="cu_seqlens",
                     priority=50, requires=("hybrid_pack_no_such_package",)))
    register(Backend(op="attention", name="no_backward", impl="no_such_module:fn", boundary_arg="cu_seqlens",
                     priority=40, devices=("cpu",), backward=False))
    rows = {r.backend: r for r in available("attention")}
    assert not rows["missing_pkg"].usable and "hybrid_pack_no_such_package" in rows["missing_pkg"].reason
    assert select("attention", device="cpu", dtype=torch.float32, requires_grad=True) == "torch"
    with pytest.raises(RuntimeError, match="missing_pkg.*not installed"):
        varlen_attention(**attention_inputs(), boundaries=BOUNDARIES, backend="missing_pkg")
    with pytest.raises(RuntimeError, match="no_backward.*has no backward pass"):
        varlen_attention(**attention_inputs(requires_grad=True), boundaries=BOUNDARIES, backend="no_backward")
    text = report("cpu")
    assert "no: package 'hybrid_pack_no_such_package' is not installed" in text
    assert "no: has no backward pass" in text


def test_select_and_report_on_cpu(torch_only: None) -> None:
    for op in ("attention", "conv"):
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            assert select(op, device="cpu", dtype=dtype, requires_grad=True) == "torch"
    lines = report("cpu", torch.float32).splitlines()
    assert lines[0].startswith("hybrid_pack backends on cpu, float32")
    chosen = [line.split() for line in lines if "CHOSEN" in line]
    assert chosen[0][:2] == ["attention", "torch"] and chosen[1][:2] == ["conv", "torch"]


def test_report_lists_the_context_parallel_backends_with_why_not_here() -> None:
    """fla's context parallelism (conv, gated delta) is listed with its reason, read without any collective."""
    section = report("cpu").split("\ncontext parallelism")[1].splitlines()
    rows = {tuple(line.split()[:3]): line for line in section if "fla_cp" in line}
    assert set(rows) == {("conv", "fla_cp", "ShardedBoundaries"), ("gated_delta", "fla_cp", "ShardedBoundaries")}
    assert all("no: runs on cuda, not cpu" in r for r in rows.values())
