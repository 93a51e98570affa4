"""Document boundaries of one packed row, in every form the kernels want.

A packed row holds ``T`` tokens of ``N`` documents (plus at most one trailing padding segment)
in shape ``[1, T]``. Attention kernels want ``cu_seqlens``, Mamba kernels want ``seq_idx``,
RoPE wants restarting ``position_ids``; :class:`PackedBoundaries` carries all of them, built
once on the host so nothing downstream has to synchronise with the device.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["PackedBoundaries"]


def _fail(field: str, expected: str, got: str) -> None:
    raise ValueError(f"{field}: expected {expected}; got {got}")


def _as_int_array(field: str, value: Any, *, ndim_ok: tuple[int, ...]) -> np.ndarray:
    """Host copy of an integer tensor / array / sequence, validated for dtype and rank."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            _fail(field, "an integer tensor (int32 or int64)", f"dtype {value.dtype}")
        arr = value.detach().cpu().numpy()
    else:
        arr = np.asarray(value)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            _fail(field, "integers", f"dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
    if arr.ndim not in ndim_ok:
        shapes = " or ".join("[T]" if n == 1 else "[1, T]" for n in ndim_ok)
        _fail(field, f"shape {shapes}", f"shape {list(arr.shape)}")
    if arr.ndim == 2:
        if arr.shape[0] != 1:
            _fail(field, "batch size 1 (a packed row is [1, T]; flatten the batch with PackingCollator)",
                  f"shape {list(arr.shape)}")
        arr = arr[0]
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class PackedBoundaries:
    """Boundaries of the segments of one packed row.

    Attributes:
        cu_seqlens: int32 ``[S+1]``, 0 first, strictly increasing, ``T`` last, where ``S`` is the
            number of segments (``num_docs`` documents plus one padding segment if any).
        seq_idx: int32 ``[1, T]``, segment id of each token, ``0..S-1``, non-decreasing.
        position_ids: int64 ``[1, T]``, restarting at 0 at every segment.
        max_seqlen: Python int, the longest segment (padding included: kernels need it).
        segment_lengths: every segment's length, padding segment last.
        num_pad_tokens: tokens in the trailing padding segment (0 if none).

    Build with :meth:`from_lengths`, :meth:`from_cu_seqlens`, :meth:`from_seq_idx`,
    :meth:`from_position_ids` or :meth:`from_batch`; each validates its input.
    """

    cu_seqlens: torch.Tensor
    seq_idx: torch.Tensor
    position_ids: torch.Tensor
    max_seqlen: int
    segment_lengths: tuple[int, ...]
    num_pad_tokens: int = 0

    def __post_init__(self) -> None:
        s, t = len(self.segment_lengths), sum(self.segment_lengths)
        if self.cu_seqlens.dtype != torch.int32 or tuple(self.cu_seqlens.shape) != (s + 1,):
            _fail("cu_seqlens", f"int32 tensor of shape [{s + 1}]",
                  f"{self.cu_seqlens.dtype} {list(self.cu_seqlens.shape)}")
        if self.seq_idx.dtype != torch.int32 or tuple(self.seq_idx.shape) != (1, t):
            _fail("seq_idx", f"int32 tensor of shape [1, {t}]", f"{self.seq_idx.dtype} {list(self.seq_idx.shape)}")
        if self.position_ids.dtype != torch.int64 or tuple(self.position_ids.shape) != (1, t):
            _fail("position_ids", f"int64 tensor of shape [1, {t}]",
                  f"{self.position_ids.dtype} {list(self.position_ids.shape)}")
        if not isinstance(self.max_seqlen, int) or isinstance(self.max_seqlen, bool):
            _fail("max_seqlen", "a Python int (a tensor would force a host sync)", type(self.max_seqlen).__name__)
        if self.num_pad_tokens and (s == 0 or self.segment_lengths[-1] != self.num_pad_tokens):
            _fail("num_pad_tokens", "the length of the last segment (the trailing padding segment)",
                  f"{self.num_pad_tokens} with segments {list(self.segment_lengths[-3:])}")

    # ------------------------------------------------------------------ views
    @property
    def num_docs(self) -> int:
        """Real documents (the padding segment is not one)."""
        return len(self.segment_lengths) - (1 if self.num_pad_tokens else 0)

    @property
    def num_segments(self) -> int:
        """Entries of ``cu_seqlens`` minus one: documents plus the padding segment if any."""
        return len(self.segment_lengths)

    @property
    def lengths(self) -> list[int]:
        """Lengths of the real documents."""
        return list(self.segment_lengths[: self.num_docs])

    @property
    def total_tokens(self) -> int:
        """T, padding included."""
        return sum(self.segment_lengths)

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    @property
    def starts(self) -> list[int]:
        """Start offset of every segment (Python ints)."""
        return np.concatenate([[0], np.cumsum(self.segment_lengths[:-1], dtype=np.int64)]).tolist()

    def __repr__(self) -> str:
        shown = list(self.segment_lengths[:8]) + (["..."] if self.num_segments > 8 else [])
        return (f"PackedBoundaries(num_docs={self.num_docs}, total_tokens={self.total_tokens}, "
                f"max_seqlen={self.max_seqlen}, num_pad_tokens={self.num_pad_tokens}, segment_lengths={shown})")

    # ----------------------------------------------------------- constructors
    @classmethod
    def from_lengths(cls, lengths: Sequence[int] | np.ndarray | torch.Tensor, device: torch.device | str | None = None,
                     *, num_pad_tokens: int = 0) -> PackedBoundaries:
        """Boundaries of segments with these lengths, in order (padding segment last if ``num_pad_tokens``)."""
        arr = _as_int_array("lengths", lengths, ndim_ok=(1,))
        if arr.size == 0:
            _fail("lengths", "at least one segment", "an empty list")
        if (arr <= 0).any():
            i = int(np.argmax(arr <= 0))
            _fail("lengths", "every document length >= 1 (drop empty documents before packing)",
                  f"length {int(arr[i])} at index {i}")
        if num_pad_tokens < 0:
            _fail("num_pad_tokens", ">= 0", str(num_pad_tokens))
        if num_pad_tokens and int(arr[-1]) != num_pad_tokens:
            _fail("num_pad_tokens", "the length of the last segment", f"{num_pad_tokens} vs {int(arr[-1])}")
        cu = np.zeros(arr.size + 1, dtype=np.int64)
        np.cumsum(arr, out=cu[1:])
        total = int(cu[-1])
        if total > np.iinfo(np.int32).max:
            _fail("lengths", "a total below 2**31 tokens (cu_seqlens is int32)", f"{total}")
        seq_idx = np.repeat(np.arange(arr.size, dtype=np.int32), arr)
        position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], arr)
        return cls(
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)).to(device),
            seq_idx=torch.from_numpy(seq_idx).view(1, total).to(device),
            position_ids=torch.from_numpy(position_ids).view(1, total).to(device),
            max_seqlen=int(arr.max()),
            segment_lengths=tuple(arr.tolist()),
            num_pad_tokens=int(num_pad_tokens),
        )

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | Sequence[int], *, num_pad_tokens: int = 0) -> PackedBoundaries:
        """From cumulative lengths ``[S+1]`` (0 first, strictly increasing)."""
        cu = _as_int_array("cu_seqlens", cu_seqlens, ndim_ok=(1,))
        if cu.size < 2:
            _fail("cu_seqlens", "at least two entries [0, ..., T]", f"{cu.tolist()}")
        if cu[0] != 0:
            _fail("cu_seqlens", "0 as the first entry", f"{int(cu[0])}")
        steps = np.diff(cu)
        if (steps <= 0).any():
            i = int(np.argmax(steps <= 0))
            _fail("cu_seqlens", "strictly increasing values (no zero-length or negative segments)",
                  f"{int(cu[i])} then {int(cu[i + 1])} at positions {i}, {i + 1}")
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
        return cls.from_lengths(steps, device=device, num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_seq_idx(cls, seq_idx: torch.Tensor | Sequence[int], *, num_pad_tokens: int = 0) -> PackedBoundaries:
        """From per-token segment ids ``[1, T]`` (or ``[T]``): 0, 0, 1, 1, 1, 2, ..."""
        ids = _as_int_array("seq_idx", seq_idx, ndim_ok=(1, 2))
        if ids.size == 0:
            _fail("seq_idx", "at least one token", "an empty tensor")
        if ids[0] != 0:
            _fail("seq_idx", "0 as the first id", f"{int(ids[0])}")
        steps = np.diff(ids)
        if ((steps != 0) & (steps != 1)).any():
            i = int(np.argmax((steps != 0) & (steps != 1)))
            _fail("seq_idx", "non-decreasing ids that step by exactly 1 (each id used by one contiguous run)",
                  f"{int(ids[i])} then {int(ids[i + 1])} at tokens {i}, {i + 1}")
        starts = np.flatnonzero(np.concatenate([[1], steps]))
        lengths = np.diff(np.append(starts, ids.size))
        device = seq_idx.device if isinstance(seq_idx, torch.Tensor) else None
        return cls.from_lengths(lengths, device=device, num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | Sequence[int], *, num_pad_tokens: int = 0) -> PackedBoundaries:
        """From restarting positions ``[1, T]`` (or ``[T]``): 0, 1, 0, 1, 2, ...

        A document starts wherever the position is 0; every other position must be the previous one plus 1.
        """
        pos = _as_int_array("position_ids", position_ids, ndim_ok=(1, 2))
        if pos.size == 0:
            _fail("position_ids", "at least one token", "an empty tensor")
        if pos[0] != 0:
            _fail("position_ids", "0 at the first token (positions restart at 0 in every document)", f"{int(pos[0])}")
        bad = (pos[1:] != 0) & (pos[1:] != pos[:-1] + 1)
        if bad.any():
            i = int(np.argmax(bad)) + 1
            _fail("position_ids", "each position 0 (a new document) or the previous one plus 1",
                  f"{int(pos[i - 1])} then {int(pos[i])} at tokens {i - 1}, {i}")
        starts = np.flatnonzero(pos == 0)
        lengths = np.diff(np.append(starts, pos.size))
        device = position_ids.device if isinstance(position_ids, torch.Tensor) else None
        return cls.from_lengths(lengths, device=device, num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any]) -> PackedBoundaries:
        """From a :class:`~hybrid_pack.PackingCollator` output (or any dict with the same keys).

        Uses ``cu_seq_lens_q`` if present, else ``seq_idx``, else ``position_ids``, and checks that
        every other boundary key present on the host agrees. ``num_pad_tokens`` is read when present.
        Call it on the host batch, before moving it to the device: reading device tensors synchronises.
        """
        num_pad = int(batch.get("num_pad_tokens", 0) or 0)
        for key in ("cu_seq_lens_q", "cu_seqlens", "seq_idx", "position_ids"):
            if batch.get(key) is not None:
                break
        else:
            raise ValueError("batch: expected one of 'cu_seq_lens_q', 'seq_idx' or 'position_ids' "
                             "(build batches with hybrid_pack.PackingCollator)")
        maker = {"cu_seq_lens_q": cls.from_cu_seqlens, "cu_seqlens": cls.from_cu_seqlens,
                 "seq_idx": cls.from_seq_idx, "position_ids": cls.from_position_ids}[key]
        out = maker(batch[key], num_pad_tokens=num_pad)
        for other in ("cu_seq_lens_k", "seq_idx", "position_ids"):
            got = batch.get(other)
            if other != key and got is not None and (not isinstance(got, torch.Tensor) or got.device.type == "cpu"):
                expected = {"cu_seq_lens_k": out.cu_seqlens, "seq_idx": out.seq_idx,
                            "position_ids": out.position_ids}[other]
                same = (isinstance(got, torch.Tensor) and tuple(got.shape) == tuple(expected.shape)
                        and torch.equal(got.detach().to("cpu", torch.int64), expected.to("cpu", torch.int64)))
                if not same:
                    raise ValueError(f"{other}: expected the same boundaries as {key!r}; they disagree "
                                     f"(build all boundary keys together with PackingCollator)")
        for other in ("max_length_q", "max_length_k"):
            if batch.get(other) is not None and int(batch[other]) != out.max_seqlen:
                raise ValueError(f"{other}: expected {out.max_seqlen} (the longest segment of {key!r}); "
                                 f"got {batch[other]}")
        ids = batch.get("input_ids")
        if ids is not None and ids.shape[-1] != out.total_tokens:
            raise ValueError(f"input_ids: expected {out.total_tokens} tokens (the total of {key!r}); "
                             f"got shape {list(ids.shape)}")
        return out

    # ------------------------------------------------------------ conversion
    def to(self, device: torch.device | str) -> PackedBoundaries:
        """A copy with every tensor on ``device`` (``max_seqlen`` stays a Python int)."""
        return PackedBoundaries(
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
            seq_idx=self.seq_idx.to(device, non_blocking=True),
            position_ids=self.position_ids.to(device, non_blocking=True),
            max_seqlen=self.max_seqlen,
            segment_lengths=self.segment_lengths,
            num_pad_tokens=self.num_pad_tokens,
        )

    def hf_kwargs(self) -> dict[str, Any]:
        """The keyword arguments Hugging Face models take for a packed row."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
            "seq_idx": self.seq_idx,
            "position_ids": self.position_ids,
        }
