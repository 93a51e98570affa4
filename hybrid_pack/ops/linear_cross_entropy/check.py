"""The linear cross-entropy's self-check contract: a call's signature, inputs of a signature, and its own check.

The op's output is one scalar, not a per-token tensor, so the generic check (outputs per token, each document
alone) does not apply; :func:`check_loss` proves a backend on the same adversarial row instead.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.isolation import GRADIENT_FACTOR, Mismatch, compare, self_check_tolerance
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, make_signature, random_tensor
from hybrid_pack.schema import IGNORE_INDEX

__all__ = ["OP", "CONTRACT", "DEFAULT_CHUNK_SIZE", "signature_of", "make_inputs", "check_loss"]

OP = "linear_cross_entropy"
DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk: ``[1024, V]`` float32 logits are 621 MB at Qwen's V = 151,680 (Liger-Kernel's choice for
``V / H`` of about 37)."""


def signature_of(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> Signature:
    return make_signature(H=hidden.shape[-1], V=weight.shape[0], chunk_size=chunk_size, hidden=hidden.dtype,
                          weight=weight.dtype)


def make_inputs(signature: Signature, boundaries: PackedBoundaries, generator: torch.Generator) -> CheckCase:
    """``hidden [T, H]`` of N(0, 1), ``weight [V, H]`` of N(0, 4 / H) (logits of about N(0, 4)) and the targets a
    packed row's shifted labels give: ``-100`` at each document's last token and over the padding, every seventh
    token the last class, every eleventh the first, every thirteenth ignored (a masked prompt)."""
    s = dict(signature)
    t, device = boundaries.total_tokens, boundaries.device
    hidden = random_tensor((t, s["H"]), s["hidden"], device, generator)
    weight = random_tensor((s["V"], s["H"]), s["weight"], device, generator, scale=2 * s["H"] ** -0.5)
    targets = torch.randint(0, s["V"], (t,), generator=generator)
    targets[::7], targets[3::11], targets[5::13] = s["V"] - 1, 0, IGNORE_INDEX
    targets[torch.tensor([*boundaries.starts[1:], t]) - 1] = IGNORE_INDEX
    targets[sum(boundaries.document_lengths):] = IGNORE_INDEX
    arguments = {"hidden": hidden, "weight": weight, "targets": targets.to(device), "chunk_size": s["chunk_size"]}
    return CheckCase(arguments, positional=("hidden", "weight", "targets"), token_inputs=("hidden", "targets"))


def _call(backend: Backend, case: CheckCase, span: slice = slice(None), *, float64: bool = False,
          requires_grad: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The backend's summed loss on ``span`` of the row, and the (fresh leaf) ``hidden`` and ``weight`` it took."""
    a = case.arguments
    leaves = [x.detach()[span] if name == "hidden" else x.detach() for name, x in (("hidden", a["hidden"]),
                                                                                   ("weight", a["weight"]))]
    leaves = [(x.double() if float64 else x.clone()).requires_grad_(requires_grad) for x in leaves]
    with torch.set_grad_enabled(requires_grad):
        loss = backend.fn(*leaves, a["targets"][span], chunk_size=a["chunk_size"])
    return loss, leaves


def check_loss(case: CheckCase, boundaries: PackedBoundaries, generator: torch.Generator, backend: Backend,
               reference: Backend, contract: OpContract, requires_grad: bool) -> float:
    """Prove ``backend`` on the row; return the largest error seen or raise :class:`~hybrid_pack.isolation.Mismatch`.

    1. Its summed loss agrees with the pure-torch backend's in float64 on the same (rounded) inputs.
    2. Each segment alone (fewer tokens than a chunk, one token, only ignored targets) gives the pure-torch
       backend's loss of that segment.
    3. With gradients, under an incoming gradient other than 1: every token whose target is ignored gets exactly
       zero gradient, and the gradients of ``hidden`` and ``weight`` agree with the pure-torch backend's (within
       ``GRADIENT_FACTOR`` times the tolerance).
    """
    tolerance = self_check_tolerance([case.arguments["hidden"].dtype])
    loss, leaves = _call(backend, case, requires_grad=requires_grad)
    ref_loss, ref_leaves = _call(reference, case, float64=True, requires_grad=requires_grad)
    worst = compare("against the pure-torch backend", [loss], [ref_loss], tolerance, names=["summed loss"])

    spans = [slice(start, start + length) for start, length in zip(boundaries.starts, boundaries.segment_lengths)]
    alone = torch.stack([_call(backend, case, span)[0].double() for span in spans])
    ref_alone = torch.stack([_call(reference, case, span, float64=True)[0] for span in spans])
    worst = max(worst, compare("each segment alone against the pure-torch backend", [alone], [ref_alone], tolerance,
                               names=["summed loss per segment"]))
    if not requires_grad:
        return worst

    scale = 0.5 + torch.rand((), generator=generator, dtype=torch.float64).item()
    grads = torch.autograd.grad(loss * scale, leaves)
    ref_grads = torch.autograd.grad(ref_loss * scale, ref_leaves)
    ignored = case.arguments["targets"] == IGNORE_INDEX
    leaked = grads[0][ignored].abs().max().item() if bool(ignored.any()) else 0.0
    if leaked != 0.0:
        what = "gradient of hidden at tokens whose target is ignored"
        raise Mismatch(f"{what} is {leaked:.3g}, not exactly zero", what=what, error=leaked, tolerance=0.0)
    return max(worst, compare("against the pure-torch backend", grads, ref_grads, GRADIENT_FACTOR * tolerance,
                              names=["gradient of hidden", "gradient of weight"]))


def _outputs(loss: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [loss.reshape(1, 1)], []


def _default_signature(dtype: torch.dtype, device_type: str) -> Signature:
    """Qwen's head (hidden 2048, V = 151,680) in the default chunks; on CPU (the interpreter's test path) hidden 16,
    V = 300 (not a power of two) in 64-token chunks."""
    hidden, vocab, chunk = (2048, 151_680, DEFAULT_CHUNK_SIZE) if device_type == "cuda" else (16, 300, 64)
    return make_signature(H=hidden, V=vocab, chunk_size=chunk, hidden=dtype, weight=dtype)


CONTRACT = OpContract(name=OP, make_case=make_inputs, outputs=_outputs, default_signature=_default_signature,
                      edge=lambda signature: dict(signature)["chunk_size"], check=check_loss)
