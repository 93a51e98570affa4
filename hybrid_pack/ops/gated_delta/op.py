"""The gated delta rule (Gated DeltaNet) with its state reset at every document start (docs/api.md §4)."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.gated_delta.check import OP, signature_of
from hybrid_pack.ops.gated_delta.cp import gated_delta_rule_cp
from hybrid_pack.ops.library import PackedCustomOp
from hybrid_pack.ops.validate import check_delta_rule, default_scale, delta_rule_key, needs_grad, state_dtype


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     boundaries: PackedBoundaries | StaticBoundaries, *, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     use_qk_l2norm: bool = False, backend: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T``, ``o_t = scale S_t^T q_t``.

    ``S`` starts from zero (or ``initial_state[n]``) at the first token of each document ``n``.

    Args:
        q, k: ``[1, T, H, K]``.
        v: ``[1, T, HV, V]`` with ``HV % H == 0`` (each q/k head serves ``HV // H`` value heads).
        g: ``[1, T, HV]``, log decay (<= 0).
        beta: ``[1, T, HV]``, write strength.
        boundaries: where the documents of the row start; a :class:`~hybrid_pack.parallel.ShardedBoundaries`
            runs this rank's slice of a row split across a context-parallel group (see
            :func:`~hybrid_pack.ops.gated_delta.cp.gated_delta_rule_cp` for what ``initial_state`` and the
            final states then mean).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` for the ``N = boundaries.num_docs`` documents (the padding
            segment, if any, starts from zero); with :class:`StaticBoundaries`, one per segment slot
            (``N = boundaries.num_segments``).
        output_final_state: also return each document's final state ``[N, HV, K, V]`` (float32; float64
            for float64 inputs).
        use_qk_l2norm: L2-normalise q and k over K first.
        backend: force a backend (see :mod:`hybrid_pack.backends`).

    Returns:
        ``(o [1, T, HV, V] in v's dtype, final_state or None)``.
    """
    check_delta_rule(q, k, v, g, beta, initial_state, boundaries, per_key_gate=False)
    scale = default_scale(q.shape[3]) if scale is None else float(scale)
    options = {"scale": scale, "initial_state": initial_state, "output_final_state": output_final_state,
               "use_qk_l2norm": use_qk_l2norm}
    return ROUTE((q, k, v, g, beta), options, boundaries, backend=backend,
                 requires_grad=needs_grad(q, k, v, g, beta, initial_state))


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           initial_state: torch.Tensor | None, boundaries: PackedBoundaries,
           **options: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    return gated_delta_rule(q, k, v, g, beta, boundaries, initial_state=initial_state, **options)


def _fake(tensors: list[torch.Tensor], num_segments: int, *, output_final_state: bool,
          **options: object) -> list[torch.Tensor]:
    q, k, v = tensors[:3]
    dtype_of_states = state_dtype(torch.promote_types(q.dtype, v.dtype))  # as the torch backend's
    state = [q.new_empty((num_segments, v.shape[2], k.shape[3], v.shape[3]), dtype=dtype_of_states)]
    return [v.new_empty(v.shape), *(state if output_final_state else [])]


ROUTE = OpRoute(
    OP, gated_delta_rule, positional=("q", "k", "v", "g", "beta"),
    key=delta_rule_key,
    signature=lambda a: signature_of(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["initial_state"],
                                     output_final_state=a["output_final_state"], use_qk_l2norm=a["use_qk_l2norm"]),
    sharded=gated_delta_rule_cp,
    opaque=PackedCustomOp("gated_delta_rule", ("q", "k", "v", "g", "beta", "initial_state?"),
                          "float scale, bool output_final_state, bool use_qk_l2norm", _eager, fake=_fake,
                          state_input=5),
    from_opaque=lambda outputs, a: (outputs[0], outputs[1] if a["output_final_state"] else None),
    layouts=("contiguous",))
