"""Document boundaries of one packed row, in every form the kernels want.

A packed row holds ``T`` tokens of ``N`` documents (plus at most one trailing padding segment)
in shape ``[1, T]``. Attention kernels want ``cu_seqlens``, Mamba kernels want ``seq_idx``,
RoPE wants restarting ``position_ids``; :class:`PackedBoundaries` carries all of them, built
once on the host so nothing downstream has to synchronise with the device. What the ops derive
from the boundaries (chunk layouts, attention buckets, kernel chunk indices, attention masks) is
built on first use and kept on the object: every layer of a forward pass shares it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from hybrid_pack.boundaries.arrays import boundary_arrays
from hybrid_pack.boundaries.buckets import BucketLayout, build_bucket_layout
from hybrid_pack.boundaries.chunks import ChunkLayout, build_chunk_layout, build_kernel_chunk_index
from hybrid_pack.boundaries.host import HostBoundaries, StaticHostBoundaries
from hybrid_pack.errors import BoundaryError
from hybrid_pack.schema import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    HOST_BOUNDARIES,
    INPUT_IDS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_PAD_TOKENS,
    POSITION_IDS,
    PRIMARY_BOUNDARY_KEYS,
    SEQ_IDX,
)

__all__ = ["PackedBoundaries"]

View = TypeVar("View")


_INT32_MAX = int(np.iinfo(np.int32).max)


def _fail(field: str, expected: str, got: str) -> None:
    raise BoundaryError(f"{field}: expected {expected}; got {got}")


def _usable_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` parsed, or :class:`BoundaryError` naming it (not a device, or CUDA this torch cannot reach)."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        _fail("device", "cpu, cuda, cuda:1 ...", repr(device))
    if device.type == "cuda" and not torch.cuda.is_available():
        _fail("device", "a device this torch can use", f"{device} (this torch sees no CUDA device)")
    return device


def _pad_count(num_pad_tokens: Any) -> int:
    """``num_pad_tokens`` (an int, or a 0-d integer tensor or array) as an int >= 0; a bool or a float is refused,
    naming the field."""
    try:
        count = -1 if isinstance(num_pad_tokens, bool) or getattr(num_pad_tokens, "dtype", None) in (
            torch.bool, np.bool_) else operator.index(num_pad_tokens)
    except TypeError:
        count = -1
    if count < 0:
        _fail(NUM_PAD_TOKENS, "an int >= 0", repr(num_pad_tokens))
    return count


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
        segment_lengths: every segment's length, the padding segment (if any) last.
        num_pad_tokens: tokens in the trailing padding segment (0 if none).

    ``document_lengths`` (also ``lengths``) are the real documents' lengths, padding left out.
    Build with :meth:`from_document_lengths`, :meth:`from_lengths` (segment lengths),
    :meth:`from_cu_seqlens`, :meth:`from_seq_idx`, :meth:`from_position_ids` or :meth:`from_batch`;
    each validates its input.
    """

    cu_seqlens: torch.Tensor
    seq_idx: torch.Tensor
    position_ids: torch.Tensor
    max_seqlen: int
    segment_lengths: tuple[int, ...]
    num_pad_tokens: int = 0
    _views: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    _total_tokens: int = field(default=0, init=False, repr=False, compare=False)
    _device: torch.device = field(default=torch.device("cpu"), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        s, t = len(self.segment_lengths), sum(self.segment_lengths)
        # Read by every op call; a compiled graph then guards these two values, not the tensors or the segments.
        object.__setattr__(self, "_total_tokens", t)
        object.__setattr__(self, "_device", self.cu_seqlens.device)
        if self.cu_seqlens.dtype != torch.int32 or tuple(self.cu_seqlens.shape) != (s + 1,):
            _fail("cu_seqlens", f"int32 tensor of shape [{s + 1}]",
                  f"{self.cu_seqlens.dtype} {list(self.cu_seqlens.shape)}")
        if self.seq_idx.dtype != torch.int32 or tuple(self.seq_idx.shape) != (1, t):
            _fail(SEQ_IDX, f"int32 tensor of shape [1, {t}]", f"{self.seq_idx.dtype} {list(self.seq_idx.shape)}")
        if self.position_ids.dtype != torch.int64 or tuple(self.position_ids.shape) != (1, t):
            _fail(POSITION_IDS, f"int64 tensor of shape [1, {t}]",
                  f"{self.position_ids.dtype} {list(self.position_ids.shape)}")
        if not isinstance(self.max_seqlen, int) or isinstance(self.max_seqlen, bool):
            _fail("max_seqlen", "a Python int (a tensor would force a host sync)", type(self.max_seqlen).__name__)
        if self.num_pad_tokens and (s == 0 or self.segment_lengths[-1] != self.num_pad_tokens):
            _fail(NUM_PAD_TOKENS, "the length of the last segment (the trailing padding segment)",
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
    def document_lengths(self) -> list[int]:
        """Lengths of the real documents (the padding segment left out)."""
        return list(self.segment_lengths[: self.num_docs])

    @property
    def lengths(self) -> list[int]:
        """The same as :attr:`document_lengths` (padding left out)."""
        return self.document_lengths

    @property
    def total_tokens(self) -> int:
        """T, padding included."""
        return self._total_tokens

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def document_positions(self) -> torch.Tensor:
        """int64 ``[1, T]``: each token's position in its document, what RoPE rotates by (``position_ids``; a
        context-parallel shard's :class:`~hybrid_pack.parallel.ShardedBoundaries` counts them from the document's
        start on earlier ranks)."""
        return self.position_ids

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
    def from_lengths(cls, segment_lengths: Sequence[int] | np.ndarray | torch.Tensor,
                     device: torch.device | str | None = None, *, num_pad_tokens: int = 0) -> PackedBoundaries:
        """Boundaries of segments with these lengths, in order; with ``num_pad_tokens`` the last one is padding.

        ``segment_lengths`` holds every segment, the padding segment included; to give the documents'
        lengths and the padding apart, use :meth:`from_document_lengths`.
        """
        arr = _as_int_array("lengths", segment_lengths, ndim_ok=(1,))
        device = _usable_device(device)
        if arr.size == 0:
            _fail("lengths", "at least one segment", "an empty list")
        if (arr <= 0).any():
            i = int(np.argmax(arr <= 0))
            _fail("lengths", "every document length >= 1 (drop empty documents before packing)",
                  f"length {int(arr[i])} at index {i}")
        num_pad_tokens = _pad_count(num_pad_tokens)
        if num_pad_tokens and int(arr[-1]) != num_pad_tokens:
            _fail(NUM_PAD_TOKENS, "the length of the last segment", f"{num_pad_tokens} vs {int(arr[-1])}")
        total = int(arr.sum())
        if total > _INT32_MAX:
            _fail("lengths", "a total below 2**31 tokens (cu_seqlens is int32)", f"{total}")
        cu_seqlens, seq_idx, position_ids = boundary_arrays(arr)
        return cls(
            cu_seqlens=torch.from_numpy(cu_seqlens).to(device, non_blocking=True),
            seq_idx=torch.from_numpy(seq_idx).to(device, non_blocking=True),
            position_ids=torch.from_numpy(position_ids).to(device, non_blocking=True),
            max_seqlen=int(arr.max()),
            segment_lengths=tuple(arr.tolist()),
            num_pad_tokens=int(num_pad_tokens),
        )

    @classmethod
    def from_document_lengths(cls, document_lengths: Sequence[int] | np.ndarray | torch.Tensor, *,
                              num_pad_tokens: int = 0, device: torch.device | str | None = None) -> PackedBoundaries:
        """Boundaries of documents with these lengths, followed by a padding segment of ``num_pad_tokens``."""
        lengths = _as_int_array("document_lengths", document_lengths, ndim_ok=(1,))
        num_pad_tokens = _pad_count(num_pad_tokens)
        return cls.from_lengths(np.append(lengths, num_pad_tokens) if num_pad_tokens else lengths, device,
                                num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor | Sequence[int], *, num_pad_tokens: int = 0,
                        static: bool = False) -> PackedBoundaries:
        """From cumulative lengths ``[S+1]`` (0 first, strictly increasing).

        ``static=True`` reads the static form (docs/api.md §9): the zero-length segments that may end it (its
        unused document slots, ``T`` repeated) are left out.
        """
        cu = _as_int_array("cu_seqlens", cu_seqlens, ndim_ok=(1,))
        if static and cu.size > 2:
            before_end = np.flatnonzero(cu != cu[-1])
            cu = cu[:before_end[-1] + 2 if before_end.size else 2]
        if cu.size < 2:
            _fail("cu_seqlens", "at least two entries [0, ..., T]", f"{cu.tolist()}")
        if cu[0] != 0:
            _fail("cu_seqlens", "0 as the first entry", f"{int(cu[0])}")
        steps = np.diff(cu)
        if (steps <= 0).any():
            i = int(np.argmax(steps <= 0))
            _fail("cu_seqlens", "strictly increasing values (no zero-length or negative segments)",
                  f"{int(cu[i])} then {int(cu[i + 1])} at positions {i}, {i + 1}")
        if int(cu[-1]) > _INT32_MAX:
            _fail("cu_seqlens", "a total below 2**31 tokens (cu_seqlens is int32)", f"{int(cu[-1])}")
        device = cu_seqlens.device if isinstance(cu_seqlens, torch.Tensor) else None
        return cls.from_lengths(steps, device=device, num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_seq_idx(cls, seq_idx: torch.Tensor | Sequence[int], *, num_pad_tokens: int = 0) -> PackedBoundaries:
        """From per-token segment ids ``[1, T]`` (or ``[T]``): 0, 0, 1, 1, 1, 2, ..."""
        ids = _as_int_array(SEQ_IDX, seq_idx, ndim_ok=(1, 2))
        if ids.size == 0:
            _fail(SEQ_IDX, "at least one token", "an empty tensor")
        if ids[0] != 0:
            _fail(SEQ_IDX, "0 as the first id", f"{int(ids[0])}")
        steps = np.diff(ids)
        if ((steps != 0) & (steps != 1)).any():
            i = int(np.argmax((steps != 0) & (steps != 1)))
            _fail(SEQ_IDX, "non-decreasing ids that step by exactly 1 (each id used by one contiguous run)",
                  f"{int(ids[i])} then {int(ids[i + 1])} at tokens {i}, {i + 1}")
        starts = np.flatnonzero(np.concatenate([[1], steps]))
        lengths = np.diff(np.append(starts, ids.size))
        device = seq_idx.device if isinstance(seq_idx, torch.Tensor) else None
        return cls.from_lengths(lengths, device=device, num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | Sequence[int], *,
                          num_pad_tokens: int = 0) -> PackedBoundaries:
        """From restarting positions ``[1, T]`` (or ``[T]``): 0, 1, 0, 1, 2, ...

        A document starts wherever the position is 0; every other position must be the previous one plus 1.
        """
        pos = _as_int_array(POSITION_IDS, position_ids, ndim_ok=(1, 2))
        if pos.size == 0:
            _fail(POSITION_IDS, "at least one token", "an empty tensor")
        if pos[0] != 0:
            _fail(POSITION_IDS, "0 at the first token (positions restart at 0 in every document)", f"{int(pos[0])}")
        bad = (pos[1:] != 0) & (pos[1:] != pos[:-1] + 1)
        if bad.any():
            i = int(np.argmax(bad)) + 1
            _fail(POSITION_IDS, "each position 0 (a new document) or the previous one plus 1",
                  f"{int(pos[i - 1])} then {int(pos[i])} at tokens {i - 1}, {i}")
        starts = np.flatnonzero(pos == 0)
        lengths = np.diff(np.append(starts, pos.size))
        device = position_ids.device if isinstance(position_ids, torch.Tensor) else None
        return cls.from_lengths(lengths, device=device, num_pad_tokens=num_pad_tokens)

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any]) -> PackedBoundaries:
        """From a :class:`~hybrid_pack.PackingCollator` output (or any dict with the same keys).

        With ``host_boundaries`` (the collator's :class:`~hybrid_pack.boundaries.host.HostBoundaries`, or a static
        batch's :class:`~hybrid_pack.boundaries.host.StaticHostBoundaries`) no device value is read (docs/api.md
        §9b): the segment lengths are the host entry's and ``cu_seq_lens_q`` (its used slots), ``seq_idx`` and
        ``position_ids`` are the batch's tensors as they are (built on their
        device from the lengths when absent, or when ``position_ids`` are 3-D); only shapes and the Python ints
        ``max_length_q/k``, ``num_pad_tokens`` and ``input_ids``' length are checked against it.

        Without it, uses ``cu_seq_lens_q`` if present, else ``seq_idx``, else ``position_ids``, and checks that
        every other boundary key present on the host agrees. 3-D ``position_ids`` (a vision-language model's
        M-RoPE ids, ``[3, 1, T]``) are not boundaries: they are skipped, and another key must be given.
        ``num_pad_tokens`` is read when present.
        A static batch (docs/api.md §9) gives the boundaries of the same documents without its static padding: its
        unused document slots (zero-length segments at the end of ``cu_seq_lens_q``) are left out.
        Call it on the host batch, before moving it to the device: reading device tensors synchronises.
        NumPy arrays (``return_tensors="np"``) are read like CPU tensors.
        """
        if not isinstance(batch, Mapping):
            raise BoundaryError(f"batch: expected the collated batch (a dict of its keys); got {type(batch).__name__} "
                                "(collate the examples with hybrid_pack.PackingCollator first)")
        host = batch.get(HOST_BOUNDARIES)
        if isinstance(host, StaticHostBoundaries):   # a static batch's: checked by shape, then its used slots
            slots = tuple(host.cu_seqlens.shape)
            for key in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K):
                if batch.get(key) is not None and tuple(batch[key].shape) != slots:
                    raise BoundaryError(f"{key}: expected shape {list(slots)} (the static slots {HOST_BOUNDARIES!r} "
                                        f"describes); got {list(batch[key].shape)}. {HOST_BOUNDARIES} holds only for "
                                        "the tensors it was collated with: drop it from a batch whose boundary keys "
                                        "were edited")
            host = host.lengths()
            batch = {**batch, **{key: batch[key][:host.num_segments + 1] for key in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K)
                                 if batch.get(key) is not None}}
        if host is not None:
            return cls._from_host(host, batch)
        num_pad = 0 if batch.get(NUM_PAD_TOKENS) is None else int(batch[NUM_PAD_TOKENS])  # one read, not two
        if getattr(batch.get(POSITION_IDS), "ndim", 2) == 3:   # M-RoPE ids [3, 1, T] (§3b): not boundaries
            if batch.get(CU_SEQ_LENS_Q) is None and batch.get(SEQ_IDX) is None:
                raise BoundaryError(f"{POSITION_IDS}: 3-D (M-RoPE) position ids do not say where documents start; "
                                    f"give {CU_SEQ_LENS_Q!r} or {SEQ_IDX!r} with them (PackingCollator does)")
            batch = {key: value for key, value in batch.items() if key != POSITION_IDS}
        key = next((key for key in PRIMARY_BOUNDARY_KEYS if batch.get(key) is not None), None)
        if key is None:
            raise BoundaryError(f"batch: expected one of {', '.join(map(repr, PRIMARY_BOUNDARY_KEYS))} "
                                "(build batches with hybrid_pack.PackingCollator)")
        if key == CU_SEQ_LENS_Q:
            out = cls.from_cu_seqlens(batch[key], num_pad_tokens=num_pad, static=True)
            cu_seqlens = torch.as_tensor(batch[key])
        else:
            maker = cls.from_seq_idx if key == SEQ_IDX else cls.from_position_ids
            out = maker(batch[key], num_pad_tokens=num_pad)
            cu_seqlens = out.cu_seqlens
        expected_of = {CU_SEQ_LENS_K: cu_seqlens, SEQ_IDX: out.seq_idx, POSITION_IDS: out.position_ids}
        for other, expected in expected_of.items():
            got = batch.get(other)
            if isinstance(got, np.ndarray):  # a PackingCollator(return_tensors="np") batch
                got = torch.from_numpy(got)
            if other != key and got is not None and (not isinstance(got, torch.Tensor) or got.device.type == "cpu"):
                if not isinstance(got, torch.Tensor) or got.dtype != expected.dtype:
                    _fail(other, f"a {expected.dtype} tensor (as the collator builds it)",
                          f"{got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__)
                same = tuple(got.shape) == tuple(expected.shape) and torch.equal(got.detach().cpu(), expected.cpu())
                if not same:
                    raise BoundaryError(f"{other}: expected the same boundaries as {key!r}; they disagree "
                                        f"(build all boundary keys together with PackingCollator)")
        for other in (MAX_LENGTH_Q, MAX_LENGTH_K):
            if batch.get(other) is not None and int(batch[other]) not in (out.max_seqlen, out.total_tokens):
                raise BoundaryError(f"{other}: expected {out.max_seqlen} (the longest segment of {key!r}), or "
                                    f"{out.total_tokens} (T, in a static batch); got {batch[other]}")
        ids = batch.get(INPUT_IDS)
        if ids is not None and ids.shape[-1] != out.total_tokens:
            raise BoundaryError(f"{INPUT_IDS}: expected {out.total_tokens} tokens (the total of {key!r}); "
                                f"got shape {list(ids.shape)}")
        return out

    @classmethod
    def _from_host(cls, host: Any, batch: Mapping[str, Any]) -> PackedBoundaries:
        """:meth:`from_batch` of a batch carrying ``host_boundaries``: shapes checked, no value read."""
        if not isinstance(host, HostBoundaries):
            raise BoundaryError(f"{HOST_BOUNDARIES}: expected the hybrid_pack.boundaries.host.HostBoundaries "
                                f"PackingCollator puts there; got {type(host).__name__} (drop the key, or collate "
                                "with PackingCollator)")
        t, s = host.total_tokens, host.num_segments
        tensors = {key: batch.get(key) for key in (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, SEQ_IDX, POSITION_IDS, INPUT_IDS)}
        tensors = {key: torch.from_numpy(value) if isinstance(value, np.ndarray) else value
                   for key, value in tensors.items() if value is not None}
        expected = {CU_SEQ_LENS_Q: (s + 1,), CU_SEQ_LENS_K: (s + 1,), SEQ_IDX: (1, t), POSITION_IDS: (1, t),
                    INPUT_IDS: (1, t)}
        if getattr(tensors.get(POSITION_IDS), "ndim", 2) == 3:   # M-RoPE ids [3, 1, T] (§3b): not boundaries
            expected[POSITION_IDS] = (3, 1, t)
        for key, value in tensors.items():
            if tuple(value.shape) != expected[key]:
                raise BoundaryError(f"{key}: expected shape {list(expected[key])} (the {s} segments of {t} tokens "
                                    f"{HOST_BOUNDARIES!r} describes); got {list(value.shape)}. {HOST_BOUNDARIES} "
                                    f"holds only for the tensors it was collated with: drop it from a batch whose "
                                    f"tokens or boundary keys were cut or edited")
        for key, values in ((MAX_LENGTH_Q, (host.max_seqlen, t)), (MAX_LENGTH_K, (host.max_seqlen, t)),
                            (NUM_PAD_TOKENS, (host.num_pad_tokens,))):
            given, value = batch.get(key), values[0]
            if isinstance(given, int) and given not in values:   # max_length_q/k are T in a static batch
                raise BoundaryError(f"{key}: expected {value} (from {HOST_BOUNDARIES!r}); got {given}. Drop "
                                    f"{HOST_BOUNDARIES} from a batch whose boundary keys were edited")
        cu_seqlens, seq_idx, position_ids = (tensors.get(key) for key in (CU_SEQ_LENS_Q, SEQ_IDX, POSITION_IDS))
        if cu_seqlens is None or seq_idx is None or position_ids is None or position_ids.ndim == 3:
            device = next(iter(tensors.values())).device if tensors else None
            return cls.from_lengths(host.segment_lengths, device, num_pad_tokens=host.num_pad_tokens)
        return cls(cu_seqlens=cu_seqlens, seq_idx=seq_idx, position_ids=position_ids, max_seqlen=host.max_seqlen,
                   segment_lengths=host.segment_lengths, num_pad_tokens=host.num_pad_tokens)

    def host(self) -> HostBoundaries:
        """These boundaries' segment lengths as Python ints: the batch's ``host_boundaries`` entry."""
        return HostBoundaries(self.segment_lengths, self.num_pad_tokens)

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
            POSITION_IDS: self.position_ids,
            SEQ_IDX: self.seq_idx,
            CU_SEQ_LENS_Q: self.cu_seqlens,
            CU_SEQ_LENS_K: self.cu_seqlens,
            MAX_LENGTH_Q: self.max_seqlen,
            MAX_LENGTH_K: self.max_seqlen,
        }

    def batch_kwargs(self) -> dict[str, Any]:
        """:meth:`hf_kwargs` plus ``num_pad_tokens`` when the row ends in padding (the collator's boundary keys)."""
        kwargs = self.hf_kwargs()
        if self.num_pad_tokens:
            kwargs[NUM_PAD_TOKENS] = self.num_pad_tokens
        return kwargs

    # ---------------------------------------------------------- derived views
    def view(self, key: Hashable, build: Callable[[], View]) -> View:
        """The view of these boundaries named ``key``, built by ``build()`` on first use and kept on this object.

        Views hold whatever a kernel derives from the boundaries (index tensors on this object's device,
        masks); each is built once per object, so the layers of one forward pass share it. Built outside
        ``torch.inference_mode`` (a view first built there would be an inference tensor no later training call
        could save for its backward).
        """
        if key not in self._views:
            with torch.inference_mode(False):
                self._views[key] = build()
        return self._views[key]

    def chunk_layout(self, chunk_size: int) -> ChunkLayout:
        """Every segment cut into chunks of ``chunk_size`` tokens, for document-parallel chunked scans."""
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            _fail("chunk_size", "a positive int", repr(chunk_size))
        return self.view(("chunk_layout", chunk_size),
                         lambda: build_chunk_layout(self.segment_lengths, chunk_size, self.device))

    def bucket_layout(self) -> BucketLayout:
        """The segments grouped into padded buckets of similar length, for dense per-document attention."""
        return self.view("bucket_layout", lambda: build_bucket_layout(self.segment_lengths, self.device))

    def kernel_chunk_index(self, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chunk_indices [num_chunks, 2] int32 on device, cu_seqlens_cpu [S + 1] int64)`` for fla's kernels."""
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            _fail("chunk_size", "a positive int", repr(chunk_size))
        return self.view(("kernel_chunk_index", chunk_size),
                         lambda: build_kernel_chunk_index(self.segment_lengths, chunk_size, self.device))
