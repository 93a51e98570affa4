"""TRL's ``GRPOTrainer`` with every log-probability forward on packed rows: :class:`PackedGRPOTrainer`.

One line changes in a TRL script::

    trainer = PackedGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset)                  # was GRPOTrainer(...)

``GRPOTrainer`` scores its completions (the policy's log-probabilities in the loss, the old policy's and the
reference model's) on a padded batch ``[B, P + C]``: prompts left-padded, completions right-padded; every padded
token costs a forward, and every kernel must honour the padding mask. :class:`PackedGRPOTrainer` overrides one
method, ``_get_per_token_logps_and_entropies`` (and wraps three to carry each generated sequence's real lengths,
taken on the host from the token lists, with the batch): it strips the padding (by those lengths), packs each
micro-batch's real prompt + completion tokens with :func:`~hybrid_pack.packing.pack_rollouts` into rows of at most
``packing_capacity`` tokens (default: one row), runs TRL's own fused LM head on each row (same temperature, same
float32 log-softmax kernel), and scatters the log-probabilities (and entropies) back into TRL's ``[B, C]`` layout,
zero where TRL's are zero. Generation, rewards, advantages, the loss and the optimizer step are TRL's, untouched.
Under ``torch.distributed`` the ranks agree on the row count of each call and pad with padding rows, so every rank
makes as many forwards (FSDP2 and ZeRO-3 gather parameters per forward). With ``batch_invariant=True`` every row is
padded to exactly ``packing_capacity`` tokens and every step runs inside :func:`hybrid_pack.batch_invariant`, so a
sequence's log-probabilities are bitwise the same whatever it is packed with (docs/rl.md, "On-policy numerics").
:class:`PackedLogProbs` holds the override; TRL's ``RLOOTrainer`` has the same method (:mod:`.trl_rloo`).

The overridden method is private, so the TRL releases it was tested against are pinned (:data:`TESTED_TRL`);
the trainer refuses any other release at construction rather than risk a silent mismatch.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.distributed import agree_max, distributed
from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.trainer import (
    BatchInvariantSteps,
    ResumesRenamedWeights,
    SettlesBackendsAfterFirstStep,
    check_batch_invariant,
    refuse_neftune,
)
from hybrid_pack.packing.plan import plan_packs
from hybrid_pack.packing.rollouts import pack_rollouts
from hybrid_pack.schema import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    HOST_BOUNDARIES,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_PAD_TOKENS,
    POSITION_IDS,
    RESPONSE_MASK,
    SAMPLE_INDEX,
    SEQ_IDX,
)

try:
    import accelerate  # noqa: F401  (imported first: trl's lazy imports would wrap a missing one in a RuntimeError)
    import transformers
    import trl
    from trl import GRPOTrainer
    from trl.extras.profiling import profiling_decorator
except ImportError as err:
    raise MissingExtraError("PackedGRPOTrainer", "trl", err) from err

__all__ = ["PackedGRPOTrainer", "PackedLogProbs", "TESTED_TRL", "refuse_untested_trl"]

TESTED_TRL = ((1, 16), (1, 17))
"""``[lower, upper)`` of the TRL releases :class:`PackedGRPOTrainer` is tested with (1.16.x): it overrides
``GRPOTrainer._get_per_token_logps_and_entropies``, a private method, and refuses any other release."""

_OVERRIDDEN = "_get_per_token_logps_and_entropies"
_EXPECTED_PARAMETERS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                        "compute_entropy", "compute_aux_loss")
"""The leading parameters of TRL 1.16's method, in order (the rest are multimodal inputs, refused here)."""
_WRAPPED = ("_generate", "_generate_and_score_completions", "_compute_loss")
"""TRL's methods wrapped to carry the generated sequences' lengths (:data:`REAL_LENGTHS`)."""

_MODEL_KEYS = (POSITION_IDS, SEQ_IDX, CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, NUM_PAD_TOKENS,
               HOST_BOUNDARIES)
"""The keys of a :func:`pack_rollouts` batch that the patched model takes besides its tokens (the RL fields stay
out; ``host_boundaries``: the model reads no boundary tensor, docs/api.md §9b)."""

REAL_LENGTHS = "hybrid_pack_real_lengths"
"""The entry of TRL's generation batch holding each sequence's ``(prompt, completion)`` real token counts, taken on
the host from the generated token lists: a list, which TRL shuffles and splits with the batch's tensors."""


def refuse_untested_trl(trainer: str, relies_on: str) -> None:
    """Raise unless the installed TRL is one of :data:`TESTED_TRL` (``relies_on``: the TRL internal used)."""
    version = trl.__version__
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        major, minor = -1, -1
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TRL
    if not (lo_major, lo_minor) <= (major, minor) < (hi_major, hi_minor):
        raise InputError(f"trl: {trainer} relies on {relies_on}, internal to TRL, and is tested with trl "
                         f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}; found trl {version}. Install the tested "
                         "release: pip install 'hybrid_pack[trl]' (trl==1.16.0)")


def _check_trl_version(trainer: str, base: type) -> None:
    relies_on = f"{base.__name__}.{_OVERRIDDEN} (overridden)"
    refuse_untested_trl(trainer, relies_on)
    parameters = tuple(inspect.signature(getattr(base, _OVERRIDDEN, None) or (lambda: None)).parameters)
    if parameters[:len(_EXPECTED_PARAMETERS)] != _EXPECTED_PARAMETERS:
        raise InputError(f"trl: {trainer} relies on {relies_on}, whose parameters changed in this trl "
                         f"{trl.__version__}: {parameters}. Install the tested release: pip install 'hybrid_pack[trl]'")
    missing = [name for name in _WRAPPED if not callable(getattr(base, name, None))]
    if missing:
        raise InputError(f"trl: {trainer} wraps {base.__name__}.{', '.join(missing)}, missing in this trl "
                         f"{trl.__version__}. Install the tested release: pip install 'hybrid_pack[trl]'")


def _check_capacity(packing_capacity: Any) -> int | None:
    if packing_capacity is None:
        return None
    if isinstance(packing_capacity, bool) or not isinstance(packing_capacity, int) or packing_capacity < 1:
        raise InputError(f"packing_capacity: expected an int >= 1 (tokens per packed row) or None (each micro-batch "
                         f"in one row); got {packing_capacity!r}")
    return packing_capacity


def _check_max_documents(max_documents: Any) -> int | None:
    if max_documents is not None and (isinstance(max_documents, bool) or not isinstance(max_documents, int)
                                      or max_documents < 1):
        raise InputError(f"max_documents: expected an int >= 1 (sequences per packed row) or None (no limit); got "
                         f"{max_documents!r}")
    return max_documents


def _hf_model(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """The Hugging Face model whose forward TRL's fused LM head replaced (inside DDP / DeepSpeed and PEFT)."""
    model = accelerator.unwrap_model(model)
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _load_balancing_loss(hf_model: torch.nn.Module, router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The MoE load-balancing loss over every token of the packed rows, as TRL's fused LM head computes it on
    one row (its ``num_experts`` lookup included)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    text_config = hf_model.config.get_text_config()
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if text_config.model_type == "gpt_oss" and (major, minor) < (5, 6):
        num_experts = hf_model.num_experts   # TRL's workaround for transformers' GptOssConfig (TRL #5754)
    else:
        num_experts = text_config.num_experts
    return load_balancing_loss_func(router_logits, num_experts, text_config.num_experts_per_tok, None)


@dataclasses.dataclass
class _PackedChunk:
    """One TRL chunk of ``size`` sequences on packed rows, formed on the host from the sequences' lengths: each
    row's boundary keys (``rows``), where each of its tokens is in the chunk's flat ``[size * width]`` ids
    (``tokens``, -1 on padding) and which are scored (``scored``), the positions of the fused head's output to read
    (``reads``: ``t - 1`` for token ``t``, the head shifts the labels) and where each read goes in the chunk's flat
    ``[size * logits_to_keep]`` layout (``targets``). No row: no real token."""

    size: int
    rows: list[dict[str, Any]]
    tokens: list[torch.Tensor]
    scored: list[torch.Tensor]
    reads: list[torch.Tensor]
    targets: list[torch.Tensor]


def _generated_lengths(prompt_ids: list[list[int]], completion_ids: list[list[int]], truncated_masked: bool,
                       ends: set[int]) -> list[tuple[int, int]]:
    """Each generated sequence's ``(prompt, completion)`` real token counts, as TRL's masks will have them: every
    listed token is real, and with ``mask_truncated_completions`` a completion not ending in one of ``ends`` (EOS
    or padding) has none."""
    return [(len(prompt), 0 if truncated_masked and (not completion or completion[-1] not in ends)
             else len(completion)) for prompt, completion in zip(prompt_ids, completion_ids, strict=True)]


def _lengths_fit(lengths: list[tuple[int, int]] | None, attention_mask: torch.Tensor, logits_to_keep: int) -> bool:
    """Whether host-side ``lengths`` can describe this call's mask ``[B, P + C]`` (one pair per row, within its
    prompt and completion widths); shapes only, no read."""
    prompt_width = attention_mask.shape[1] - logits_to_keep
    return (lengths is not None and len(lengths) == attention_mask.shape[0]
            and all(0 <= p <= prompt_width and 0 <= c <= logits_to_keep for p, c in lengths))


def _real_lengths(attention_mask: torch.Tensor, logits_to_keep: int) -> tuple[list[int], list[int]]:
    """Each sequence's real prompt and completion token counts read from the mask, in one device-to-host copy made
    before the forwards: the fallback where TRL's batch carries no :data:`REAL_LENGTHS` (docs/api.md §9b). TRL
    left-pads the prompts and right-pads the completions (a masked completion has none), so the counts say where
    every real token is; a mask of any other shape raises."""
    mask = attention_mask.bool()
    prompt_width = mask.shape[1] - logits_to_keep
    prompt, completion = mask[:, :prompt_width].sum(1), mask[:, prompt_width:].sum(1)
    columns = torch.arange(max(prompt_width, logits_to_keep), device=mask.device)
    expected = torch.cat([columns[:prompt_width] >= prompt_width - prompt[:, None],
                          columns[:logits_to_keep] < completion[:, None]], dim=1)
    misplaced = (mask != expected).any(1)
    prompt, completion, misplaced = torch.stack([prompt, completion, misplaced.long()]).tolist()
    if any(misplaced):
        raise InputError(f"attention_mask: expected TRL's layout, prompts left-padded and completions right-padded; "
                         f"sequence {misplaced.index(1)} has a real token after padding or padding between real "
                         f"tokens")
    return prompt, completion


def _agreed_row_count(local: int) -> int:
    """The most rows any rank runs in this log-probability call (one ``all_reduce`` MAX over the world, the
    trainer's group, under ``torch.distributed`` with more than one rank); ``local`` on one process."""
    return int(agree_max([local])[0]) if distributed() else local


def _padding_row(token_id: int, length: int = 2) -> dict[str, Any]:
    """A row ``[1, length]`` of the padding token: one document of 2 tokens whose second token is its only target,
    then a padding segment (a static row of ``length``). It runs every layer (and, under autograd, its backward)
    like any row and holds no real token."""
    labels = torch.full((1, length), IGNORE_INDEX, dtype=torch.long)
    labels[0, 1] = token_id
    boundaries = PackedBoundaries.from_document_lengths([2], num_pad_tokens=length - 2)
    return {INPUT_IDS: torch.full((1, length), token_id, dtype=torch.long), LABELS: labels,
            **boundaries.hf_kwargs(), HOST_BOUNDARIES: boundaries.host(),
            **({NUM_PAD_TOKENS: length - 2} if length > 2 else {})}


class PackedLogProbs:
    """TRL's ``_get_per_token_logps_and_entropies`` on packed rows, for a TRL trainer that has it with TRL 1.16's
    parameters (``GRPOTrainer``, ``RLOOTrainer``); mixed in before the trainer class, which :attr:`trl_trainer`
    names.

    Under ``torch.distributed`` every rank makes the same number of model forwards in each call: the row count is
    agreed across ranks first (one ``all_reduce`` MAX) and a rank with fewer rows runs padding rows (two padding
    tokens, their output discarded, tied to the result with weight 0 so the backward visits the same modules on
    every rank). Parameter gathering per forward (FSDP2, ZeRO-3), DDP's buffer broadcast and the packing guard's
    collectives then pair up across ranks whatever the local token counts; a chunk without a real token runs only
    padding rows, when other ranks run rows.

    With ``batch_invariant=True`` (a ``packing_capacity`` needed) every row, padding rows included, is a static row
    of exactly ``packing_capacity`` tokens (one trailing padding segment) of at most ``max_documents`` sequences,
    and every training step and every log-probability forward run inside :func:`hybrid_pack.batch_invariant`: a
    sequence's log-probabilities and entropies are bitwise equal to its own alone in such a row, whatever the
    packing.
    """

    trl_trainer: type
    """The TRL trainer class whose method is overridden (checked against :data:`TESTED_TRL` at construction)."""

    def __init__(self, *args: Any, packing_capacity: int | None = None, batch_invariant: bool = False,
                 max_documents: int | None = None, **kwargs: Any) -> None:
        _check_trl_version(type(self).__name__, self.trl_trainer)
        self.packing_capacity = _check_capacity(packing_capacity)
        self.max_documents = _check_max_documents(max_documents)
        super().__init__(*args, **kwargs)
        refuse_neftune(type(self).__name__, self.args)
        self.batch_invariant = check_batch_invariant(type(self).__name__, batch_invariant, self.args,
                                                     capacity=self.packing_capacity, capacity_name="packing_capacity",
                                                     models=(self.model, None if self.ref_model is None else
                                                             self.accelerator.unwrap_model(self.ref_model)))
        patch_model(self.model)
        if self.ref_model is not None:
            patch_model(self.accelerator.unwrap_model(self.ref_model))
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        self.padding_token_id = getattr(tokenizer, "pad_token_id", None) or 0
        self._generated: list[tuple[int, int]] | None = None   # this generation's lengths, while it is scored
        self._scored: list[tuple[int, int]] | None = None      # the loss's micro-batch's lengths, while it runs

    def _generate(self, prompts: list[Any]) -> tuple[Any, ...]:
        """TRL's generation; each sequence's real lengths are taken from its token lists on the host, for the
        scoring of this generation and (with the batch) for the loss."""
        generated = super()._generate(prompts)
        ends = {*self.eos_token_ids, self._tokenizer.pad_token_id}
        self._generated = _generated_lengths(generated[0], generated[1], self.mask_truncated_completions, ends)
        return generated

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        """TRL's batch, carrying :data:`REAL_LENGTHS` (the old policy's and the reference's log-probabilities,
        computed inside, use them)."""
        try:
            batch = super()._generate_and_score_completions(inputs)
            if self._generated is not None:
                batch[REAL_LENGTHS] = self._generated
            return batch
        finally:
            self._generated = None

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """TRL's loss; the policy's log-probabilities use the micro-batch's :data:`REAL_LENGTHS`."""
        self._scored = inputs.get(REAL_LENGTHS)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._scored = None

    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's log-probabilities ``[B, logits_to_keep]`` of the completion tokens (and entropies, and the MoE
        auxiliary loss, when asked), computed on packed rows of the real tokens: per chunk of ``batch_size``
        sequences (TRL's chunks) by default; with ``packing_capacity``, rows of at most that many tokens over all
        of the batch (TRL's chunks kept only for the MoE auxiliary loss). As many forwards on every rank."""
        given = sorted(name for name, value in multimodal.items() if value is not None)
        if given:
            raise InputError(f"{', '.join(given)}: {type(self).__name__} packs text-only batches; multimodal inputs "
                             f"are not supported (use trl.{self.trl_trainer.__name__} for vision-language models)")
        batch_size = batch_size or input_ids.size(0)
        if self.packing_capacity is not None and not compute_aux_loss:
            # The token budget, not TRL's count of sequences, forms the rows: the whole batch TRL passes (all the
            # generations, for the old policy's and the reference's log-probabilities) packed into rows of
            # packing_capacity tokens. A MoE auxiliary loss keeps TRL's chunks, over which TRL averages it.
            batch_size = input_ids.size(0)
        known = self._generated if self._generated is not None else self._scored
        if _lengths_fit(known, attention_mask, logits_to_keep):
            prompt_lengths, completion_lengths = [p for p, _ in known], [c for _, c in known]
        else:
            prompt_lengths, completion_lengths = _real_lengths(attention_mask, logits_to_keep)
        starts = range(0, input_ids.size(0), batch_size)
        chunks = [self._pack_chunk(prompt_lengths[start:start + batch_size],
                                   completion_lengths[start:start + batch_size], input_ids.size(1), logits_to_keep)
                  for start in starts]
        local_rows = sum(len(chunk.rows) for chunk in chunks)
        padding_rows = _agreed_row_count(local_rows) - local_rows    # agreed before any forward
        all_logps, all_entropies, all_aux_losses = [], [], []
        for start, chunk in zip(starts, chunks, strict=True):
            logps, entropies, aux_loss = self._score_chunk(model, chunk, input_ids[start:start + batch_size],
                                                           logits_to_keep, compute_entropy, compute_aux_loss)
            all_logps.append(logps)
            all_entropies.append(entropies)
            all_aux_losses.append(aux_loss)
        logps = torch.cat(all_logps, dim=0)
        if padding_rows:
            logps = logps + self._run_padding_rows(model, padding_rows, input_ids.device)
        entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
        aux_loss = torch.stack(all_aux_losses).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    def _pack_chunk(self, prompt_lengths: list[int], completion_lengths: list[int], width: int,
                    logits_to_keep: int) -> _PackedChunk:
        """One TRL chunk packed from its sequences' real lengths (host work only: no tensor read, no forward, no
        collective). A token is named by its index in the chunk's flat ``[rows * width]`` ids, which
        :meth:`_score_chunk` gathers on the device."""
        prompt_width = width - logits_to_keep
        prompts, responses, samples, scored_counts = [], [], [], []
        for b, (prompt_length, completion_length) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
            first = b * width + prompt_width      # the flat index of the sequence's first completion column
            prompt = torch.arange(first - prompt_length, first)
            completion = torch.arange(first, first + completion_length)
            if completion_length == 0:
                if prompt_length == 0:
                    continue            # no real token: nothing to score, nothing for the MoE auxiliary loss
                # A masked completion (truncated with mask_truncated_completions): TRL still runs its prompt,
                # which counts in the MoE auxiliary loss. pack_rollouts wants a response: lend it the last prompt
                # token (it is never scored).
                prompt, completion = prompt[:-1], prompt[-1:]
            prompts.append(prompt)
            responses.append(completion)
            samples.append(b)
            scored_counts.append(completion_length)
        chunk = _PackedChunk(size=len(prompt_lengths), rows=[], tokens=[], scored=[], reads=[], targets=[])
        if not samples:
            return chunk

        lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
        capacity = self.packing_capacity or sum(lengths)
        if max(lengths) > capacity:
            i = max(range(len(lengths)), key=lengths.__getitem__)
            raise InputError(f"packing_capacity: sequence {samples[i]} of the micro-batch has {lengths[i]} real "
                             f"prompt + completion tokens, more than packing_capacity={capacity}; raise "
                             "packing_capacity to at least max_prompt_length + max_completion_length")
        sample_rows = torch.tensor(samples, dtype=torch.long)
        packed_prompt_lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        counts = torch.tensor(scored_counts, dtype=torch.long)
        for batch, sample in self._packs(prompts, responses, lengths, capacity):
            local = sample.clamp(min=0)
            positions = batch[POSITION_IDS][0].long()
            # Score exactly the real completion tokens (never a document's first token: no cross-document
            # target), as TRL's labels do.
            column = positions - packed_prompt_lengths[local]
            scored = (sample >= 0) & (batch[RESPONSE_MASK][0] == 1) & (positions > 0) & (column < counts[local])
            where = scored.nonzero().flatten()
            chunk.targets.append(sample_rows[local[where]] * logits_to_keep + column[where])
            chunk.reads.append(where - 1)
            chunk.tokens.append(torch.where(sample >= 0, batch[INPUT_IDS][0], -1))
            chunk.scored.append(scored)
            chunk.rows.append({key: value for key, value in batch.items() if key in _MODEL_KEYS})
        return chunk

    def _packs(self, prompts: list[torch.Tensor], responses: list[torch.Tensor], lengths: list[int], capacity: int,
               ) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """The chunk's packed rows, each with the chunk's index of the sequence of every token ``[T]`` (-1:
        padding). With ``max_documents`` or ``batch_invariant``: rows planned with both limits, a static row of
        ``capacity`` tokens each in the mode."""
        if self.max_documents is None and not self.batch_invariant:
            return [(batch, batch[SAMPLE_INDEX][0]) for batch in pack_rollouts(prompts, responses, capacity)]
        plan = plan_packs(lengths, capacity, max_documents=self.max_documents)
        rows = []
        for first, last in zip(plan.pack_offsets[:-1].tolist(), plan.pack_offsets[1:].tolist(), strict=True):
            members = plan.example_index[first:last].tolist()
            (batch,) = pack_rollouts([prompts[i] for i in members], [responses[i] for i in members],
                                     capacity, pad_to_multiple_of=capacity if self.batch_invariant else None)
            local = batch[SAMPLE_INDEX][0]
            rows.append((batch, torch.where(local >= 0, torch.tensor(members)[local.clamp(min=0)], -1)))
        return rows

    def _score_chunk(self, model: torch.nn.Module, chunk: _PackedChunk, input_ids: torch.Tensor, logits_to_keep: int,
                     compute_entropy: bool, compute_aux_loss: bool,
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Run the fused LM head on each row of ``chunk`` (its tokens gathered from the chunk's ``input_ids`` on
        their device); its values scattered back to TRL's ``[size, C]``."""
        device = input_ids.device
        if not chunk.rows:
            return self._empty(chunk.size, logits_to_keep, device, compute_entropy, compute_aux_loss)
        hf_model = _hf_model(model, self.accelerator)
        router_logits: list[tuple[torch.Tensor, ...]] = []
        hook = (hf_model.base_model.register_forward_hook(lambda _m, _a, out: router_logits.append(out.router_logits))
                if compute_aux_loss else None)
        logps, entropies = [], []
        try:
            flat_ids = input_ids.reshape(-1)
            for row, tokens, scored, read in zip(chunk.rows, chunk.tokens, chunk.scored, chunk.reads, strict=True):
                tokens, scored = tokens.to(device), scored.to(device)
                ids = torch.where(tokens >= 0, flat_ids[tokens.clamp(min=0)], 0)   # the padding token: 0
                row = {**row, INPUT_IDS: ids[None], LABELS: torch.where(scored, ids, IGNORE_INDEX)[None]}
                outputs = self._fused_forward(model, row, device, output_router_logits=compute_aux_loss)
                if compute_aux_loss and row.get(NUM_PAD_TOKENS):   # a static row: its padding is not TRL's batch
                    real = row[INPUT_IDS].shape[1] - row[NUM_PAD_TOKENS]
                    router_logits[-1] = tuple(layer[:real] for layer in router_logits[-1])
                read = read.to(device)
                logps.append(outputs.log_probs[0, read])
                if compute_entropy:
                    entropies.append(outputs.entropy[0, read])
        finally:
            if hook is not None:
                hook.remove()

        target = torch.cat(chunk.targets).to(device)
        logps = self._scatter(torch.cat(logps), target, chunk.size, logits_to_keep)
        entropies = (self._scatter(torch.cat(entropies), target, chunk.size, logits_to_keep) if compute_entropy
                     else None)
        aux_loss = None
        if compute_aux_loss:
            per_layer = tuple(torch.cat(layer, dim=0) for layer in zip(*router_logits, strict=True))
            aux_loss = _load_balancing_loss(hf_model, per_layer)
        return logps, entropies, aux_loss

    def _fused_forward(self, model: torch.nn.Module, row: dict[str, Any], device: torch.device, *,
                       output_router_logits: bool = False) -> Any:
        """``model(**row, fused_lm_head=True)`` under the accelerator's autocast (and inside
        :func:`hybrid_pack.batch_invariant` in the mode), ``row`` moved to ``device``."""
        inputs = {key: (value.to(device) if isinstance(value, torch.Tensor) else value) for key, value in row.items()}
        if output_router_logits:
            inputs["output_router_logits"] = True
        with self.accelerator.autocast(), self._mode():
            return model(**inputs, fused_lm_head=True)

    def _run_padding_rows(self, model: torch.nn.Module, count: int, device: torch.device) -> torch.Tensor:
        """``count`` forwards of a padding row; their log-probabilities times 0 (a 0-d tensor: adding it changes
        no value, and under autograd each padding row's backward runs with the real rows')."""
        tie = torch.zeros((), device=device)
        for _ in range(count):
            row = _padding_row(self.padding_token_id, self.packing_capacity if self.batch_invariant else 2)
            tie = tie + self._fused_forward(model, row, device).log_probs.sum() * 0
        return tie

    @staticmethod
    def _scatter(values: torch.Tensor, target: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
        """``[rows, columns]``, ``values`` at the flat indices ``target``, 0 elsewhere (differentiable)."""
        return values.new_zeros(rows * columns).index_put((target,), values).view(rows, columns)

    @staticmethod
    def _empty(rows: int, logits_to_keep: int, device: torch.device, compute_entropy: bool, compute_aux_loss: bool,
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """A chunk without a single real token: zeros, as TRL's head returns on an all-padding batch."""
        zeros = torch.zeros(rows, logits_to_keep, device=device)
        aux = torch.zeros((), device=device) if compute_aux_loss else None
        return zeros, zeros.clone() if compute_entropy else None, aux


class PackedGRPOTrainer(PackedLogProbs, SettlesBackendsAfterFirstStep, BatchInvariantSteps, ResumesRenamedWeights,
                        GRPOTrainer):
    """``trl.GRPOTrainer`` computing every per-token log-probability on packed rows.

    Takes every argument of ``GRPOTrainer`` (and its ``GRPOConfig``). The model (and the reference model, if
    any) is patched with :func:`~hybrid_pack.integrations.transformers.patch_model` once TRL has wrapped it
    (PEFT) and given it its fused LM head. Only ``_get_per_token_logps_and_entropies`` is overridden (``_generate``,
    ``_generate_and_score_completions`` and ``_compute_loss`` are wrapped to carry the lengths): the
    policy's forward in the loss, the old policy's and the reference model's forwards run on packed rows of the
    micro-batch's real prompt + completion tokens; their results come back in TRL's ``[B, C]`` layout.
    Completion tokens TRL masks (padding; truncated completions with ``mask_truncated_completions``) get 0, as
    in TRL; TRL's ``tool_mask`` is applied by TRL's loss, as before (the log-probabilities of tool output are
    computed, then masked, exactly as TRL does). Every rank makes as many model forwards per call
    (:class:`PackedLogProbs`).

    Args:
        packing_capacity: tokens per packed row. Default (None): each micro-batch (TRL's chunk of
            ``per_device_train_batch_size`` sequences) in one row. With a capacity, the rows are formed by
            token budget, not by count: every sequence TRL scores in one call (all the generations for the old
            policy's and the reference's log-probabilities) is packed best-fit-decreasing into as many rows of
            at most ``packing_capacity`` tokens as it needs; a sequence longer than the capacity raises.
        batch_invariant: every row a static row of exactly ``packing_capacity`` tokens, every training step and
            log-probability forward inside :func:`hybrid_pack.batch_invariant` (:class:`PackedLogProbs`).
        max_documents: at most this many sequences per packed row (None: no limit).
        *args, **kwargs: as for ``trl.GRPOTrainer``.

    Raises:
        InputError: a TRL release other than :data:`TESTED_TRL`, a bad ``packing_capacity`` or ``max_documents``,
            ``batch_invariant`` without ``packing_capacity`` or with what the mode does not cover (torch_compile,
            context parallelism, gradient checkpointing off the CPU); during training,
            multimodal inputs (images, token type ids: text-only for now) or a sequence longer than
            ``packing_capacity``.
    """

    trl_trainer = GRPOTrainer
