"""The loss of an LM head from its input: token cross-entropy of ``hidden @ weight.T`` without the ``[T, V]`` logits.

Each token's loss depends on its own hidden state and target only, so the op takes no boundaries: a packed row's
targets are its labels shifted within each document (:func:`~hybrid_pack.boundaries.targets.shift_labels`), and a
context-parallel shard's are the ``shift_labels`` :func:`~hybrid_pack.parallel.shard_batch` gives it.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.errors import InputError
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.linear_cross_entropy.check import DEFAULT_CHUNK_SIZE, OP, signature_of
from hybrid_pack.ops.selfcheck.contract import dtype_name
from hybrid_pack.ops.validate import needs_grad
from hybrid_pack.schema import IGNORE_INDEX

__all__ = ["linear_cross_entropy", "DEFAULT_CHUNK_SIZE"]


_TARGET_DTYPES = frozenset({torch.int64, torch.int32})
"""The common targets' dtypes, checked at once (any other integer dtype goes through :func:`_validate`)."""


def _validate(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> None:
    """Raise :class:`InputError` naming the first input at fault."""
    if hidden.dim() < 2 or not hidden.is_floating_point():
        raise InputError(f"hidden: expected a float tensor [..., H] (a packed row's [1, T, H]); got "
                         f"{hidden.dtype} of shape {list(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise InputError(f"weight: expected the LM head's weight [V, {hidden.shape[-1]}] (hidden's H); got shape "
                         f"{list(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise InputError(f"weight: expected hidden's dtype {dtype_name(hidden.dtype)} (cast the head or the hidden "
                         f"states, or call it inside torch.autocast, which casts both as for nn.Linear); got "
                         f"{dtype_name(weight.dtype)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise InputError(f"targets: expected shape {list(hidden.shape[:-1])} (hidden's leading dims); got "
                         f"{list(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise InputError(f"targets: expected an integer tensor (token ids, -100 ignored); got {targets.dtype}")
    if weight.device != hidden.device or targets.device != hidden.device:
        raise InputError(f"weight, targets: expected hidden's device {hidden.device}; got {weight.device} and "
                         f"{targets.device}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InputError(f"chunk_size: expected a positive int (tokens whose logits are held at once); "
                         f"got {chunk_size!r}")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         num_items: int | torch.Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                         backend: str | None = None) -> torch.Tensor:
    """``sum_t CE(hidden[t] @ weight.T, targets[t]) / num_items``, holding at most ``[chunk_size, V]`` logits.

    Equal to ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction="sum") / num_items`` with the
    logits upcast to float32 first, which is :func:`hybrid_pack.packed_loss` on shifted labels.

    Args:
        hidden: ``[..., H]`` (a packed row's final hidden states ``[1, T, H]``), any float dtype.
        weight: ``[V, H]``, the LM head's weight, in ``hidden``'s dtype (inside ``torch.autocast``, both are cast
            to its dtype when they differ, as ``F.linear`` casts them).
        targets: any integer dtype (taken as int64) ``[...]`` (``hidden``'s leading dims), already shifted:
            ``targets[t]`` is the token predicted at ``t``; ``-100`` ignored.
        num_items: divide the summed loss by this: the target tokens of every micro-batch of the optimizer step
            (gradient accumulation), or of the whole row on a context-parallel shard, so that the shards' losses
            sum to the row's. Default: the targets here that are not ``-100``. An int below 1 raises; a tensor
            is not read on the host (SPEC §9b), so one below 1 divides by 1 (the count of a step without targets
            is 0, its loss then 0, not NaN).
        chunk_size: tokens whose logits are held at once.
        backend: force a backend (``"torch"``, ``"fla"``; see :mod:`hybrid_pack.backends`). Inside
            ``torch.compile`` the pure-torch backend is traced (the compiler fuses its chunks).

    Returns:
        A float32 scalar (float64 for float64 inputs); 0 (with a zero gradient) when no target is left.
    """
    h_shape, w_shape, device = hidden.shape, weight.shape, hidden.device
    valid = (len(h_shape) >= 2 and len(w_shape) == 2 and hidden.is_floating_point() and type(chunk_size) is int
             and chunk_size >= 1 and targets.dtype in _TARGET_DTYPES
             and (w_shape[1], weight.dtype, targets.shape, weight.device, targets.device)
             == (h_shape[-1], hidden.dtype, h_shape[:-1], device, device))
    if not valid:  # one comparison above; the checks naming the field run only when it fails
        if weight.dtype != hidden.dtype and torch.is_autocast_enabled(device.type) and \
                hidden.is_floating_point() and weight.is_floating_point():  # both cast, as F.linear is
            dtype = torch.get_autocast_dtype(device.type)
            return linear_cross_entropy(hidden.to(dtype), weight.to(dtype), targets, num_items=num_items,
                                        chunk_size=chunk_size, backend=backend)
        _validate(hidden, weight, targets, chunk_size)
    if len(h_shape) == 2:  # already the backends' rows
        hidden_rows, target_rows = hidden, targets
    else:
        hidden_rows, target_rows = hidden.reshape(-1, h_shape[-1]), targets.reshape(-1)
    if target_rows.dtype != torch.int64:  # the backends take int64 ids, as F.cross_entropy does
        target_rows = target_rows.long()
    total = ROUTE((hidden_rows, weight, target_rows), {"chunk_size": chunk_size}, None, backend=backend,
                  requires_grad=needs_grad(hidden, weight))
    count = (target_rows != IGNORE_INDEX).sum() if num_items is None else num_items
    if isinstance(count, torch.Tensor):
        return total / count.to(device=total.device, dtype=total.dtype).clamp(min=1)
    if count < 1:
        raise InputError(f"num_items: expected a positive count; got {count}")
    return total / count


def _key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The route's key: ``H``, ``V``, the chunk size, the dtypes and whether there are no rows at all."""
    hidden, weight, _ = tensors
    rows, size = hidden.shape
    return (size, weight.shape[0], options["chunk_size"], hidden.dtype, weight.dtype, rows == 0)


ROUTE = OpRoute(
    OP, linear_cross_entropy, positional=("hidden", "weight", "targets"),
    key=_key,
    signature=lambda a: signature_of(a["hidden"], a["weight"], a["chunk_size"]))
