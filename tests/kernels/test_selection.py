"""Backend selection with the real kernel packages installed and the CPU interpreter enabled."""

from __future__ import annotations

import inspect
import logging
import sys

import pytest
import torch

from hybrid_pack.backends import available, get_backend, resolve, select, use_backends
from hybrid_pack.ops import causal_conv1d, gated_delta_rule
from hybrid_pack.ops.conv.kernel_causal_conv1d import conv_accepts
from hybrid_pack.ops.triton_device import cpu_interpreter_enabled
from tests import kit
from tests.kernels.triton_cpu import CUDA_EXTENSIONS, enable_cpu_interpreter

pytestmark = pytest.mark.kernels

CPU = torch.device("cpu")


def interpreter_patches() -> dict[str, object]:
    """Everything :func:`enable_cpu_interpreter` replaces, by name."""
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    return {"Autotuner.do_bench": Autotuner.__dict__["do_bench"],
            "loop-counter AST transformer": interpreter.FunctionRewriter.ast_transformer,
            "torch.cuda.get_device_properties": torch.cuda.get_device_properties,
            "torch.cuda._exchange_device": torch.cuda._exchange_device,
            "torch.cuda._maybe_exchange_device": torch.cuda._maybe_exchange_device,
            **{name: sys.modules[name] for name in CUDA_EXTENSIONS}}


def test_interpreter_is_enabled_once() -> None:
    """The tier's conftest enabled the interpreter; enabling it again replaces nothing, clears no cache of
    rewritten kernels, and the device-properties patch wraps torch's own function, once."""
    from triton.runtime.interpreter import InterpretedFunction

    assert cpu_interpreter_enabled()
    before = interpreter_patches()
    rewritten = object()
    InterpretedFunction.rewritten_fn[rewritten] = rewritten  # stands for a kernel rewritten by the transformer
    try:
        enable_cpu_interpreter()
        assert InterpretedFunction.rewritten_fn.get(rewritten) is rewritten, "the rewritten kernels were dropped"
    finally:
        InterpretedFunction.rewritten_fn.pop(rewritten, None)
    after = interpreter_patches()
    replaced = [name for name in before if after[name] is not before[name]]
    assert not replaced, f"enabled twice: {replaced} replaced again"
    wrapped = inspect.getclosurevars(torch.cuda.get_device_properties).nonlocals["get_properties"]
    assert wrapped.__module__ == "torch.cuda", f"get_device_properties wrapped more than once: {wrapped}"
    assert torch.cuda.get_device_properties(CPU).multi_processor_count == 1


@pytest.mark.parametrize(("op", "name"), [("conv", "fla"), ("gated_delta", "fla"), ("ssd", "mamba_ssm")])
def test_triton_backends_lead_on_cpu_in_float32_only(op: str, name: str) -> None:
    assert select(op, device=CPU, dtype=torch.float32, requires_grad=True) == name
    assert select(op, device=CPU, dtype=torch.bfloat16) == "torch"
    assert "float32" in get_backend(op, name).reason(CPU, torch.bfloat16, False)
    assert {r.backend: r.usable for r in available(op)}[name]


def test_triton_backends_step_aside_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not cpu_interpreter_enabled()
    assert select("gated_delta", device=CPU, dtype=torch.float32) == "torch"
    assert "interpreter" in get_backend("ssd", "mamba_ssm").reason(CPU, torch.float32, False)


@pytest.mark.parametrize(("op", "name"), [("attention", "flash_attn"), ("attention", "torch_varlen"),
                                          ("attention", "flex"), ("conv", "causal_conv1d")])
def test_cuda_only_backends_refuse_cpu_when_forced(op: str, name: str) -> None:
    with pytest.raises(RuntimeError, match=f"{op} backend '{name}' .* cannot run here: "):
        resolve(op, device=CPU, dtype=torch.float16, backend=name)


def test_causal_conv1d_refuses_what_it_cannot_keep_apart() -> None:
    assert conv_accepts({"weight": torch.empty(16, 4)}) == ""
    assert "widths" in conv_accepts({"weight": torch.empty(16, 5)})
    assert "divisible by 8" in conv_accepts({"weight": torch.empty(12, 3)})


def test_forced_kernel_that_cannot_take_the_inputs_raises() -> None:
    b = kit.KERNEL_LAYOUTS["long_next_to_short"].boundaries()
    q = torch.randn(1, b.total_tokens, 1, 320)
    v = torch.randn(1, b.total_tokens, 1, 4)
    g, beta = torch.zeros(2, 1, b.total_tokens, 1)
    with pytest.raises(RuntimeError, match="head dims up to 256; got 320"):
        gated_delta_rule(q, q, v, g, beta, b, backend="fla")
    with use_backends(gated_delta="fla"), pytest.raises(RuntimeError, match="forced by use_backends"):
        gated_delta_rule(q, q, v, g, beta, b)


def test_automatic_choice_falls_through_to_torch_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    b = kit.KERNEL_LAYOUTS["long_next_to_short"].boundaries()
    inputs = {"q": torch.randn(1, b.total_tokens, 1, 288)}
    with caplog.at_level(logging.WARNING, logger="hybrid_pack.backends"):
        for _ in range(2):
            chosen = resolve("gated_delta", device=CPU, dtype=torch.float32, inputs=inputs)
            assert chosen.name == "torch"
    skips = [r for r in caplog.records if "skipping backend 'fla'" in r.getMessage()]
    assert len(skips) == 1 and "288" in skips[0].getMessage()


@pytest.mark.parametrize(("inputs", "reason"), [
    ({"chunk_size": 48}, "chunk_size"),
    ({"chunk_size": 64, "initial_states": torch.zeros(2, 1, 1, 1)}, "one initial state per row"),
    ({"chunk_size": 64, "return_final_states": True, "requires_grad": True}, "no backward"),
])
def test_mamba_ssm_refuses_inputs_it_would_get_wrong(inputs: dict, reason: str) -> None:
    with pytest.raises(RuntimeError, match=reason):
        resolve("ssd", device=CPU, dtype=torch.float32, backend="mamba_ssm", inputs=inputs)
    assert resolve("ssd", device=CPU, dtype=torch.float32, inputs=inputs).name == "torch"


def test_mamba_ssm_adapter_never_drops_initial_states() -> None:
    from hybrid_pack.ops.ssd.kernel_mamba_ssm import mamba2_ssd as mamba_ssm_adapter

    b = kit.KERNEL_LAYOUTS["long_next_to_short"].boundaries()
    x = torch.randn(1, b.total_tokens, 1, 2)
    dt, a = torch.zeros(1, b.total_tokens, 1), -torch.ones(1)
    bm = torch.randn(1, b.total_tokens, 1, 4)
    with pytest.raises(ValueError, match="one initial state per row"):
        mamba_ssm_adapter(x, dt, a, bm, bm, b, D=None, z=None, dt_bias=None, dt_softplus=True, chunk_size=64,
                          initial_states=torch.zeros(b.num_docs, 1, 2, 4), return_final_states=False)


def test_conv_width_beyond_causal_conv1d_runs_on_fla() -> None:
    b = kit.KERNEL_LAYOUTS["long_next_to_short"].boundaries()
    x, weight = torch.randn(1, b.total_tokens, 8), torch.randn(8, 6)
    assert select("conv", device=CPU, dtype=torch.float32) == "fla"
    kit.assert_close(causal_conv1d(x, weight, None, b), causal_conv1d(x, weight, None, b, backend="torch"), "y",
                     tol=1e-4)
