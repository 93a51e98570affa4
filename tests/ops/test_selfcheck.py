"""Backends prove themselves (docs/api.md §5a): planted kernels that are wrong in one way each are
refused before they serve, and the call goes to the next backend; a correct one is admitted.

Every planted kernel is the op's own pure-torch backend with one defect: it ignores the boundaries
(leaks forward), mixes gradients across documents only in its backward pass, is 1% or 0.1% off, raises, or
raises in its backward pass. They run on CPU in float32, for every op with boundaries (linear cross-entropy's
planted kernels: tests/ops/test_linear_cross_entropy.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from hybrid_pack import PackedBoundaries, backends, use_backends
from hybrid_pack.cli import main as cli_main
from hybrid_pack.errors import BackendUnavailableError
from hybrid_pack.isolation import SELF_CHECK_TOLERANCE
from hybrid_pack.ops import causal_conv1d
from hybrid_pack.ops.dispatch import registry, selector, verdicts
from hybrid_pack.ops.dispatch.registry import contract_of, reference_of
from hybrid_pack.ops.selfcheck import kept, whole_row
from hybrid_pack.ops.selfcheck import result as result_module
from hybrid_pack.ops.selfcheck.result import CheckResult, device_name
from tests import kit

PLANTED = "planted"
ROW = kit.Layout("short_long_and_padding", (3, 1, 20, 7), num_pad_tokens=2)


def plant(op: str, defect: str) -> Callable[..., Any]:
    """The op's pure-torch backend with ``defect`` (``"none"``: as it is)."""
    reference = reference_of(op).fn
    kernel = reference if defect == "none" else kit.with_defect(reference, defect)

    def planted(*args: Any, **kwargs: Any) -> Any:
        return kernel(*args, **kwargs)

    planted.__name__ = planted.__qualname__ = f"{op}_{defect}"
    return planted


@pytest.fixture(autouse=True)
def fresh_results(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no check results, its own cache directory and no override."""
    monkeypatch.setenv(kept.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    monkeypatch.delenv(selector.VERIFY_ENV, raising=False)
    monkeypatch.setattr(kept, "_memory", {})
    monkeypatch.setattr(kept, "_loaded_from", None)
    monkeypatch.setattr(selector, "_logged", set())
    yield
    kept._environment_digest.cache_clear()
    for op in registry.registered_ops():
        if any(b.name == PLANTED for b in registry.backends_of(op)):
            registry.unregister(op, PLANTED)


def register_planted(op: str, defect: str, calls: list[int] | None = None, **kwargs: Any) -> None:
    kernel = plant(op, defect)

    def counted(*args: Any, **kw: Any) -> Any:
        if calls is not None:
            calls.append(1)
        return kernel(*args, **kw)

    counted.__qualname__ = kernel.__qualname__
    backends.register(op, PLANTED, counted if calls is not None else kernel, priority=100, devices=("cpu",),
                      dtypes=(torch.float32,), **kwargs)


def call_op(op: str, requires_grad: bool, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """Call the public op on a small packed row of the op's typical CPU signature; returns (result, inputs)."""
    boundaries = ROW.boundaries()
    signature = contract_of(op).default_signature(torch.float32, "cpu")
    case = kit.op_inputs(op, signature, boundaries, seed=seed, requires_grad=requires_grad)
    return case.call(kit.PUBLIC_OPS[op], boundaries), case.arguments


def reference_result(op: str, args: dict[str, Any]) -> Any:
    boundaries = ROW.boundaries()
    case = kit.op_inputs(op, contract_of(op).default_signature(torch.float32, "cpu"), boundaries)
    detached = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return case.call(reference_of(op).fn, boundaries, detached)


def first_tensor(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def status_of(op: str) -> backends.BackendStatus:
    return next(row for row in backends.available(op) if row.backend == PLANTED)


OPS = ("attention", "conv", "gated_delta", "ssd", "kda", "decay_linear_attention", "selective_scan")
REFUSED = {  # defect -> what the reason says
    "ignores_boundaries": "differs",
    "gradient_leak": "reaches other segments",
    "one_percent_off": "differs by 0.01",
    "tenth_percent_off": "differs by 0.001",
    "raises": "raised RuntimeError in its self-check: planted failure",
    "backward_raises": "planted backward failure",
    "ignores_boundaries_without_grad": "without gradients, against the pure-torch backend",
    "float64_outputs": "output 0 is torch.float64, expected torch.float32",
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("defect", sorted(REFUSED))
def test_defective_kernel_is_refused_and_the_call_falls_back(op: str, defect: str,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    register_planted(op, defect)
    with caplog.at_level(logging.WARNING, logger="hybrid_pack.backends"):
        result, args = call_op(op, requires_grad=True)
        call_op(op, requires_grad=True, seed=1)
    torch.testing.assert_close(first_tensor(result), first_tensor(reference_result(op, args)), rtol=0, atol=0)
    row = status_of(op)
    assert not row.usable and REFUSED[defect] in row.reason, row.reason
    assert [c.ok for c in row.checks] == [False]
    skips = [r.getMessage() for r in caplog.records if PLANTED in r.getMessage()]
    assert len(skips) == 1 and REFUSED[defect] in skips[0]
    forced = rf"{op} backend '{PLANTED}' \(forced by use_backends\(\)\)"
    with pytest.raises(BackendUnavailableError, match=forced), use_backends(**{op: PLANTED}):
        call_op(op, requires_grad=True)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("defect", ["gradient_leak", "backward_raises"])
def test_forward_only_check_admits_a_kernel_whose_backward_is_refused(op: str, defect: str) -> None:
    calls: list[int] = []
    register_planted(op, defect, calls)
    with torch.no_grad():
        result, args = call_op(op, requires_grad=False)
    served = len(calls)
    torch.testing.assert_close(first_tensor(result), first_tensor(reference_result(op, args)))
    assert served > 0 and status_of(op).usable  # checked forward-only, then served the call
    before = len(calls)
    call_op(op, requires_grad=True)
    checks = {c.requires_grad: c.ok for c in status_of(op).checks}
    assert checks == {False: True, True: False}
    assert len(calls) > before  # the backward check ran the kernel, and it was refused after


@pytest.mark.parametrize("op", OPS)
def test_correct_kernel_is_checked_once_then_serves(op: str) -> None:
    calls: list[int] = []
    register_planted(op, "none", calls)
    call_op(op, requires_grad=True)
    after_first = len(calls)
    call_op(op, requires_grad=True, seed=3)
    assert len(calls) == after_first + 1  # no second check: one more call, the call itself
    row = status_of(op)
    assert row.usable and row.reason == "" and [c.ok for c in row.checks] == [True]
    assert row.checks[0].max_error <= 1e-5 and row.checks[0].seconds > 0


def test_results_are_kept_on_disk_per_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    register_planted("conv", "one_percent_off", calls)
    call_op("conv", requires_grad=True)
    files = list((tmp_path / "cache").glob("backend-checks-*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["environment"]["torch"] == torch.__version__
    [(key, record)] = [(k, r) for k, r in stored["results"].items() if f"|{PLANTED}|" in k]
    assert key.startswith("conv|planted|") and not record["ok"] and "differs by 0.01" in record["reason"]

    new_process(monkeypatch)  # in the same environment
    calls.clear()
    call_op("conv", requires_grad=True)
    assert calls == [] and not status_of("conv").usable  # refused from the file, without running it

    new_process(monkeypatch)  # another torch: a fresh file, a fresh check
    monkeypatch.setattr(kept, "environment", lambda: {**json.loads(files[0].read_text())["environment"],
                                                          "torch": "0.0.0-other"})
    kept._environment_digest.cache_clear()
    call_op("conv", requires_grad=True)
    assert calls and len(list((tmp_path / "cache").glob("backend-checks-*.json"))) == 2


def new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process starts from: nothing kept, settled or chosen in memory."""
    for module, name, value in ((kept, "_memory", {}), (kept, "_loaded_from", None), (verdicts, "SETTLED", {}),
                                (verdicts, "CHOICES", {})):
        monkeypatch.setattr(module, name, value)


def raises_out_of_memory(*args: Any, **kwargs: Any) -> Any:
    raise torch.cuda.OutOfMemoryError("planted: CUDA out of memory")


@pytest.mark.parametrize(("kernel", "kept_on_disk"), [("raises", True), ("out_of_memory", False)])
def test_a_raising_check_is_kept_on_disk_and_one_out_of_memory_is_not(kernel: str, kept_on_disk: bool,
                                                                      tmp_path: Any) -> None:
    fn = plant("conv", "raises") if kernel == "raises" else raises_out_of_memory
    backends.register("conv", PLANTED, fn, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    call_op("conv", requires_grad=True)
    assert not status_of("conv").usable
    stored = [json.loads(f.read_text())["results"] for f in (tmp_path / "cache").glob("backend-checks-*.json")]
    planted = [record for results in stored for key, record in results.items() if f"|{PLANTED}|" in key]
    assert bool(planted) == kept_on_disk
    if not kept_on_disk:
        assert "ran out of memory" in status_of("conv").reason


def test_a_check_on_cuda_without_an_index_runs_on_the_callers_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hybrid-pack backends --verify --device cuda` crashed on a GPU: the check's thread called
    `torch.cuda.set_device(torch.device("cuda"))`, which needs an index. It takes the calling thread's device."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: seen.setdefault("set_device", index))
    monkeypatch.setattr(result_module, "_cuda_name", lambda index: f"cuda planted {index}")

    def checked(backend: Any, reference: Any, contract: Any, signature: Any, device: torch.device,
                requires_grad: bool) -> CheckResult:
        seen["device"] = device
        return CheckResult(backend.op, backend.name, True, "", 0.0, 0.0, device_name(device))

    monkeypatch.setattr(whole_row, "run_check", checked)
    backend = registry.get_backend("conv", "torch")
    signature = contract_of("conv").default_signature(torch.float32, "cuda")
    result = selector.local_verdict(backend, signature, torch.device("cuda"), True)
    assert seen == {"set_device": 3, "device": torch.device("cuda")} and result.device == "cuda planted 3"


def test_replacing_a_kernel_forgets_its_results() -> None:
    register_planted("conv", "raises")
    call_op("conv", requires_grad=True)
    assert not status_of("conv").usable
    calls: list[int] = []
    register_planted("conv", "none", calls, replace=True)
    call_op("conv", requires_grad=True)
    assert calls and status_of("conv").usable


def test_verification_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    register_planted("conv", "one_percent_off", calls)
    monkeypatch.setenv(selector.VERIFY_ENV, "0")
    result, args = call_op("conv", requires_grad=False)
    assert calls == [1]  # trusted without a check: the caller asked for it
    torch.testing.assert_close(result, reference_result("conv", args) * 1.01)


def test_no_check_runs_inside_a_trace_and_an_unsettled_kernel_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no check may run, a kernel that could serve without a settled verdict raises, naming the warm-up
    (never a silent fallback); eagerly, the first call settles it."""
    calls: list[int] = []
    register_planted("conv", "none", calls)
    monkeypatch.setattr(selector, "tracing", lambda: True)
    with pytest.raises(backends.WarmUpError, match=r"could serve .* in a compiled graph .*backends\.verify\("):
        call_op("conv", requires_grad=True)
    with pytest.raises(backends.WarmUpError, match="backends.verify"), use_backends(conv=PLANTED):
        call_op("conv", requires_grad=True)
    assert calls == [] and not status_of("conv").checks
    monkeypatch.setattr(selector, "tracing", lambda: False)
    call_op("conv", requires_grad=True)
    assert calls and status_of("conv").usable


def test_verify_refuses_to_run_inside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    register_planted("conv", "none")
    monkeypatch.setattr(selector, "tracing", lambda: True)
    with pytest.raises(backends.WarmUpError, match="cannot run inside a CUDA graph capture"):
        backends.verify("conv", device="cpu")
    assert not status_of("conv").checks


def test_compiled_caller_gets_a_correct_result() -> None:
    register_planted("conv", "one_percent_off")
    _, args = call_op("conv", requires_grad=False)
    boundaries = ROW.boundaries()

    def conv(x: torch.Tensor) -> torch.Tensor:
        return causal_conv1d(x, args["weight"], args["bias"], boundaries, activation=args["activation"])

    compiled = torch.compile(conv, backend="eager")
    torch.testing.assert_close(compiled(args["x"]), reference_result("conv", args))


def test_verify_checks_every_backend_now_and_reports_failures() -> None:
    register_planted("ssd", "gradient_leak")
    results = {(r.op, r.backend): r for r in backends.verify(device="cpu")}
    assert {op for op, _ in results} >= set(OPS)
    for op in OPS:
        assert results[(op, "torch")].ok, results[(op, "torch")].reason
    planted = results[("ssd", PLANTED)]
    assert not planted.ok and "reaches other segments" in planted.reason and planted.seconds > 0
    assert planted.signature and planted.device == "cpu" and planted.requires_grad
    assert planted.max_error > 0 and f"max {planted.max_error:.3g}" in planted.reason


def test_a_failed_check_reports_the_error_that_failed_it() -> None:
    register_planted("conv", "one_percent_off")
    [planted] = [r for r in backends.verify("conv", device="cpu") if r.backend == PLANTED]
    assert not planted.ok and planted.max_error == pytest.approx(0.01, rel=0.2)
    assert f"differs by {planted.max_error:.3g}" in planted.reason


WITH_BOUNDARIES = ("attention", "conv", "gated_delta", "ssd", "kda", "decay_linear_attention", "selective_scan")


@pytest.mark.parametrize("op", WITH_BOUNDARIES)
def test_a_kernel_a_tenth_of_a_percent_off_is_refused_and_an_exact_one_admitted(op: str) -> None:
    """The float32 self-check tolerance (1e-5, ``SELF_CHECK_TOLERANCE``) sits between what a correct float32
    kernel reaches (the op's own backend in float32 against float64, ~1e-6) and a 0.1 % numerics bug."""
    register_planted(op, "tenth_percent_off")
    [planted] = [r for r in backends.verify(op, device="cpu", dtype=torch.float32) if r.backend == PLANTED]
    assert not planted.ok and planted.max_error == pytest.approx(1e-3, rel=0.2), planted.reason
    registry.unregister(op, PLANTED)
    register_planted(op, "none")
    [exact] = [r for r in backends.verify(op, device="cpu", dtype=torch.float32) if r.backend == PLANTED]
    assert exact.ok and exact.max_error < SELF_CHECK_TOLERANCE[torch.float32] / 4, exact


def test_cli_verify_exits_1_when_a_backend_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["backends", "--verify", "--device", "cpu"]) == 0
    register_planted("conv", "one_percent_off")
    assert cli_main(["backends", "--verify", "--device", "cpu"]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "conv" in out and PLANTED in out and "FAILED" in out and "differs by 0.01" in out
    assert "self-checks" in captured.err  # the progress bar


def test_register_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="op: expected one of"):
        backends.register("softmax", PLANTED, plant("conv", "none"), priority=1)
    with pytest.raises(ValueError, match="register"):
        backends.register("conv", PLANTED, None, priority=1)  # type: ignore[arg-type]
    backends.register("conv", PLANTED, plant("conv", "none"), priority=1, devices=("cpu",))
    with pytest.raises(ValueError, match="already registered.*replace=True"):
        backends.register("conv", PLANTED, plant("conv", "none"), priority=1)
    assert [b.name for b in backends.backends_of("conv")][-1] == "torch"  # the pure-torch backend ranks last
    registry.unregister("conv", PLANTED)
    for field, wrong in (("devices", {"devices": "cpu"}), ("devices", {"devices": ("cpu", "gpu0")}),
                         ("dtypes", {"dtypes": torch.float32}), ("dtypes", {"dtypes": ("float32",)}),
                         ("priority", {"priority": -1}), ("priority", {"priority": 0}),
                         ("priority", {"priority": "high"}), ("fn", {"fn": "mymodule.conv"}), ("fn", {"fn": 3}),
                         ("reference", {"reference": True})):
        arguments = {"fn": plant("conv", "none"), "priority": 1, "devices": ("cpu",), **wrong}
        with pytest.raises(ValueError, match=f"^{field}: (expected|op 'conv' has its pure-torch reference)"):
            backends.register("conv", PLANTED, arguments.pop("fn"), **arguments)


@pytest.mark.parametrize("fn", ["no_such_module_anywhere:conv", "hybrid_pack.ops.conv.torch_backend:no_such_fn"])
def test_a_kernel_that_cannot_be_imported_is_refused_with_the_error(fn: str) -> None:
    """Its key's fingerprint imported it: every call of the op (and report()) raised the ImportError."""
    backends.register("conv", PLANTED, fn, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    result, args = call_op("conv", requires_grad=True)
    torch.testing.assert_close(result, reference_result("conv", args), rtol=0, atol=0)
    assert "raised" in status_of("conv").reason and "Error" in status_of("conv").reason
    assert "no: raised" in next(line for line in backends.report(device="cpu").splitlines() if PLANTED in line)


def test_with_checks_off_a_kept_failure_still_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HYBRID_PACK_VERIFY=0`` is for an environment verified before: a kernel that failed there served."""
    register_planted("conv", "one_percent_off")
    assert not next(r for r in backends.verify("conv", device="cpu") if r.backend == PLANTED).ok
    verdicts.SETTLED.clear()
    verdicts.changed()
    monkeypatch.setenv(selector.VERIFY_ENV, "0")
    result, args = call_op("conv", requires_grad=True)
    torch.testing.assert_close(result, reference_result("conv", args), rtol=0, atol=0)
    line = next(line for line in backends.report(device="cpu").splitlines() if PLANTED in line)
    assert "no: failed its self-check" in line


def test_report_shows_what_runs_under_forcing_and_what_failed_below_the_choice() -> None:
    """Forced to torch, a passed kernel above it read CHOSEN too; a lower kernel that failed read "not checked"."""
    register_planted("conv", "none")
    backends.register("conv", "planted_low", plant("conv", "one_percent_off"), priority=50, devices=("cpu",),
                      dtypes=(torch.float32,))
    try:
        backends.verify("conv", device="cpu")
        with use_backends(conv="torch"):
            table = backends.report(device="cpu")
        rows = {line.split()[1]: line for line in table.splitlines() if line.startswith("conv ")}
        assert "CHOSEN" in rows["torch"] and "CHOSEN" not in rows[PLANTED]
        assert "'torch' forced by use_backends()" in rows[PLANTED] and "forced by use_backends()" in table
        assert "no: failed its self-check" in rows["planted_low"]
    finally:
        registry.unregister("conv", "planted_low")


def test_verify_checks_a_kernel_without_a_backward_forward_only(capsys: pytest.CaptureFixture[str]) -> None:
    """`--verify` left out kernels registered with backward=False: a wrong inference kernel exited 0."""
    register_planted("conv", "one_percent_off", backward=False)
    [planted] = [r for r in backends.verify("conv", device="cpu") if r.backend == PLANTED]
    assert not planted.ok and not planted.requires_grad
    assert cli_main(["backends", "--verify", "--device", "cpu"]) == 1
    assert "forward only" in capsys.readouterr().out


def test_a_cache_file_of_another_shape_is_read_as_empty(tmp_path: Any) -> None:
    for text in ('{"results": []}', '{"results": null}', '{"results": "x"}', "[1, 2]", "{"):
        new_process_file = kept._file()
        new_process_file.parent.mkdir(parents=True, exist_ok=True)
        new_process_file.write_text(text)
        kept._loaded_from = None
        kept._memory.clear()
        register_planted("conv", "none", replace=True)
        result, args = call_op("conv", requires_grad=True)
        torch.testing.assert_close(result, reference_result("conv", args))


def test_the_fingerprint_follows_the_code_a_kernel_names(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kept verdict names the kernel's code: a wrapper whose helper module or global constant changed (its own
    source unchanged) was served on the old code's passed check, kept on disk."""
    import importlib
    import sys

    from hybrid_pack.ops.selfcheck.kept import code_fingerprint

    (tmp_path / "planted_helper.py").write_text("def conv(x):\n    return x\n")
    (tmp_path / "planted_wrapper.py").write_text(
        "import planted_helper\nSCALE = 1.0\n\ndef kernel(x):\n    return planted_helper.conv(x) * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def fingerprint() -> str:
        for name in ("planted_helper", "planted_wrapper"):
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        return code_fingerprint(importlib.import_module("planted_wrapper").kernel)

    first = fingerprint()
    assert fingerprint() == first  # the same code, the same name for it
    (tmp_path / "planted_helper.py").write_text("def conv(x):\n    return x * 1.001\n")
    second = fingerprint()
    (tmp_path / "planted_wrapper.py").write_text(
        "import planted_helper\nSCALE = 1.001\n\ndef kernel(x):\n    return planted_helper.conv(x) * SCALE\n")
    assert len({first, second, fingerprint()}) == 3


def test_an_adapter_that_drops_an_argument_is_refused() -> None:
    """The attention check always used the default scale and never passed ``window``: a kernel that ignored the
    caller's ``softmax_scale`` (or GDN's ``scale``) passed and served wrong numbers, and one written to §4 without
    ``window`` passed, then crashed the first real call."""
    reference = reference_of("attention").fn

    def default_scale(q: Any, k: Any, v: Any, boundaries: Any, *, causal: bool, softmax_scale: float,
                      window: Any = None) -> Any:
        return reference(q, k, v, boundaries, causal=causal, softmax_scale=q.shape[-1] ** -0.5, window=window)

    def without_window(q: Any, k: Any, v: Any, boundaries: Any, *, causal: bool, softmax_scale: float) -> Any:
        return reference(q, k, v, boundaries, causal=causal, softmax_scale=softmax_scale)

    gated_delta = reference_of("gated_delta").fn

    def gdn_default_scale(*args: Any, scale: float, **kwargs: Any) -> Any:
        return gated_delta(*args, scale=args[0].shape[-1] ** -0.5, **kwargs)

    for op, kernel, why in (("attention", default_scale, "differs"),
                            ("attention", without_window, "unexpected keyword argument 'window'"),
                            ("gated_delta", gdn_default_scale, "differs")):
        backends.register(op, PLANTED, kernel, priority=100, devices=("cpu",), dtypes=(torch.float32,), replace=True)
        call_op(op, requires_grad=True)
        assert not status_of(op).usable and why in status_of(op).reason, status_of(op).reason
        registry.unregister(op, PLANTED)


def test_report_says_when_results_cannot_be_kept_on_disk(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A HYBRID_PACK_CACHE that is a file kept nothing on disk while the table said "results kept in" it."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(kept.CACHE_ENV, str(tmp_path / "a_file"))
    assert f"results kept in memory only: {tmp_path / 'a_file'} is a file" in backends.report(device="cpu")


def test_report_lists_the_keys_a_kernel_failed_beside_the_typical_one() -> None:
    """A kernel refused for one signature only: once report() checked the typical key, no line said why."""
    reference = reference_of("conv").fn

    def picky(x: Any, weight: Any, bias: Any, boundaries: Any, *, activation: Any) -> Any:
        if x.shape[-1] == 32:
            raise RuntimeError("planted: no 32 channels")
        return reference(x, weight, bias, boundaries, activation=activation)

    backends.register("conv", PLANTED, picky, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    causal_conv1d(torch.randn(1, 16, 32), torch.randn(32, 4), None, PackedBoundaries.from_lengths([5, 11]))
    table = backends.report(device="cpu")
    assert f"{PLANTED} refused for D=32" in table and "planted: no 32 channels" in table
    assert "CHOSEN" in next(line for line in table.splitlines() if line.startswith("conv") and PLANTED in line)


@pytest.mark.parametrize(("op", "flag"), [("gated_delta", "output_final_state"), ("kda", "output_final_state"),
                                          ("decay_linear_attention", "output_final_state"),
                                          ("ssd", "return_final_states")])
def test_a_kernel_returning_half_precision_states_is_refused(op: str, flag: str) -> None:
    """Final states are float32 for half inputs (docs/ops.md): a kernel rounding them to the inputs' bfloat16
    passed the check (their values are within bfloat16's tolerance) and served rounded states."""
    reference = reference_of(op).fn

    def rounded_states(*args: Any, **kwargs: Any) -> Any:
        out, states = reference(*args, **kwargs)
        return out, states.to(args[0].dtype)

    backends.register(op, PLANTED, rounded_states, priority=100, devices=("cpu",), dtypes=(torch.bfloat16,))
    boundaries = ROW.boundaries()
    signature = contract_of(op).default_signature(torch.bfloat16, "cpu")
    case = kit.op_inputs(op, signature, boundaries, requires_grad=False)
    _, states = case.call(kit.PUBLIC_OPS[op], boundaries, {**case.arguments, flag: True})
    assert states.dtype == torch.float32
    assert not status_of(op).usable and "expected torch.float32" in status_of(op).reason, status_of(op).reason
