"""The certifier of batch-invariant packing (docs/api.md §7e): the same sequences scored in several packings and
alone, compared bit for bit."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hybrid_pack.errors import InputError
from hybrid_pack.schema import INPUT_IDS

__all__ = ["check_invariance", "InvarianceReport", "PackingResult", "ulp_distance"]

DEFAULT_LENGTHS = (1, 7, 60, 23, 2, 41, 16, 33)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """int64 distance between float32 ``a`` and ``b`` in units in the last place: how many float32 values lie
    from one to the other (0: the same bits, or ``+0``/``-0``)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return (ordered(a.float()) - ordered(b.float())).abs()


@dataclass(frozen=True)
class PackingResult:
    """One packing of the sequences against each sequence alone.

    Attributes:
        rows: the sequences (indices) of each row, in row order.
        mismatched_tokens: tokens whose log-prob row differs from the alone row in any bit.
        max_ulp: the largest distance in float32 units in the last place, over every token and vocabulary entry.
        max_logprob_diff: the largest absolute log-prob difference.
        mismatch_kl: the mean over tokens of ``KL(alone || packed)`` (see :func:`check_invariance`).
    """

    rows: list[list[int]]
    mismatched_tokens: int
    max_ulp: int
    max_logprob_diff: float
    mismatch_kl: float


@dataclass(frozen=True)
class InvarianceReport:
    """What :func:`check_invariance` found.

    Attributes:
        ok: every token of every packing has the same log-prob bits as alone.
        tokens: tokens compared per packing (the sum of the sequences' lengths).
        row_length: the static row length.
        dtype: the dtype the model ran in.
        packings: one :class:`PackingResult` per packing.
        mismatched_tokens, max_ulp, max_logprob_diff, mismatch_kl: the worst packing's figures.
    """

    tokens: int
    row_length: int
    dtype: str
    packings: list[PackingResult] = field(default_factory=list)

    @property
    def mismatched_tokens(self) -> int:
        return max(p.mismatched_tokens for p in self.packings)

    @property
    def max_ulp(self) -> int:
        return max(p.max_ulp for p in self.packings)

    @property
    def max_logprob_diff(self) -> float:
        return max(p.max_logprob_diff for p in self.packings)

    @property
    def mismatch_kl(self) -> float:
        return max(p.mismatch_kl for p in self.packings)

    @property
    def ok(self) -> bool:
        return self.mismatched_tokens == 0

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "tokens": self.tokens, "row_length": self.row_length, "dtype": self.dtype,
                "mismatched_tokens": self.mismatched_tokens, "max_ulp": self.max_ulp,
                "max_logprob_diff": self.max_logprob_diff, "mismatch_kl": self.mismatch_kl,
                "packings": [asdict(p) for p in self.packings]}

    def __str__(self) -> str:
        verdict = "bitwise invariant" if self.ok else "NOT invariant"
        return (f"{verdict}: {len(self.packings)} packings of {self.tokens} tokens in rows of {self.row_length} "
                f"({self.dtype}); worst packing: {self.mismatched_tokens} mismatched tokens, max {self.max_ulp} ulp, "
                f"max |dlogp| {self.max_logprob_diff:.3g}, mismatch KL {self.mismatch_kl:.3g}")


def _first_fit(order: list[int], lengths: list[int], row_length: int) -> list[list[int]]:
    rows: list[list[int]] = []
    room: list[int] = []
    for index in order:
        slot = next((r for r, free in enumerate(room) if free >= lengths[index]), None)
        if slot is None:
            rows.append([])
            room.append(row_length)
            slot = len(rows) - 1
        rows[slot].append(index)
        room[slot] -= lengths[index]
    return rows


def _logprobs_of_rows(model: torch.nn.Module, sequences: list[torch.Tensor], rows: list[list[int]],
                      collator: Any) -> dict[int, torch.Tensor]:
    """Each sequence's float32 log-prob rows ``[L, V]`` from the packed rows ``rows``."""
    from hybrid_pack.isolation.probe import output_logits

    out = {}
    for row in rows:
        batch = collator([{INPUT_IDS: sequences[i].tolist()} for i in row])
        batch.pop("labels", None)
        logits = output_logits(model(**batch))[0]
        start = 0
        for i in row:
            length = sequences[i].numel()
            out[i] = torch.log_softmax(logits[start:start + length].float(), dim=-1)
            start += length
    return out


@torch.no_grad()
def check_invariance(model: torch.nn.Module, sequences: Sequence[Sequence[int] | torch.Tensor] | None = None, *,
                     lengths: Sequence[int] | None = None, row_length: int = 128, packings: int = 3,
                     dtype: torch.dtype | None = None, seed: int = 0) -> InvarianceReport:
    """Score the same sequences in ``packings`` packings of static rows and each alone, and compare bit for bit.

    Run it inside :func:`hybrid_pack.batch_invariant` to certify the mode (``report.ok``); outside it, it measures
    how far the default packed path is from invariant. Rows come from
    ``PackingCollator(pack_length=row_length, max_documents=len(sequences))``; packing 0 keeps the given order,
    packing ``p > 0`` shuffles it (seeded by ``seed + p``), and both fill rows first-fit. Alone, each sequence sits
    at offset 0 of its own row, followed by padding.

    For every token ``t`` (every position of every sequence), with ``a_t`` the float32 log-softmax of its logits
    alone and ``b_t`` packed (vectors over the vocabulary):

    - a mismatched token has ``a_t`` and ``b_t`` differing in any bit; ``max_ulp`` is the largest
      ``|ord(a_t[v]) - ord(b_t[v])|`` over tokens and entries (:func:`ulp_distance`: float32 values between them);
    - ``max_logprob_diff`` is ``max |a_t[v] - b_t[v]|``;
    - ``mismatch_kl`` is ``mean_t sum_v exp(a_t[v]) (a_t[v] - b_t[v])``, the KL divergence of the packed
      next-token distribution from the one alone, averaged over tokens (the "mismatch KL" prime-rl and NeMo-RL
      bound between rollout and trainer log-probs, taken here over the full vocabulary).

    Args:
        model: a packed causal LM (native preset or patched Hugging Face model) taking collator batches.
        sequences: token ids, one sequence each (default: random ids of ``lengths`` from ``seed``).
        lengths: lengths of the random sequences (default 8 lengths from 1 to 60).
        row_length: the static row length; no sequence may be longer.
        packings: how many packings to compare with alone.
        dtype: run a copy of the model in this dtype (None: the model as it is).
        seed: for the random sequences and the shuffles.

    Raises:
        InputError: no sequences, a sequence longer than ``row_length``, or ``packings < 1``.
    """
    from hybrid_pack.collate import PackingCollator

    generator = torch.Generator().manual_seed(seed)
    if sequences is None:
        vocab = model.config.vocab_size
        sequences = [torch.randint(3, vocab, (n,), generator=generator) for n in (lengths or DEFAULT_LENGTHS)]
    seqs = [torch.as_tensor(s, dtype=torch.int64).reshape(-1) for s in sequences]
    sizes = [s.numel() for s in seqs]
    if not seqs or min(sizes) < 1:
        raise InputError("sequences: expected at least one non-empty sequence")
    if max(sizes) > row_length:
        raise InputError(f"row_length: a sequence has {max(sizes)} tokens, more than row_length={row_length}")
    if packings < 1:
        raise InputError(f"packings: expected at least 1; got {packings}")
    if dtype is not None and next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    parameter = next(model.parameters())
    run_dtype = str(parameter.dtype).removeprefix("torch.")
    if torch.is_autocast_enabled(parameter.device.type):  # what set the precision of the products
        run_dtype += f" under autocast {str(torch.get_autocast_dtype(parameter.device.type)).removeprefix('torch.')}"
    collator = PackingCollator(pack_length=row_length, max_documents=len(seqs))
    alone = _logprobs_of_rows(model, seqs, [[i] for i in range(len(seqs))], collator)
    results = []
    for p in range(packings):
        order = list(range(len(seqs))) if p == 0 else torch.randperm(
            len(seqs), generator=torch.Generator().manual_seed(seed + p)).tolist()
        rows = _first_fit(order, sizes, row_length)
        packed = _logprobs_of_rows(model, seqs, rows, collator)
        a = torch.cat([alone[i] for i in range(len(seqs))])
        b = torch.cat([packed[i] for i in range(len(seqs))])
        ulps = ulp_distance(a, b).amax(dim=-1)
        kl = (a.exp() * (a - b)).sum(-1).mean()
        results.append(PackingResult(rows, int((ulps > 0).sum()), int(ulps.max()), float((a - b).abs().max()),
                                     float(kl)))
    return InvarianceReport(sum(sizes), row_length, run_dtype, results)
