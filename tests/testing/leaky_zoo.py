"""A zoo of token mixers, each either boundary-safe or leaking in one deliberate way, inside a toy LM
that takes the docs/api.md §3 batch. The harness must flag every leaky one and name its module."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pack.boundaries import PackedBoundaries

WIDTH = 4


class CausalConv(nn.Module):
    """Depthwise causal conv; ``reach`` extra taps may cross into the previous document (0 = safe)."""

    def __init__(self, dim: int, reach: int | None = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, WIDTH) * 0.5)
        self.reach = reach

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        padded = F.pad(x, (0, 0, WIDTH - 1, 0))
        taps = torch.stack([padded[:, i:i + x.shape[1]] for i in range(WIDTH)], dim=2)  # [1, T, W, D]
        if self.reach is not None:
            lag = torch.arange(WIDTH - 1, -1, -1, device=x.device)
            keep = b.position_ids[0, :, None] + self.reach >= lag[None, :]
            taps = taps * keep[None, :, :, None]
        return (taps * self.weight.t()[None, None]).sum(2)


class Recurrence(nn.Module):
    """``h_t = 0.9 h_{t-1} + x_t``, reset at document starts unless ``reset`` is False."""

    def __init__(self, reset: bool = True) -> None:
        super().__init__()
        self.reset = reset

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        h, out = torch.zeros_like(x[:, 0]), []
        starts = set(b.starts)
        for t in range(x.shape[1]):
            h = (0.0 if self.reset and t in starts else 0.9) * h + x[:, t]
            out.append(h)
        return torch.stack(out, dim=1)


class Attention(nn.Module):
    """Causal single-head attention; the document mask is applied unless ``doc_mask`` is False."""

    def __init__(self, dim: int, doc_mask: bool = True) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.doc_mask = doc_mask

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if self.doc_mask:
            mask &= b.seq_idx[0, :, None] == b.seq_idx[0, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Positions(nn.Module):
    """Learned absolute positions from ``position_ids`` (or, leaking, from the row offset)."""

    def __init__(self, dim: int, restart: bool = True) -> None:
        super().__init__()
        self.table = nn.Embedding(1024, dim)
        self.restart = restart

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        pos = b.position_ids if self.restart else torch.arange(x.shape[1], device=x.device)[None]
        return self.table(pos)


class TimeNorm(nn.Module):
    """Normalisation over the time axis of the whole row: mixes every document."""

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        return (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True, correction=0) + 1e-5)


class _MixGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad + 0.1 * torch.roll(grad, 1, dims=1)


class BackwardLeak(nn.Module):
    """Identity forward; its backward sends each token's gradient to the next token."""

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        return _MixGradient.apply(x)


class Block(nn.Module):
    """Pre-norm residual block around one mixer (so the harness must name the inner module)."""

    def __init__(self, dim: int, mixer: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = mixer

    def forward(self, x: torch.Tensor, b: PackedBoundaries) -> torch.Tensor:
        return x + self.mixer(self.norm(x), b)


class ToyLM(nn.Module):
    """Embedding -> blocks -> head; takes the §3 batch keys and returns ``.logits``."""

    def __init__(self, mixers: list[nn.Module], dim: int = 16, vocab: int = 37) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, chunk_size=16)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, m) for m in mixers)
        self.head = nn.Linear(dim, vocab)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                **batch: object) -> SimpleNamespace:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        b = PackedBoundaries.from_batch(batch)
        for block in self.blocks:
            x = block(x, b)
        return SimpleNamespace(logits=self.head(x))


def clean_mixers(dim: int = 16) -> list[nn.Module]:
    return [CausalConv(dim), Recurrence(), Attention(dim), Positions(dim)]


# name -> (mixers, module the harness must name)
LEAKY = {
    "conv without boundaries": (lambda d: [Attention(d), CausalConv(d, reach=None)], "blocks.1.mixer"),
    "recurrence without resets": (lambda d: [CausalConv(d), Recurrence(reset=False)], "blocks.1.mixer"),
    "attention without a document mask": (lambda d: [CausalConv(d), Attention(d, doc_mask=False)], "blocks.1.mixer"),
    "positions that do not restart": (lambda d: [CausalConv(d), Positions(d, restart=False)], "blocks.1.mixer"),
    "normalisation over the time axis": (lambda d: [Attention(d), TimeNorm()], "blocks.1.mixer"),
    "boundary off by one": (lambda d: [Attention(d), CausalConv(d, reach=1)], "blocks.1.mixer"),
    "leak only in the backward pass": (lambda d: [CausalConv(d), BackwardLeak(), Attention(d)], "blocks.1.mixer"),
}
