"""pack_rollouts: every rollout once, per-token RL fields aligned with its tokens, tool outputs masked."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_pack import PackedBoundaries, pack_rollouts, packed_loss
from hybrid_pack.errors import InputError


def _rollouts(seed: int, num: int, *, per_token_advantages: bool = False):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 500, rng.integers(1, 30)).tolist() for _ in range(num)]
    responses = [rng.integers(0, 500, rng.integers(1, 40)).tolist() for _ in range(num)]
    tool_masks = [(rng.random(len(r)) < 0.3).astype(int).tolist() for r in responses]
    if per_token_advantages:
        advantages = [rng.normal(size=len(r)).astype(np.float32).tolist() for r in responses]
    else:
        advantages = rng.normal(size=num).astype(np.float32).tolist()
    old_logprobs = [(-rng.random(len(r))).astype(np.float32).tolist() for r in responses]
    return prompts, responses, tool_masks, advantages, old_logprobs


def _documents(batch):
    """Per-document slices of every per-token key of one batch (padding segment excluded)."""
    boundaries = PackedBoundaries.from_batch(batch)
    cu = boundaries.cu_seqlens.tolist()
    keys = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 2]
    return [{k: batch[k][0, a:b].tolist() for k in keys} for a, b in itertools.pairwise(cu)][:boundaries.num_docs]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num=st.integers(1, 40), capacity=st.integers(70, 200),
       per_token=st.booleans(), strategy=st.sampled_from(["bfd", "ffd", "first_fit", "knapsack"]))
def test_every_rollout_once_with_aligned_fields(seed, num, capacity, per_token, strategy):
    prompts, responses, tool_masks, advantages, old_logprobs = _rollouts(seed, num, per_token_advantages=per_token)
    batches = pack_rollouts(prompts, responses, capacity, tool_masks=tool_masks, advantages=advantages,
                            old_logprobs=old_logprobs, strategy=strategy)
    seen = []
    for batch in batches:
        assert batch["input_ids"].shape[1] <= capacity
        assert batch["response_mask"].dtype == torch.int64 and batch["advantages"].dtype == torch.float32
        for doc in _documents(batch):
            i = doc["sample_index"][0]
            seen.append(i)
            p, r = len(prompts[i]), len(responses[i])
            assert doc["sample_index"] == [i] * (p + r)
            assert doc["input_ids"] == prompts[i] + responses[i]
            assert doc["response_mask"] == [0] * p + [1] * r
            assert doc["tool_mask"] == [0] * p + tool_masks[i]
            expected_adv = advantages[i] if per_token else [advantages[i]] * r
            assert doc["advantages"] == pytest.approx([0.0] * p + expected_adv)
            assert doc["old_logprobs"] == pytest.approx([0.0] * p + old_logprobs[i])
            policy = [0] * p + [1 - t for t in tool_masks[i]]
            expected_labels = [tok if keep else -100 for tok, keep in zip(doc["input_ids"], policy)]
            expected_labels[0] = -100
            assert doc["labels"] == expected_labels
    assert sorted(seen) == list(range(num))


def test_padding_gets_sample_index_minus_one():
    prompts, responses, *_ = _rollouts(1, 10)
    for batch in pack_rollouts(prompts, responses, 128, pad_to_multiple_of=64):
        pad = batch.get("num_pad_tokens", 0)
        assert batch["input_ids"].shape[1] % 64 == 0
        if pad:
            assert (batch["sample_index"][0, -pad:] == -1).all()
            assert (batch["response_mask"][0, -pad:] == 0).all()
        assert (batch["sample_index"][0, :batch["input_ids"].shape[1] - pad] >= 0).all()


def test_policy_gradient_skips_prompt_and_tool_tokens():
    prompts, responses, tool_masks, advantages, old_logprobs = _rollouts(2, 6)
    (batch,) = pack_rollouts(prompts, responses, 4096, tool_masks=tool_masks, advantages=advantages,
                             old_logprobs=old_logprobs)
    logits = torch.randn(1, batch["input_ids"].shape[1], 500, requires_grad=True)
    loss = packed_loss(logits, batch["labels"], boundaries=PackedBoundaries.from_batch(batch))
    (grad,) = torch.autograd.grad(loss, logits)
    predicts_policy_token = torch.zeros_like(batch["labels"], dtype=torch.bool)
    predicts_policy_token[:, :-1] = (batch["response_mask"] * (1 - batch["tool_mask"]))[:, 1:].bool()
    predicts_policy_token[:, :-1] &= batch["seq_idx"][:, 1:] == batch["seq_idx"][:, :-1]
    assert (grad.abs().sum(-1)[predicts_policy_token] > 0).all()
    assert (grad.abs().sum(-1)[~predicts_policy_token] == 0).all()


def test_overflow_truncate_and_drop():
    prompts = [[1] * 10, [2] * 10, [3] * 5]
    responses = [[4] * 100, [5] * 5, [6] * 5]
    with pytest.raises(InputError, match="capacity"):
        pack_rollouts(prompts, responses, 64)
    with pytest.warns(UserWarning, match=r"1 of 3 rollouts are longer than capacity=64 \(samples 0\); "
                      r"overflow='truncate' cut their response tails$"):
        truncated = pack_rollouts(prompts, responses, 64, overflow="truncate",
                                  old_logprobs=[[0.5] * len(r) for r in responses])
    docs = [d for b in truncated for d in _documents(b)]
    long = next(d for d in docs if d["sample_index"][0] == 0)
    assert long["input_ids"] == [1] * 10 + [4] * 54 and long["old_logprobs"] == [0.0] * 10 + [0.5] * 54
    with pytest.warns(UserWarning, match=r"1 of 3 rollouts .* overflow='drop' left them out"):
        dropped = pack_rollouts(prompts, responses, 64, overflow="drop")
    assert sorted(d["sample_index"][0] for b in dropped for d in _documents(b)) == [1, 2]
    with pytest.warns(UserWarning, match=r"samples 0, 1\); .* 1 of them keep no response token"):
        pack_rollouts([[1] * 70, [2] * 60], [[3], [4] * 10], 64, overflow="truncate")


def test_tensor_inputs_and_default_masks():
    batches = pack_rollouts([torch.tensor([1, 2])], [torch.tensor([3, 4, 5])], 16)
    (doc,) = _documents(batches[0])
    assert doc["input_ids"] == [1, 2, 3, 4, 5] and doc["tool_mask"] == [0] * 5
    assert batches[0]["advantages"].tolist() == [[0.0] * 5] and batches[0]["old_logprobs"].tolist() == [[0.0] * 5]
    assert batches[0]["advantages"].dtype == torch.float32


@pytest.mark.parametrize("kwargs,field", [
    ({"responses": [[1]]}, "responses"),
    ({"tool_masks": [[0, 1], [1]]}, r"tool_masks\[0\]"),
    ({"tool_masks": [[0], [2, 0]]}, "tool_masks"),
    ({"advantages": [1.0, [1.0, 2.0]]}, r"advantages\[0\]"),
    ({"advantages": [1.0]}, "advantages"),
    ({"old_logprobs": [[0.1], [0.1]]}, r"old_logprobs\[1\]"),
    ({"overflow": "split"}, "overflow"),
    ({"responses": [[1], []]}, r"responses\[1\]"),
    ({"tool_masks": [[0], [0, 0.6]]}, r"tool_masks\[1\]: expected integers; got dtype float64"),  # was rounded to 0
    ({"prompts": [[7.5], [8]]}, r"prompts\[0\]: expected integers"),
    ({"prompts": [torch.tensor([[7, 9]]), [8]]}, r"prompts\[0\]: expected a flat sequence of values .* \[1, 2\]"),
])
def test_bad_inputs_name_the_field(kwargs, field):
    arguments = {"prompts": [[7], [8]], "responses": [[1], [2, 3]], "capacity": 16, **kwargs}
    with pytest.raises(InputError, match=field):
        pack_rollouts(**arguments)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), num=st.integers(1, 12), capacity=st.integers(24, 80))
def test_unpack_rollouts_returns_each_response_by_sample(seed, num, capacity):
    """Per-token values computed on the packs come back per rollout: its response tokens, nothing else."""
    from hybrid_pack.packing import unpack_rollouts

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 100, int(rng.integers(1, 10))).tolist() for _ in range(num)]
    responses = [rng.integers(1, 100, int(rng.integers(1, 12))).tolist() for _ in range(num)]
    batches = pack_rollouts(prompts, responses, capacity, pad_to_multiple_of=8)
    got = {}
    for batch in batches:
        values = batch["input_ids"].unsqueeze(-1).float() * 2     # [1, T, 1], any per-token tensor
        pieces = unpack_rollouts(batch, values)
        assert not set(pieces) & set(got)
        got.update(pieces)
    assert sorted(got) == list(range(num))
    for i, response in enumerate(responses):
        assert got[i][:, 0].tolist() == [2.0 * t for t in response]


def test_tool_masks_from_trl_invert_and_cut_the_padding():
    from hybrid_pack.packing import tool_masks_from_trl

    trl_mask = torch.tensor([[1, 1, 0, 0, 1], [1, 0, 1, 0, 0]])             # 1: the policy wrote it (TRL)
    assert tool_masks_from_trl(trl_mask, completion_lengths=[5, 3]) == [[0, 0, 1, 1, 0], [0, 1, 0]]
    batch = pack_rollouts([[7, 8]], [[1, 2, 3]], 16, tool_masks=tool_masks_from_trl([[1, 0, 1]]))[0]
    assert batch["tool_mask"][0].tolist() == [0, 0, 0, 1, 0]               # the injected token is masked
    assert batch["labels"][0].tolist() == [-100, -100, 1, -100, 3]
    with pytest.raises(InputError, match="tool_masks_from_trl"):
        pack_rollouts([[7, 8]], [[1, 2, 3]], 16, tool_masks=[[1, 2, 0]])
