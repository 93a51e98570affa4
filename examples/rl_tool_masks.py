"""Tool-output masks for agentic RL, from the bundled glaive tool-calling chats, packed with pack_rollouts.

    .venv/bin/python examples/rl_tool_masks.py                    # a bigram policy, 4 packs
    .venv/bin/python examples/rl_tool_masks.py --preset qwen3-next-tiny --max-packs 1   # the hybrid model (slow on CPU)

Each chat becomes one rollout: the prompt is everything before the first assistant turn (system
prompt with the tool schemas, the first user message, ``<|im_start|>assistant\\n``); the response
is the rest of the conversation. Tokens of the response that the policy did not write (tool
results, later user turns, the chat framing between turns) get ``tool_mask = 1``: they are
context, never policy-gradient targets. The trained/untrained split comes from
``hybrid_pack.data.tokenize_chats``, whose labels mark the assistant spans of the Qwen3 chat
template.

The rollouts are packed with ``pack_rollouts`` and one PPO-clip step is taken on each pack with
synthetic rewards; the script checks that no logit predicting a prompt or tool token receives
gradient, and prints what was masked.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from hybrid_pack import PackedBoundaries, pack_rollouts
from hybrid_pack.data import load_tokenizer, load_toolcall_chats, tokenize_chats
from hybrid_pack.loss import token_logprobs
from hybrid_pack.modeling.vocab import VocabRemap
from hybrid_pack.schema import IGNORE_INDEX


def chats_to_rollouts(features: list[dict[str, list[int]]]) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Split tokenized chats at their first trained token: ``(prompts, responses, tool_masks)``."""
    prompts, responses, tool_masks = [], [], []
    for feature in features:
        labels = np.asarray(feature["labels"])
        first = int(np.argmax(labels != IGNORE_INDEX))
        prompts.append(feature["input_ids"][:first])
        responses.append(feature["input_ids"][first:])
        tool_masks.append((labels[first:] == IGNORE_INDEX).astype(np.int64).tolist())
    return prompts, responses, tool_masks


class BigramPolicy(torch.nn.Module):
    """Next-token logits from the current token alone: a stand-in policy that trains in seconds on CPU."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 64)
        self.head = torch.nn.Linear(64, vocab_size)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.head(self.embed(input_ids))


def ppo_clip_loss(logprobs: torch.Tensor, batch: dict, clip: float = 0.2) -> torch.Tensor:
    """Token-mean PPO-clip loss over the policy's own tokens: ``response_mask * (1 - tool_mask)``."""
    policy_tokens = (batch["response_mask"] * (1 - batch["tool_mask"])).float()
    ratio = torch.exp(logprobs - batch["old_logprobs"])
    advantages = batch["advantages"]
    objective = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -(objective * policy_tokens).sum() / policy_tokens.sum().clamp(min=1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the example; return what it measured (rollouts, packs, and per step the loss and the gradients)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=int, default=16384)
    parser.add_argument("--preset", default=None, help="a hybrid_pack model preset instead of the bigram policy")
    parser.add_argument("--max-packs", type=int, default=4, help="train on at most this many packs")
    args = parser.parse_args(argv)
    torch.manual_seed(0)

    features = tokenize_chats(load_toolcall_chats(), empty_think=False)
    text_responses, tool_masks = chats_to_rollouts(features)[1:]
    remap = VocabRemap.from_corpus([f["input_ids"] for f in features], size=4096)
    prompts, responses, _ = chats_to_rollouts([remap.encode_example(f) for f in features])
    response_tokens = sum(len(r) for r in responses)
    masked = sum(sum(m) for m in tool_masks)
    print(f"{len(responses)} rollouts, {sum(map(len, prompts)):,} prompt + {response_tokens:,} response tokens; "
          f"{masked:,} response tokens ({masked / response_tokens:.1%}) are tool output or other injected context")

    if args.preset:
        from hybrid_pack.modeling import from_preset
        policy = from_preset(args.preset, vocab_size=remap.size)
    else:
        policy = BigramPolicy(remap.size)

    def logits_of(batch: dict) -> torch.Tensor:
        out = policy(**batch)
        return out if isinstance(out, torch.Tensor) else out.logits

    rewards = np.random.default_rng(0).normal(size=len(responses))
    advantages = ((rewards - rewards.mean()) / rewards.std()).tolist()
    plain = pack_rollouts(prompts, responses, args.capacity, tool_masks=tool_masks)
    old_logprobs = [np.zeros(len(r), dtype=np.float32) for r in responses]
    with torch.no_grad():
        for batch in plain[:args.max_packs]:
            logprobs, _ = token_logprobs(logits_of(batch), batch["input_ids"],
                                         boundaries=PackedBoundaries.from_batch(batch))
            for i in batch["sample_index"].unique().tolist():
                is_response = (batch["sample_index"] == i) & (batch["response_mask"] == 1)
                old_logprobs[i] = logprobs[is_response].numpy()
    batches = pack_rollouts(prompts, responses, args.capacity, tool_masks=tool_masks, advantages=advantages,
                            old_logprobs=old_logprobs)
    print(f"packed into {len(batches)} rows of <= {args.capacity} tokens "
          f"(fill {sum(b['input_ids'].shape[1] for b in batches) / (len(batches) * args.capacity):.1%})")

    summary: dict[str, Any] = {"rollouts": len(responses), "packs": len(batches), "masked_tokens": masked,
                               "response_tokens": response_tokens, "steps": []}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for step, batch in enumerate(batches[:args.max_packs]):
        boundaries = PackedBoundaries.from_batch(batch)
        logits = logits_of(batch)
        logits.retain_grad()
        logprobs, _ = token_logprobs(logits, batch["labels"], boundaries=boundaries)
        loss = ppo_clip_loss(logprobs, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        predicts_policy_token = torch.zeros_like(batch["labels"], dtype=torch.bool)
        predicts_policy_token[:, :-1] = batch["labels"][:, 1:] != IGNORE_INDEX
        gradient = logits.grad.abs().sum(-1)
        leaked = gradient[~predicts_policy_token].max().item()
        summary["steps"].append({"rollouts": boundaries.num_docs, "tokens": boundaries.total_tokens,
                                 "loss": loss.item(), "leaked_gradient": leaked,
                                 "policy_gradient": gradient[predicts_policy_token].max().item()})
        print(f"pack {step}: {boundaries.num_docs} rollouts, {boundaries.total_tokens} tokens, "
              f"loss {loss.item():+.4f}, largest gradient on a logit predicting a prompt/tool token: {leaked:.1e}")
        if leaked != 0.0:
            raise SystemExit(f"pack {step}: a prompt or tool token received gradient {leaked:.1e}")

    tokenizer = load_tokenizer()
    for i, (ids, mask) in enumerate(zip(text_responses, tool_masks)):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
        for start, stop in zip(edges[0::2], edges[1::2]):
            masked = tokenizer.decode(ids[start:stop], skip_special_tokens=False)
            if "<tool_response>" in masked:
                policy_text = tokenizer.decode(ids[:start], skip_special_tokens=False)
                print(f"\nrollout {i}, the policy's tool call, then the masked tool output:")
                print("  policy:", repr(policy_text[-200:]))
                print("  masked:", repr(masked[:300]))
                summary["masked_tool_output"] = masked
                return summary
    return summary

if __name__ == "__main__":
    main()
