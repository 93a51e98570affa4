"""The attention op's self-check contract: a call's signature, inputs of a signature, and the case of the
context-parallel shape (one document's queries over more keys than queries, :mod:`.partial`).

A backend with a partial form (:func:`~hybrid_pack.ops.attention.partial.partial_attention_of`) passes the
generic check (:mod:`hybrid_pack.ops.selfcheck.whole_row`) and :func:`check_partial`: causal with the diagonal
bottom right over ``Tk > Tq`` keys (the signature's window included), and earlier keys in two parts merged by
log-sum-exp, forward and backward against the blockwise form in float64. Until it passes, it serves neither.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.isolation import GRADIENT_FACTOR, compare, self_check_tolerance
from hybrid_pack.ops.attention.partial import BLOCKWISE, PartialAttention, partial_attention_of
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor

__all__ = ["OP", "CONTRACT", "signature_of", "make_inputs", "check_partial"]

OP = "attention"
TILE = 128  # flash kernels tile the sequence in 128-token blocks: the check's documents end on their edges


def signature_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None = None
                 ) -> Signature:
    """The call's key; a sliding window is part of it (a kernel is checked with the window it serves)."""
    windowed = {} if window is None else {"window": window}
    return make_signature(H=q.shape[2], Hkv=k.shape[2], D=q.shape[3], causal=causal, q=q.dtype, k=k.dtype,
                          v=v.dtype, **windowed)


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """``q [1, T, H, D]``, ``k, v [1, T, Hkv, D]`` drawn from N(0, 1) in the signature's dtypes, ``window`` (None
    unless the signature has one: the op always passes it) and ``softmax_scale = 0.75 / sqrt(D)`` (not the default:
    a kernel that drops the caller's scale differs)."""
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device
    q = random_tensor((1, t, s["H"], s["D"]), s["q"], device, generator)
    k = random_tensor((1, t, s["Hkv"], s["D"]), s["k"], device, generator)
    v = random_tensor((1, t, s["Hkv"], s["D"]), s["v"], device, generator)
    return CheckCase({"q": q, "k": k, "v": v, "causal": s["causal"], "softmax_scale": 0.75 * s["D"] ** -0.5,
                      "window": s.get("window")},
                     positional=("q", "k", "v"), token_inputs=("q", "k", "v"))


def _outputs(result: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [result], []


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """Grouped-query attention as hybrid models use it: 8 query heads on 2 key/value heads of 128 (CPU: small)."""
    heads, kv_heads, dim = (8, 2, 128) if device_type == "cuda" else (2, 1, 16)
    return make_signature(H=heads, Hkv=kv_heads, D=dim, causal=True, q=dtype, k=dtype, v=dtype)


def _merged(partial: PartialAttention, q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]],
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial``'s attention of ``q`` over earlier keys given in parts, merged by log-sum-exp."""
    results = [partial.forward(q, k, v, scale=scale, causal=False, window=None) for k, v in parts]
    lse = torch.logsumexp(torch.stack([part_lse.double() for _, part_lse in results]), dim=0)
    out = sum(torch.exp(part_lse.double() - lse)[..., None] * part_out.double() for part_out, part_lse in results)
    return out.to(q.dtype), lse


def check_partial(partial: PartialAttention, case: CheckCase, generator: torch.Generator, requires_grad: bool
                  ) -> float:
    """``partial`` against the blockwise form (float64, same rounded inputs) on the context-parallel shapes: the
    largest error seen, or :class:`~hybrid_pack.isolation.Mismatch`.

    Queries ``Tq = TILE + 3`` over ``Tk = 3 * TILE + 5`` keys causal bottom right (with the case's window), and
    over two parts of earlier keys (``TILE + 1`` and ``2 * TILE - 7``) merged; with gradients, each call's
    backward against the merged output and log-sum-exp."""
    q0, k0 = case.arguments["q"], case.arguments["k"]
    heads, kv_heads, dim = q0.shape[2], k0.shape[2], q0.shape[3]
    dtype, device, scale = q0.dtype, q0.device, case.arguments["softmax_scale"]
    window = case.arguments.get("window")
    tolerance = self_check_tolerance([dtype])

    def draw(tokens: int, h: int) -> torch.Tensor:
        return random_tensor((tokens, h, dim), dtype, device, generator)

    def both(fn: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return fn(partial, lambda t: t), fn(BLOCKWISE, lambda t: t.double())

    queries, grad_out = draw(TILE + 3, heads), draw(TILE + 3, heads)
    keys, values = draw(3 * TILE + 5, kv_heads), draw(3 * TILE + 5, kv_heads)

    def bottom_right(form: PartialAttention, cast: Any) -> list[torch.Tensor]:
        q, k, v = cast(queries), cast(keys), cast(values)
        out, lse = form.forward(q, k, v, scale=scale, causal=True, window=window)
        grads = form.backward(cast(grad_out), q, k, v, out, lse, scale=scale, causal=True, window=window) \
            if requires_grad else ()
        return [out, lse, *grads]

    got, want = both(bottom_right)
    worst = compare(f"causal bottom right, {TILE + 3} queries over {3 * TILE + 5} keys", got[:2], want[:2], tolerance,
                    names=["output", "log-sum-exp"])
    if requires_grad:
        worst = max(worst, compare("causal bottom right", got[2:], want[2:], GRADIENT_FACTOR * tolerance,
                                   names=["dq", "dk", "dv"]))
    split = [(keys[:TILE + 1], values[:TILE + 1]), (keys[TILE + 1:3 * TILE - 6], values[TILE + 1:3 * TILE - 6])]

    def earlier(form: PartialAttention, cast: Any) -> list[torch.Tensor]:
        q = cast(queries)
        parts = [(cast(k), cast(v)) for k, v in split]
        out, lse = _merged(form, q, parts, scale)
        grads = [g for k, v in parts for g in form.backward(cast(grad_out), q, k, v, out, lse, scale=scale,
                                                             causal=False, window=None)] if requires_grad else []
        return [out, lse, *grads]

    got, want = both(earlier)
    worst = max(worst, compare("earlier keys in two parts, merged", got[:2], want[:2], tolerance,
                               names=["output", "log-sum-exp"]))
    if requires_grad:
        worst = max(worst, compare("earlier keys in two parts, merged", got[2:], want[2:],
                                   GRADIENT_FACTOR * tolerance,
                                   names=[f"{g} of part {i}" for i in range(2) for g in ("dq", "dk", "dv")]))
    return worst


def _check(case: CheckCase, boundaries: PackedBoundaries, generator: torch.Generator, backend: Any,
           reference: Any, contract: OpContract, requires_grad: bool) -> float:
    """The generic check, then :func:`check_partial` for a backend with a partial form of its own."""
    from hybrid_pack.ops.selfcheck.whole_row import _check as whole_row_check

    worst = whole_row_check(case, boundaries, generator, backend, reference, contract, requires_grad)
    partial = partial_attention_of(backend.name)
    if partial is BLOCKWISE:
        return worst
    return max(worst, check_partial(partial, case, generator, requires_grad))


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: TILE, check=_check)
