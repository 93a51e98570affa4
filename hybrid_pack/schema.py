"""The packed batch: its keys, their types, and which keys each consumer reads (docs/api.md §3).

Every key of the batch :class:`~hybrid_pack.PackingCollator` builds is spelled here once; the
rest of the package imports the names. A packed batch is one row of ``T`` tokens holding ``N``
documents (plus at most one trailing padding segment, which counts as a segment of its own).
"""

from __future__ import annotations

from typing import TypedDict

import torch

__all__ = [
    "IGNORE_INDEX", "INPUT_IDS", "LABELS", "POSITION_IDS", "SEQ_IDX", "CU_SEQ_LENS_Q", "CU_SEQ_LENS_K",
    "MAX_LENGTH_Q", "MAX_LENGTH_K", "NUM_PAD_TOKENS", "RESPONSE_MASK", "TOOL_MASK", "ADVANTAGES", "OLD_LOGPROBS",
    "SAMPLE_INDEX", "INPUTS_EMBEDS", "ATTENTION_MASK", "BOUNDARIES", "NUM_ITEMS_IN_BATCH", "SHIFT_LABELS",
    "HOST_BOUNDARIES",
    "PackedBatch",
    "BOUNDARY_KEYS", "PRIMARY_BOUNDARY_KEYS", "SECONDARY_BOUNDARY_KEYS", "COLLATED_KEYS", "DEFAULT_EXTRA_TOKEN_KEYS",
    "FLOAT_TOKEN_KEYS", "ROLLOUT_TOKEN_KEYS", "CACHE_KEYS", "USE_CACHE",
    "MM_TOKEN_TYPE_IDS", "PIXEL_VALUES", "IMAGE_GRID_THW", "PIXEL_VALUES_VIDEOS", "VIDEO_GRID_THW",
]

IGNORE_INDEX = -100
"""Label value the loss ignores (the ``torch.nn.CrossEntropyLoss`` default)."""

# --- keys of the collated batch ---------------------------------------------------------------
INPUT_IDS = "input_ids"
LABELS = "labels"
POSITION_IDS = "position_ids"
SEQ_IDX = "seq_idx"
CU_SEQ_LENS_Q = "cu_seq_lens_q"
CU_SEQ_LENS_K = "cu_seq_lens_k"
MAX_LENGTH_Q = "max_length_q"
MAX_LENGTH_K = "max_length_k"
NUM_PAD_TOKENS = "num_pad_tokens"
HOST_BOUNDARIES = "host_boundaries"
"""The collator's segment lengths on the host (a ``HostBoundaries`` of Python ints; in the static form a
``StaticHostBoundaries`` of CPU tensors): with it the model builds its boundaries, and a kernel's compiled node its
layout, without reading a device value (docs/api.md §9, §9b). Only valid for the tensors it was collated with."""

# --- per-token extras (RL) ----------------------------------------------------------------------
RESPONSE_MASK = "response_mask"
TOOL_MASK = "tool_mask"
ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
SAMPLE_INDEX = "sample_index"

# --- model call keywords that are not batch keys ------------------------------------------------
INPUTS_EMBEDS = "inputs_embeds"
ATTENTION_MASK = "attention_mask"
BOUNDARIES = "boundaries"
NUM_ITEMS_IN_BATCH = "num_items_in_batch"
SHIFT_LABELS = "shift_labels"
"""Labels already shifted (the target of position t at t), as a context-parallel shard carries them."""
USE_CACHE = "use_cache"
# --- keys of a vision-language sample (§3b): packed by the collator when a sample carries them -------------------
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"
PIXEL_VALUES_VIDEOS = "pixel_values_videos"
VIDEO_GRID_THW = "video_grid_thw"
CACHE_KEYS = ("past_key_values", "cache_params", "cache")
"""Model keywords carrying a KV / recurrent-state cache (refused on packed rows: a cache mixes documents).
transformers 5.24 renamed the first two to ``cache`` (the old names still accepted)."""


class _PackedBatchKeys(TypedDict):
    input_ids: torch.Tensor       # int64 [1, T]
    labels: torch.Tensor          # int64 [1, T], IGNORE_INDEX on every document's first token
    position_ids: torch.Tensor    # int64 [1, T], restarting at 0 per document
    seq_idx: torch.Tensor         # int32 [1, T], segment id per token
    cu_seq_lens_q: torch.Tensor   # int32 [S + 1]
    cu_seq_lens_k: torch.Tensor   # int32 [S + 1], the same values
    max_length_q: int             # longest segment
    max_length_k: int


class PackedBatch(_PackedBatchKeys, total=False):
    """The dict :class:`~hybrid_pack.PackingCollator` returns; the optional keys are present when given."""

    num_pad_tokens: int           # tokens of the trailing padding segment (absent means 0; 0-d tensor if static)
    host_boundaries: object       # HostBoundaries (Python ints); StaticHostBoundaries (CPU tensors) if static
    response_mask: torch.Tensor   # int64 [1, T]
    tool_mask: torch.Tensor       # int64 [1, T]
    advantages: torch.Tensor      # float32 [1, T]
    old_logprobs: torch.Tensor    # float32 [1, T]
    sample_index: torch.Tensor    # int64 [1, T], -1 on padding (pack_rollouts)


# --- key groups ---------------------------------------------------------------------------------
PRIMARY_BOUNDARY_KEYS = (CU_SEQ_LENS_Q, SEQ_IDX, POSITION_IDS)
"""Each of these alone says where the documents start (read in this order of preference)."""

SECONDARY_BOUNDARY_KEYS = (CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, NUM_PAD_TOKENS)
"""Keys that only restate or complete the boundaries; meaningless without a primary key."""

BOUNDARY_KEYS = PRIMARY_BOUNDARY_KEYS + SECONDARY_BOUNDARY_KEYS
"""Every key that describes the documents of a packed row."""

COLLATED_KEYS = frozenset({INPUT_IDS, LABELS, HOST_BOUNDARIES, *BOUNDARY_KEYS})
"""Keys the collator builds itself (an extra per-token key may not take one of these names)."""

DEFAULT_EXTRA_TOKEN_KEYS = (RESPONSE_MASK, TOOL_MASK, ADVANTAGES, OLD_LOGPROBS)
"""Per-token keys the collator concatenates by default when the examples carry them."""

FLOAT_TOKEN_KEYS = frozenset({ADVANTAGES, OLD_LOGPROBS})
"""Extra per-token keys that are always float32; other extra keys are int64 unless given as floats."""

ROLLOUT_TOKEN_KEYS = (*DEFAULT_EXTRA_TOKEN_KEYS, SAMPLE_INDEX)
"""Per-token keys :func:`~hybrid_pack.pack_rollouts` adds to each batch."""
