"""The harness on vision-language models (docs/api.md §3b): packed rows of image, video and text documents.

:func:`~hybrid_pack.testing.check_isolation` on a model whose config names vision tokens (``image_token_id`` and
a ``vision_config``) also builds processor-style samples itself (placeholder runs, ``mm_token_type_ids``, random
pixel values of valid grid sizes, text tokens drawn below the vision token ids), packs them with
:class:`~hybrid_pack.PackingCollator` and the model's position rule (M-RoPE by the model's own ``get_rope_index``),
and makes the text layouts' three checks per document:

* packed against alone: each document's outputs in the packed row against the document packed by itself (its own
  pixel values, grids and positions);
* perturbation: new text tokens and pixel values in one document move no other document's outputs;
* gradients: one document's outputs have exactly zero gradient on other documents' input embeddings and pixel
  values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.collate import PackingCollator
from hybrid_pack.errors import InputError, UnsupportedModelError
from hybrid_pack.isolation import leaked_gradient, relative_error
from hybrid_pack.multimodal import PositionIdsFn
from hybrid_pack.schema import (
    IMAGE_GRID_THW,
    INPUT_IDS,
    LABELS,
    MM_TOKEN_TYPE_IDS,
    PIXEL_VALUES,
    PIXEL_VALUES_VIDEOS,
    VIDEO_GRID_THW,
)
from hybrid_pack.testing.report import DocumentResult, LayoutResult

__all__ = ["VisionLayout", "check_vision_layout", "text_vocab_size", "vision_config", "vision_layouts", "vision_sample",
           "vision_position_rule", "vision_samples"]

_VISION_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_PIXEL_KEYS = ((PIXEL_VALUES, IMAGE_GRID_THW), (PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW))

Segment = tuple[str, Any]
"""``("text", n)``: n text tokens; ``("image", (t, h, w))`` / ``("video", (t, h, w))``: one image / video grid."""


def vision_config(model: torch.nn.Module) -> Any | None:
    """The model's config when it is a vision-language model whose samples the harness can build (it names
    ``image_token_id``, ``vision_start_token_id``, ``vision_end_token_id`` and a ``vision_config`` with
    ``spatial_merge_size``, ``patch_size``, ``temporal_patch_size``, ``in_channels``), else None."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None or any(getattr(config, name, None) is None for name in _VISION_IDS[:1] + _VISION_IDS[2:]):
        return None
    if any(getattr(vision, name, None) is None for name in ("spatial_merge_size", "patch_size",
                                                            "temporal_patch_size", "in_channels")):
        return None
    return config


def text_vocab_size(config: Any) -> int:
    """Text tokens are drawn below this: the smallest vision token id."""
    return min(getattr(config, name) for name in _VISION_IDS if getattr(config, name, None) is not None)


def vision_position_rule(model: torch.nn.Module, given: PositionIdsFn | None) -> PositionIdsFn | None:
    """``given``, else the model's M-RoPE rule
    (:func:`~hybrid_pack.mrope.mrope_position_ids`), else None (restarting 1-D positions)."""
    if given is not None:
        return given
    from hybrid_pack.mrope import mrope_position_ids

    try:
        return mrope_position_ids(model)
    except UnsupportedModelError:
        return None


@dataclass(frozen=True)
class VisionLayout:
    """A named packed row of vision-language documents, each a list of segments (:data:`Segment`), then a trailing
    padding segment up to a multiple of ``pad_to_multiple_of`` (None: no padding)."""

    name: str
    documents: tuple[tuple[Segment, ...], ...]
    pad_to_multiple_of: int | None = None


def vision_layouts(config: Any) -> list[VisionLayout]:
    """Images at the row start, an image document across the middle (longer than a 64-token chunk, a video in it
    when the model takes videos), a text-only document between two image documents; one-token documents and a
    trailing padding segment among them. Grid sides are multiples of the merge size."""
    m = config.vision_config.spatial_merge_size
    video = getattr(config, "video_token_id", None) is not None
    middle = [("text", 3), ("image", (1, 2 * m, 2 * m)), ("text", 40), ("image", (1, m, 2 * m)), ("text", 5)]
    if video:
        middle += [("video", (2, m, m)), ("text", 2)]
    return [
        VisionLayout("images at the row start", ((("image", (1, m, m)), ("text", 5)),
                                                  (("image", (1, 2 * m, m)), ("text", 1)), (("text", 1),))),
        VisionLayout("an image document across the middle", ((("text", 7),), tuple(middle), (("text", 1),),
                                                              (("text", 4),)), pad_to_multiple_of=16),
        VisionLayout("a text-only document between two image documents",
                     ((("text", 2), ("image", (1, m, m)), ("text", 3)), (("text", 9),),
                      (("video", (2, m, m)) if video else ("image", (1, m, 2 * m)), ("text", 1))),
                     pad_to_multiple_of=8),
    ]


def vision_sample(config: Any, segments: Sequence[tuple[str, Any]], generator: torch.Generator,
                  ) -> dict[str, torch.Tensor]:
    """One processor-style sample of ``segments`` (``("text", n)``, ``("image", (t, h, w))``, ``("video", (t, h,
    w))``): ``input_ids`` ``[L]`` int64 and, with images (videos), ``mm_token_type_ids`` ``[L]`` int64 and
    ``pixel_values`` ``[P, C]`` float32 with ``image_grid_thw`` ``[n, 3]`` (videos likewise). An image is
    ``vision_start``, ``t * h * w / merge**2`` image tokens, ``vision_end``; a video one such run of
    ``h * w / merge**2`` video tokens per frame, a text token between frames. Text tokens are drawn below the vision
    token ids."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    channels = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    vocab = text_vocab_size(config)
    ids: list[int] = []
    types: list[int] = []
    grids: dict[str, list[list[int]]] = {"image": [], "video": []}
    for kind, value in segments:
        if kind == "text":
            ids += torch.randint(0, vocab, (value,), generator=generator).tolist()
            types += [0] * value
            continue
        t, h, w = value
        grids[kind].append([t, h, w])
        token, type_id = (config.image_token_id, 1) if kind == "image" else (config.video_token_id, 2)
        frames = [t * h * w // merge**2] if kind == "image" else [h * w // merge**2] * t
        for frame, count in enumerate(frames):
            prefix = [config.vision_start_token_id]
            if frame:
                prefix = [int(torch.randint(0, vocab, (1,), generator=generator)), *prefix]
            ids += prefix + [token] * count + [config.vision_end_token_id]
            types += [0] * len(prefix) + [type_id] * count + [0]
    sample = {INPUT_IDS: torch.tensor(ids)}
    if grids["image"] or grids["video"]:
        sample[MM_TOKEN_TYPE_IDS] = torch.tensor(types)
    for kind, (pixel_key, grid_key) in zip(("image", "video"), _PIXEL_KEYS, strict=True):
        if grids[kind]:
            grid = torch.tensor(grids[kind])
            sample[grid_key] = grid
            sample[pixel_key] = torch.randn(int(grid.prod(dim=1).sum()), channels, generator=generator)
    return sample


def vision_samples(config: Any, layout: VisionLayout, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """The processor-style samples of ``layout``, one :func:`vision_sample` per document."""
    return [vision_sample(config, segments, generator) for segments in layout.documents]


def _perturbed(sample: Mapping[str, torch.Tensor], vocab: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``sample`` with new text tokens (those below ``vocab``) and new pixel values; placeholders and grids kept."""
    ids = sample[INPUT_IDS]
    text = ids < vocab
    shift = torch.randint(1, vocab, ids.shape, generator=generator)
    out = {**sample, INPUT_IDS: torch.where(text, (ids + shift) % vocab, ids)}
    for pixel_key, _ in _PIXEL_KEYS:
        if pixel_key in sample:
            out[pixel_key] = torch.randn(sample[pixel_key].shape, generator=generator)
    return out


class _Packer:
    """Packs samples into the model's batch: the collator's keys without ``labels``, on the model's device and with
    pixel values in its dtype."""

    def __init__(self, position_ids_fn: PositionIdsFn | None, device: torch.device, dtype: torch.dtype) -> None:
        self.position_ids_fn, self.device, self.dtype = position_ids_fn, device, dtype

    def __call__(self, samples: Sequence[Mapping[str, Any]], pad_to_multiple_of: int | None = None) -> dict[str, Any]:
        batch = PackingCollator(position_ids_fn=self.position_ids_fn, pad_to_multiple_of=pad_to_multiple_of)(
            [dict(s) for s in samples])
        batch.pop(LABELS, None)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                value = value.to(self.device)
                batch[key] = value.to(self.dtype) if value.is_floating_point() else value
        return batch


def _pixel_spans(samples: Sequence[Mapping[str, Any]]) -> list[dict[str, slice]]:
    """Each document's rows of the packed ``pixel_values`` / ``pixel_values_videos``."""
    offsets = {key: 0 for key, _ in _PIXEL_KEYS}
    spans = []
    for sample in samples:
        span = {}
        for key, _ in _PIXEL_KEYS:
            rows = sample[key].shape[0] if key in sample else 0
            span[key] = slice(offsets[key], offsets[key] + rows)
            offsets[key] += rows
        spans.append(span)
    return spans


def check_vision_layout(model: torch.nn.Module, name: str, samples: Sequence[Mapping[str, Any]], *,
                        pad_to_multiple_of: int | None, position_ids_fn: PositionIdsFn | None, text_vocab: int,
                        generator: torch.Generator, device: torch.device, dtype: torch.dtype, grads: bool,
                        per_layer: bool, atol: float, grad_atol: float, run: Callable[..., torch.Tensor],
                        localise: Mapping[str, Callable[..., str | None]], step: Callable[[], None]) -> LayoutResult:
    """The three checks on one packed row of ``samples``.

    ``run(batch, embeds_leaf=None)`` returns the model's compared outputs ``[T, D]`` float (with ``embeds_leaf``, a
    list that receives the input embeddings ``[1, T, E]`` as a leaf tensor that takes gradient); ``localise`` holds the
    harness's ``forward(first_batch, second_batch, pick_first, pick_second)`` and ``backward(loss_fn, others)``
    localisations; ``step()`` advances the progress bar once per model run.
    """
    pack = _Packer(position_ids_fn, device, dtype)
    batch = pack(samples, pad_to_multiple_of)
    lengths = [int(torch.as_tensor(s[INPUT_IDS]).shape[0]) for s in samples]
    t_len = batch[INPUT_IDS].shape[1]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    result = LayoutResult(name, lengths, t_len - starts[-1], [DocumentResult(i, n) for i, n in enumerate(lengths)])
    positions = torch.arange(t_len, device=device)

    with torch.no_grad():
        packed = run(batch)
        step()
        for doc in result.documents:
            s, e = starts[doc.index], starts[doc.index + 1]
            doc.alone_diff = relative_error(packed[s:e], run(pack([samples[doc.index]])))
            step()
    for doc in result.documents:
        s, e = starts[doc.index], starts[doc.index + 1]
        others = (positions < s) | (positions >= e)
        moved_samples = list(samples)
        moved_samples[doc.index] = _perturbed(samples[doc.index], text_vocab, generator)
        moved_batch = pack(moved_samples, pad_to_multiple_of)
        with torch.no_grad():
            moved = run(moved_batch)
        doc.perturbation_leak = relative_error(moved[others], packed[others])
        step()
        if doc.perturbation_leak > atol and result.first_leaking_module is None and per_layer:
            result.first_leaking_module = localise["forward"](batch, moved_batch, lambda t, m=others: t[0, m],
                                                              lambda t, m=others: t[0, m])
            result.leak_kind = "forward"

    mismatched = [d for d in result.documents if not d.alone_diff <= atol]
    if mismatched and result.first_leaking_module is None and per_layer:
        doc = max(mismatched, key=lambda d: d.length)
        s, e = starts[doc.index], starts[doc.index + 1]
        result.first_leaking_module = localise["forward"](batch, pack([samples[doc.index]]), lambda t: t[0, s:e],
                                                          lambda t: t[0])
        result.leak_kind = "packed differs from alone"

    if grads:
        leaves = {key: batch[key].detach().requires_grad_(True) for key, _ in _PIXEL_KEYS if key in batch}
        grad_batch = {**batch, **leaves}
        embeds: list[torch.Tensor] = []
        outputs = run(grad_batch, embeds_leaf=embeds)
        step()
        weights = torch.randn(outputs.shape, generator=generator).to(device)
        spans = _pixel_spans(samples)
        for doc in result.documents:
            s, e = starts[doc.index], starts[doc.index + 1]
            inputs = [embeds[0], *leaves.values()]
            found = torch.autograd.grad((outputs[s:e] * weights[s:e]).sum(), inputs, retain_graph=True,
                                        allow_unused=True)
            leaks = [leaked_gradient(found[0], slice(s, e), dim=1)]
            leaks += [leaked_gradient(g, spans[doc.index][key]) for key, g in zip(leaves, found[1:], strict=True)
                      if g is not None]
            doc.gradient_leak = max(leaks)
            step()
            if doc.gradient_leak > grad_atol and result.first_leaking_module is None and per_layer:

                def loss_of_doc(s: int = s, e: int = e) -> torch.Tensor:
                    return (run({**batch, **{k: v.detach().requires_grad_(True) for k, v in leaves.items()}},
                                embeds_leaf=[])[s:e] * weights[s:e]).sum()

                result.first_leaking_module = localise["backward"](loss_of_doc, (positions < s) | (positions >= e))
                result.leak_kind = "backward"
    result.ok = all(d.alone_diff <= atol and (d.perturbation_leak or 0.0) <= atol
                    and (d.gradient_leak or 0.0) <= grad_atol for d in result.documents)
    return result


def given_vision_documents(documents: Sequence[Any]) -> list[dict[str, Any]] | None:
    """``documents`` as samples when any is a dict (a processor's output per sample), else None (token-id lists)."""
    if not any(isinstance(d, Mapping) for d in documents):
        return None
    samples = []
    for i, document in enumerate(documents):
        if not isinstance(document, Mapping):
            document = {INPUT_IDS: document}
        if INPUT_IDS not in document or len(document[INPUT_IDS]) == 0:
            raise InputError(f"documents[{i}].{INPUT_IDS}: expected a non-empty sequence of token ids")
        samples.append({key: torch.as_tensor(value) for key, value in document.items() if value is not None})
    return samples
