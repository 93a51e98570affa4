"""Configuration of a hybrid causal LM: which mixer each layer uses and the size of every block.

The layer pattern is a string with one letter per layer:

=======  ==========================================================
letter   mixer
=======  ==========================================================
``G``    Gated DeltaNet (Qwen3-Next's linear-attention layer)
``M``    Mamba-2 (SSD), as in Bamba / mamba-ssm
``A``    softmax attention (grouped-query, RoPE)
=======  ==========================================================

so Qwen3-Next's "three Gated DeltaNet layers, then one attention layer" is ``"GGGAGGGA"`` and a
Bamba-style stack is ``"MMMAMMMM"``. A list of names (``["gdn", "gdn", "gdn", "attn"]``, see
:data:`MIXER_NAMES`) is accepted too and stored as letters.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any

from hybrid_pack.errors import InputError

__all__ = ["HybridConfig", "MIXER_LETTERS", "MIXER_NAMES"]

MIXER_LETTERS = {"G": "gated_deltanet", "M": "mamba2", "A": "attention"}
MIXER_NAMES = {
    "g": "G", "gdn": "G", "gated_deltanet": "G", "gated_delta_net": "G", "linear_attention": "G",
    "m": "M", "mamba": "M", "mamba2": "M",
    "a": "A", "attn": "A", "attention": "A", "full_attention": "A",
}


def _pattern_letters(pattern: str | list[str] | tuple[str, ...]) -> str:
    """Normalise a layer pattern to a string of ``G`` / ``M`` / ``A``."""
    if isinstance(pattern, str):
        letters = pattern.replace(" ", "").upper()
        bad = sorted(set(letters) - set(MIXER_LETTERS))
        if bad:
            raise InputError(f"layer_pattern: expected letters from {sorted(MIXER_LETTERS)} "
                             f"(G = Gated DeltaNet, M = Mamba-2, A = attention); got {bad} in {pattern!r}")
        return letters
    if isinstance(pattern, (list, tuple)):
        letters = []
        for name in pattern:
            key = str(name).lower()
            if key not in MIXER_NAMES:
                raise InputError(f"layer_pattern: unknown mixer {name!r}; expected one of {sorted(MIXER_NAMES)}")
            letters.append(MIXER_NAMES[key])
        return "".join(letters)
    raise InputError(f"layer_pattern: expected a string like 'GGGA' or a list of mixer names; "
                     f"got {type(pattern).__name__}")


@dataclass
class HybridConfig:
    """Every size and switch of a :class:`~hybrid_pack.modeling.HybridForCausalLM`.

    Attributes:
        vocab_size: rows of the embedding and of the output head.
        hidden_size: width of the residual stream.
        layer_pattern: one letter per layer (``G`` Gated DeltaNet, ``M`` Mamba-2, ``A`` attention);
            ``num_layers`` is its length.
        intermediate_size: SwiGLU hidden width of the dense MLP (used when ``num_experts == 0``).
        num_attention_heads, num_key_value_heads, head_dim: grouped-query attention shape.
        rope_theta: RoPE base.
        attention_output_gate: multiply the attention output by ``sigmoid(gate)`` from ``q_proj``
            (Qwen3-Next); off for Bamba.
        attention_qk_norm: RMSNorm on each query / key head before RoPE (Qwen3-Next); off for Bamba.
        gdn_num_k_heads, gdn_num_v_heads: Gated DeltaNet query/key heads and value heads
            (``gdn_num_v_heads % gdn_num_k_heads == 0``).
        gdn_head_k_dim, gdn_head_v_dim: Gated DeltaNet key and value head sizes.
        gdn_conv_width: taps of the short causal conv on q, k, v.
        mamba_num_heads, mamba_head_dim: Mamba-2 heads and head size (inner width is their product).
        mamba_state_size: SSM state size per head (``d_state``).
        mamba_num_groups: groups sharing B and C (``mamba_num_heads % mamba_num_groups == 0``).
        mamba_conv_width: taps of the short causal conv on x, B, C.
        mamba_chunk_size: chunk length of the SSD scan (speed only; results do not depend on it).
        num_experts: 0 for a dense MLP, else the routed experts of a top-k MoE MLP.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: SwiGLU hidden width of each routed expert.
        shared_expert_intermediate_size: width of the always-on shared expert (0: none).
        norm_topk_prob: renormalise the top-k routing weights to sum to 1.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: the output head reuses the embedding matrix.
        initializer_range: std of the normal init of linear and embedding weights.
    """

    vocab_size: int = 8192
    hidden_size: int = 128
    layer_pattern: str = "GGGA"
    intermediate_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 10000.0
    attention_output_gate: bool = True
    attention_qk_norm: bool = True
    gdn_num_k_heads: int = 2
    gdn_num_v_heads: int = 4
    gdn_head_k_dim: int = 32
    gdn_head_v_dim: int = 32
    gdn_conv_width: int = 4
    mamba_num_heads: int = 4
    mamba_head_dim: int = 64
    mamba_state_size: int = 32
    mamba_num_groups: int = 1
    mamba_conv_width: int = 4
    mamba_chunk_size: int = 64
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        self.layer_pattern = _pattern_letters(self.layer_pattern)
        self.validate()

    # ------------------------------------------------------------------ views
    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ------------------------------------------------------------- validation
    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range or inconsistent."""
        if not self.layer_pattern:
            raise InputError("layer_pattern: expected at least one layer, e.g. 'GGGA'")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise InputError(f"{f.name}: expected an int; got {value!r}")
            if f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise InputError(f"{f.name}: expected a number; got {value!r}")
            if f.type == "bool" and not isinstance(value, bool):
                raise InputError(f"{f.name}: expected true or false; got {value!r}")
        positive = ["vocab_size", "hidden_size", "intermediate_size", "rms_norm_eps", "initializer_range",
                    "rope_theta"]
        uses = set(self.layer_pattern)
        if "A" in uses:
            positive += ["num_attention_heads", "num_key_value_heads", "head_dim"]
        if "G" in uses:
            positive += ["gdn_num_k_heads", "gdn_num_v_heads", "gdn_head_k_dim", "gdn_head_v_dim", "gdn_conv_width"]
        if "M" in uses:
            positive += ["mamba_num_heads", "mamba_head_dim", "mamba_state_size", "mamba_num_groups",
                         "mamba_conv_width", "mamba_chunk_size"]
        if self.is_moe:
            positive += ["num_experts_per_tok", "moe_intermediate_size"]
        for name in positive:
            if not 0 < getattr(self, name) < math.inf:  # NaN and infinity too
                raise InputError(f"{name}: expected a positive finite value; got {getattr(self, name)!r}")
        for name in ("num_experts", "shared_expert_intermediate_size"):
            if getattr(self, name) < 0:
                raise InputError(f"{name}: expected an int >= 0; got {getattr(self, name)!r}")
        if "A" in uses:
            if self.num_attention_heads % self.num_key_value_heads:
                raise InputError(f"num_key_value_heads: expected a divisor of num_attention_heads="
                                 f"{self.num_attention_heads}; got {self.num_key_value_heads}")
            if self.head_dim % 2:
                raise InputError(f"head_dim: expected an even size (RoPE rotates pairs); got {self.head_dim}")
        if "G" in uses and self.gdn_num_v_heads % self.gdn_num_k_heads:
            raise InputError(f"gdn_num_v_heads: expected a multiple of gdn_num_k_heads={self.gdn_num_k_heads}; "
                             f"got {self.gdn_num_v_heads}")
        if "M" in uses and self.mamba_num_heads % self.mamba_num_groups:
            raise InputError(f"mamba_num_groups: expected a divisor of mamba_num_heads={self.mamba_num_heads}; "
                             f"got {self.mamba_num_groups}")
        if self.is_moe and self.num_experts_per_tok > self.num_experts:
            raise InputError(f"num_experts_per_tok: expected at most num_experts={self.num_experts}; "
                             f"got {self.num_experts_per_tok}")

    # --------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HybridConfig:
        """Build from a dict; unknown keys raise ValueError (a typo would otherwise be ignored)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"{unknown[0]}: not a HybridConfig field; fields are {sorted(known)}")
        return cls(**data)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | PathLike[str]) -> None:
        """Write the config as JSON to ``path`` (a file, or a directory that gets ``config.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(self.to_json_string())

    @classmethod
    def load(cls, path: str | PathLike[str]) -> HybridConfig:
        """Read a config written by :meth:`save` (a file, or a directory holding ``config.json``)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))
