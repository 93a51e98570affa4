"""Linear cross-entropy (hybrid_pack.ops.linear_cross_entropy): the loss of an LM head without its [T, V] logits.

The chunked op equals ``F.cross_entropy`` on the full (upcast) logits, loss and gradients, in float64 and float32,
for chunk sizes that do not divide T and rows shorter than a chunk; it holds one chunk's logits at a time and saves
only its inputs for backward. Its self-check refuses wrong kernels. The native presets compute their loss through
it, equal to today's ``packed_loss`` on the full logits, and build logits only when they are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_pack import PackedBoundaries, PackingCollator, backends, packed_loss, use_backends
from hybrid_pack.boundaries.targets import shift_labels
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import from_preset
from hybrid_pack.ops import linear_cross_entropy
from hybrid_pack.ops.dispatch import selector
from hybrid_pack.ops.linear_cross_entropy.torch_backend import linear_cross_entropy_sum
from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.schema import IGNORE_INDEX, LABELS, SHIFT_LABELS
from tests.kit import assert_close

OP = "linear_cross_entropy"
TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
PLANTED = "planted"


def inputs(tokens: int, hidden: int = 16, vocab: int = 300, *, dtype: torch.dtype = torch.float32, seed: int = 0,
           shape: tuple[int, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [*shape, H]``, ``weight [V, H]`` (leaves) and targets with every fifth one ignored."""
    g = torch.Generator().manual_seed(seed)
    shape = shape or (tokens,)
    h = torch.randn(*shape, hidden, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 2 * hidden ** -0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, shape, generator=g)
    targets.view(-1)[::5] = IGNORE_INDEX
    return h, w, targets


def full_logits_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor,
                     num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """What the op replaces: all ``[T, V]`` logits, upcast, then cross-entropy summed over the targets."""
    logits = F.linear(h, w).to(torch.promote_types(h.dtype, torch.float32))
    total = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    count = (targets != IGNORE_INDEX).sum().clamp(min=1) if num_items is None else num_items
    return total / count


def loss_and_grads(fn: Any, h: torch.Tensor, w: torch.Tensor, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
    loss = fn(h, w, *args, **kwargs)
    return [loss.detach(), *torch.autograd.grad(loss, (h, w))]


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float,
                     names: tuple[str, ...] = ("loss", "gradient of hidden", "gradient of weight")) -> None:
    for name, a, b in zip(names, got, want, strict=True):
        assert_close(a, b, name, tol=tol)


# ---------------------------------------------------------------- the op against the full logits
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize(("tokens", "chunk_size"), [(50, 7), (50, 16), (50, 1), (13, 1024), (64, 64)])
def test_equals_cross_entropy_on_full_logits(dtype: torch.dtype, tokens: int, chunk_size: int) -> None:
    h, w, targets = inputs(tokens, dtype=dtype)
    got = loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=chunk_size)
    assert got[0].dtype == dtype and got[0].dim() == 0
    assert_all_close(got, loss_and_grads(full_logits_loss, h, w, targets), TOL[dtype])


def test_half_precision_upcasts_each_chunk() -> None:
    """bfloat16 logits are computed as nn.Linear computes them, then upcast: the float32 loss is the full logits'
    loss to float32 rounding; gradients come back in bfloat16."""
    h, w, targets = inputs(40, dtype=torch.bfloat16)
    got = loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=9)
    want = loss_and_grads(full_logits_loss, h, w, targets)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert_close(got[0], want[0], "loss", tol=1e-6)
    assert_all_close(got[1:], want[1:], 1e-2, names=("gradient of hidden", "gradient of weight"))


def test_a_float32_head_under_autocast_casts_as_nn_linear_does() -> None:
    """A head kept in float32 meeting bfloat16 hidden states inside torch.autocast: refused ("as nn.Linear needs")
    where F.linear takes the pair; now both are cast to the autocast dtype, as F.linear casts them."""
    h, w, targets = inputs(40, dtype=torch.bfloat16)
    w32 = w.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(linear_cross_entropy, h, w32, targets, chunk_size=9)
        want = loss_and_grads(full_logits_loss, h, w32, targets)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    assert_close(got[0], want[0], "loss", tol=1e-6)
    assert_all_close(got[1:], want[1:], 1e-2, names=("gradient of hidden", "gradient of weight"))
    with pytest.raises(InputError, match="or call it inside torch.autocast"):
        linear_cross_entropy(h, w32, targets)


@pytest.mark.parametrize("num_items", [None, 7, torch.tensor(31)], ids=["count", "int", "tensor"])
def test_num_items_divides_the_sum(num_items: int | torch.Tensor | None) -> None:
    h, w, targets = inputs(30, dtype=torch.float64)
    got = loss_and_grads(linear_cross_entropy, h, w, targets, num_items=num_items, chunk_size=8)
    assert_all_close(got, loss_and_grads(full_logits_loss, h, w, targets, num_items), 1e-12)


def test_no_target_is_zero_with_zero_gradient() -> None:
    h, w, targets = inputs(9)
    loss, grad_h, grad_w = loss_and_grads(linear_cross_entropy, h, w, torch.full_like(targets, IGNORE_INDEX),
                                          chunk_size=4)
    assert loss.item() == 0.0 and not grad_h.any() and not grad_w.any()


def test_ignored_targets_get_no_gradient() -> None:
    h, w, targets = inputs(30)
    _, grad_h, _ = loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=8)
    ignored = targets == IGNORE_INDEX
    assert ignored.any() and not grad_h[ignored].any() and grad_h[~ignored].abs().amin(-1).gt(0).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16], ids=str)
@pytest.mark.parametrize("shape", [(30,), (2, 15)], ids=["rows", "leading dims"])
def test_any_integer_targets_give_the_int64_loss(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Targets of another integer dtype (``-100`` ignored) are token ids like int64 ones: same loss, same gradients."""
    h, w, targets = inputs(0, vocab=200, shape=shape, dtype=torch.float64)
    got = loss_and_grads(linear_cross_entropy, h, w, targets.to(dtype), chunk_size=8)
    assert_all_close(got, loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=8), 0.0)


def test_leading_dims_are_tokens() -> None:
    h, w, targets = inputs(0, shape=(2, 11), dtype=torch.float64)
    got = loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=5)
    assert got[1].shape == (2, 11, 16)
    assert_all_close(got, loss_and_grads(full_logits_loss, h, w, targets), 1e-12)


def test_context_parallel_shares_sum_to_the_row() -> None:
    """Each rank's share of a row (its tokens, its shifted labels, the row's target count) sums to the row's loss,
    and the gradients of the shares are the row's: what the model computes on a context-parallel shard."""
    h, w, targets = inputs(41, dtype=torch.float64)
    count = (targets != IGNORE_INDEX).sum()
    shares = [linear_cross_entropy(h[part], w, targets[part], num_items=count, chunk_size=8)
              for part in (slice(0, 20), slice(20, 41))]
    total = shares[0] + shares[1]
    got = [total.detach(), *torch.autograd.grad(total, (h, w))]
    assert_all_close(got, loss_and_grads(full_logits_loss, h, w, targets), 1e-12)


def test_compiled_equals_eager() -> None:
    h, w, targets = inputs(37)
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=8), backend="aot_eager",
                             fullgraph=True)
    assert_all_close(loss_and_grads(compiled, h, w, targets),
                     loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=8), 1e-6)


@pytest.mark.parametrize(("change", "field"), [
    (lambda h, w, t: (h[0], w, t[0]), "hidden"),
    (lambda h, w, t: (h, w[:, :3], t), "weight"),
    (lambda h, w, t: (h, w.double(), t), "weight"),
    (lambda h, w, t: (h, w, t[:-1]), "targets"),
    (lambda h, w, t: (h, w, t.float()), "targets"),
])
def test_bad_input_names_the_field(change: Any, field: str) -> None:
    with pytest.raises(InputError, match=f"^{field}: expected"):
        linear_cross_entropy(*change(*inputs(10)))


@pytest.mark.parametrize(("keywords", "field"), [({"chunk_size": 0}, "chunk_size"), ({"num_items": 0}, "num_items")])
def test_bad_options_name_the_field(keywords: dict[str, int], field: str) -> None:
    with pytest.raises(InputError, match=f"^{field}: expected"):
        linear_cross_entropy(*inputs(10), **keywords)


# ---------------------------------------------------------------- memory, structurally
class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op produces (forward and backward, on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def largest_tensor_and_saved_bytes(fn: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor
                                   ) -> tuple[int, int]:
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with LargestTensor() as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = fn(h, w, targets)
        loss.backward()
    return mode.numel, sum(saved)


def test_holds_one_chunk_of_logits_and_saves_only_its_inputs() -> None:
    """T = 4096, V = 32768: the full logits are 512 MiB in float32. The op's largest tensor is one chunk's logits
    [256, V] and autograd keeps its inputs (hidden, weight, targets: 1.2 MiB here) and the target count; the same
    measures see the
    full logits when the loss is computed from them."""
    tokens, vocab, chunk = 4096, 32768, 256
    h, w, targets = inputs(tokens, hidden=8, vocab=vocab)
    largest, saved = largest_tensor_and_saved_bytes(
        lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=chunk, backend="torch"), h, w, targets)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (h, w, targets))
    assert largest <= chunk * vocab, f"largest tensor {largest} elements > one chunk's logits {chunk * vocab}"
    assert saved <= inputs_bytes + 64 < tokens * vocab * 4 / 400, f"{saved} bytes saved for backward"  # + count

    small = tokens // 8  # the control: full logits of a shorter row
    largest_full, saved_full = largest_tensor_and_saved_bytes(full_logits_loss, h[:small].detach().requires_grad_(),
                                                              w, targets[:small])
    assert largest_full >= small * vocab and saved_full >= small * vocab * 4


# ---------------------------------------------------------------- the self-check
@pytest.fixture
def fresh_verdicts(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(kept.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(selector.ENV_VAR, raising=False)
    monkeypatch.delenv(selector.VERIFY_ENV, raising=False)
    monkeypatch.setattr(kept, "_memory", {})
    monkeypatch.setattr(kept, "_loaded_from", None)
    monkeypatch.setattr(selector, "_logged", set())
    yield
    kept._environment_digest.cache_clear()
    if any(b.name == PLANTED for b in backends.backends_of(OP)):
        backends.unregister(OP, PLANTED)


def _one_percent_off(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    return linear_cross_entropy_sum(h, w, t, chunk_size=chunk_size) * 1.01


def _tenth_percent_off(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    return linear_cross_entropy_sum(h, w, t, chunk_size=chunk_size) * 1.001


def _gradient_at_ignored_tokens(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, *, chunk_size: int
                                ) -> torch.Tensor:
    at_ignored = 1e-3 * (h * (t == IGNORE_INDEX)[:, None]).sum()
    # adds 0 to the loss, and a gradient at the ignored tokens
    return linear_cross_entropy_sum(h, w, t, chunk_size=chunk_size) + (at_ignored - at_ignored.detach())


def _drops_the_last_chunk(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    kept = max(chunk_size, (h.shape[0] - 1) // chunk_size * chunk_size)
    return linear_cross_entropy_sum(h[:kept], w, t[:kept], chunk_size=chunk_size)


@pytest.mark.usefixtures("fresh_verdicts")
@pytest.mark.parametrize(("kernel", "reason"), [(_one_percent_off, "differs"), (_tenth_percent_off, "differs"),
                                                (_gradient_at_ignored_tokens, "not exactly zero"),
                                                (_drops_the_last_chunk, "differs")])
def test_a_wrong_kernel_is_refused_and_the_call_falls_back(kernel: Any, reason: str) -> None:
    backends.register(OP, PLANTED, kernel, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    h, w, targets = inputs(70)
    got = loss_and_grads(linear_cross_entropy, h, w, targets, chunk_size=16)
    assert_all_close(got, loss_and_grads(full_logits_loss, h, w, targets), 1e-6)
    [row] = [r for r in backends.available(OP) if r.backend == PLANTED]
    assert not row.usable and reason in row.reason, row.reason


@pytest.mark.usefixtures("fresh_verdicts")
def test_a_correct_kernel_passes_and_serves() -> None:
    calls: list[int] = []

    def kernel(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
        calls.append(1)
        return linear_cross_entropy_sum(h, w, t, chunk_size=chunk_size)

    backends.register(OP, PLANTED, kernel, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    [result] = [r for r in backends.verify(OP, device="cpu", dtype=torch.float32) if r.backend == PLANTED]
    assert result.ok and result.max_error < 1e-6, result.reason
    assert backends.select(OP, device="cpu", dtype=torch.float32, requires_grad=True) == PLANTED
    before = len(calls)
    with use_backends(**{OP: PLANTED}):
        linear_cross_entropy(*inputs(20), chunk_size=64)
    assert len(calls) == before + 1


# ---------------------------------------------------------------- the native presets' loss
def _batch(vocab: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in (5, 17, 1, 9)]
    return PackingCollator(pad_to_multiple_of=16)(features)


def _model(name: str, dtype: torch.dtype, vocab: int = 300) -> torch.nn.Module:
    torch.manual_seed(0)
    return from_preset(name, vocab_size=vocab).to(dtype)


def _loss_and_grads(model: torch.nn.Module, batch: dict[str, Any], loss_of: Any) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, batch)
    loss.backward()
    return {"loss": loss.detach(), **{name: p.grad.clone() for name, p in model.named_parameters()}}


def _through_full_logits(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Today's path: the logits of a call without labels, then packed_loss."""
    logits = model(**{k: v for k, v in batch.items() if k != LABELS}).logits
    return packed_loss(logits, batch[LABELS], boundaries=PackedBoundaries.from_batch(batch))


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "bamba-tiny"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_preset_loss_and_gradients_equal_packed_loss_on_full_logits(name: str, dtype: torch.dtype) -> None:
    """fp64 to 1e-12 everywhere. fp32: the loss and the head's gradient to 1e-6; the other parameters to 1e-4,
    since the SSM decays' gradients (A_log, dt_bias) sum many terms that cancel and amplify float32 rounding."""
    model, batch = _model(name, dtype), _batch(300)
    got = _loss_and_grads(model, batch, lambda m, b: m(**b).loss)
    want = _loss_and_grads(model, batch, _through_full_logits)
    tight = ("loss", "lm_head.weight", "model.norm.weight")
    for key in got:
        assert_close(got[key], want[key], key, tol=TOL[dtype] if dtype == torch.float64 or key in tight else 1e-4)


def test_preset_builds_logits_only_when_read() -> None:
    model, batch = _model("qwen3-next-tiny", torch.float32), _batch(300)
    heads: list[int] = []
    model.lm_head.register_forward_hook(lambda *_: heads.append(1))
    out = model(**batch)
    assert out.computed_logits is None and not heads and out[0] is out.loss
    unlabelled = model(**{k: v for k, v in batch.items() if k != LABELS})
    assert len(heads) == 1
    assert torch.equal(out.logits, unlabelled.logits) and len(heads) == 2
    assert out[1] is out.logits and len(heads) == 2  # built once, kept
    out.logits[0, :3].sum().backward()
    assert model.lm_head.weight.grad is not None


def test_preset_shift_labels_give_the_labels_loss() -> None:
    model, batch = _model("bamba-tiny", torch.float64), _batch(300)
    targets = shift_labels(batch[LABELS], PackedBoundaries.from_batch(batch))
    shifted = {**{k: v for k, v in batch.items() if k != LABELS}, SHIFT_LABELS: targets, "num_items_in_batch": 13}
    with torch.no_grad():
        assert_close(model(**shifted).loss, model(**batch).loss * (targets != IGNORE_INDEX).sum() / 13, "loss",
                     tol=1e-12)


def test_preset_with_a_wrapped_head_takes_the_logits_path() -> None:
    """A head that is not a plain bias-free nn.Linear (an adapter, a bias) computes the logits in the forward."""
    model, batch = _model("qwen3-next-tiny", torch.float64), _batch(300)
    with torch.no_grad():
        fused = model(**batch).loss
        model.lm_head = torch.nn.Sequential(model.lm_head)
        out = model(**batch)
    assert out.computed_logits is not None
    assert_close(out.loss, fused, "loss", tol=1e-12)
