"""Tiny random Hugging Face hybrid models, one per supported family, for tests, checks and benchmarks.

Every model is float32 on CPU, a few layers wide enough to mix a linear mixer with softmax
attention, and uses small chunk sizes (16) so a short packed row already crosses chunk edges.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.errors import InputError, MissingExtraError

__all__ = ["TINY_CONFIGS", "TINY_VLM_CONFIGS", "VISION_TOKENS", "tiny_config", "tiny_model", "tiny_vlm_model",
           "tiny_tokenizer"]

VOCAB = 128
CHUNK = 16


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )


def _qwen3_5() -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )


def _qwen3_5_moe() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, initializer_range=0.2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )


def _olmo_hybrid() -> Any:
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_allow_neg_eigval=True, pad_token_id=0,
        eos_token_id=1, initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )


def _lara_mini() -> Any:
    from transformers import LaraMiniConfig

    return LaraMiniConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, sliding_window=5, eos_token_id=1, initializer_range=0.2,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
    )


def _qwen4_exp() -> Any:
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, hc_count=2, hc_lowrank=8, ple_layer_ids=[1, 3], ple_embed_dim=8,
        ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=200,
        make_ngram_vocab_size_divisible_by=8, split_ngram_parts=1, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=8, indexer_budget=4, indexer_compress_ratio=2, output_gate_type="sigmoid", eos_token_id=1,
        pad_token_id=0, initializer_range=0.2,
        layer_types=["linear_attention", "indexed_attention", "linear_attention"],
    )


def _bamba() -> Any:
    from transformers import BambaConfig

    return BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK,
    )


def _nemotron_h() -> Any:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, ssm_state_size=8,
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=CHUNK,
        use_mamba_kernels=False,
    )


def _falcon_h1() -> Any:
    from transformers import FalconH1Config

    return FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=CHUNK, mamba_rms_norm=True,
        lm_head_multiplier=0.5, embedding_multiplier=2.0, key_multiplier=0.7, attention_in_multiplier=1.3,
        attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
        ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 0.7], mlp_multipliers=[1.1, 0.9],
    )


def _granitemoehybrid() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=CHUNK, position_embedding_type="rope",
        embedding_multiplier=1.5, residual_multiplier=0.8, attention_multiplier=0.3, logits_scaling=2.0,
    )


def _zamba2() -> Any:
    from transformers import Zamba2Config

    return Zamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=CHUNK,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64, use_mem_rope=True,
        use_mamba_kernels=False, adapter_rank=8, use_shared_attention_adapter=True,
    )


def _lfm2() -> Any:
    from transformers import Lfm2Config

    return Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, conv_L_cache=3, block_multiple_of=16,
        layer_types=["conv", "full_attention", "conv"],
    )


def _lfm2_moe() -> Any:
    from transformers import Lfm2MoeConfig

    return Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, layer_types=["conv", "full_attention", "conv"],
    )


def _lfm3() -> Any:
    from transformers import Lfm3Config

    return Lfm3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, conv_L_cache=3, sliding_window=5, pad_token_id=0, bos_token_id=1,
        eos_token_id=1, layer_types=["conv", "full_attention", "conv", "sliding_attention"],
    )


def _mamba2() -> Any:
    from transformers import Mamba2Config

    return Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, expand=2,
        conv_kernel=4, n_groups=2, chunk_size=CHUNK,
    )


def _jamba() -> Any:
    from transformers import JambaConfig

    return JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=4, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False,
    )


def _minimax() -> Any:
    from transformers import MiniMaxConfig

    return MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, block_size=CHUNK,
        sliding_window=None, initializer_range=0.2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    )


def _kimi_linear() -> Any:
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=12, num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=1, initializer_range=0.2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
    )


def _bailing_hybrid() -> Any:
    from transformers import BailingHybridConfig

    return BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=12, head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, short_conv_kernel_size=4, pad_token_id=0, eos_token_id=1, initializer_range=0.2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
    )


def _mamba() -> Any:
    from transformers import MambaConfig

    return MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
                       time_step_rank=4)


def _falcon_mamba() -> Any:
    from transformers import FalconMambaConfig

    return FalconMambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
                             conv_kernel=4, time_step_rank=4)


def _zamba() -> Any:
    from transformers import ZambaConfig

    return ZambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=5, attn_layer_period=2, attn_layer_offset=1,
        num_attention_heads=4, num_key_value_heads=4, attention_head_dim=16, intermediate_size=64, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, n_mamba_heads=2,
        initializer_range=0.2,   # at 0.02 the Mamba-1 output is too small for a broken state hand-over to show
    )


TINY_CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "olmo_hybrid": _olmo_hybrid,
    "lara_mini": _lara_mini,
    "qwen4_exp": _qwen4_exp,
    "bamba": _bamba,
    "nemotron_h": _nemotron_h,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granitemoehybrid,
    "zamba2": _zamba2,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "lfm3": _lfm3,
    "mamba2": _mamba2,
    "jamba": _jamba,
    "mamba": _mamba,
    "falcon_mamba": _falcon_mamba,
    "zamba": _zamba,
    "minimax": _minimax,
    "kimi_linear": _kimi_linear,
    "bailing_hybrid": _bailing_hybrid,
}


def _vision(model_type: str) -> dict[str, Any]:
    return {"model_type": model_type, "depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
            "out_hidden_size": 32, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
            "num_position_embeddings": 64}


# The vision tokens of the tiny vision-language models: the last ids of the tiny vocabulary.
VISION_TOKENS = {"image_token_id": VOCAB - 4, "video_token_id": VOCAB - 3, "vision_start_token_id": VOCAB - 2,
                 "vision_end_token_id": VOCAB - 1}


def _qwen3_5_vl() -> Any:
    from transformers import Qwen3_5Config

    return Qwen3_5Config(text_config=_qwen3_5().to_dict(), vision_config=_vision("qwen3_5_vision"), **VISION_TOKENS)


def _qwen3_5_moe_vl() -> Any:
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(text_config=TINY_CONFIGS["qwen3_5_moe"]().to_dict(),
                            vision_config=_vision("qwen3_5_moe_vision"), **VISION_TOKENS)


def _glm5_next() -> Any:
    """GLM-5-Next's language model: KDA, a DSA-indexed MLA layer with its own indexer (4-token pools, 2 chosen),
    one sharing that layer's top-k, hyper-connections (2 streams), dense and MoE MLPs. NoPE."""
    from transformers import Glm5NextTextConfig

    return Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=0,
        qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        index_topk=8, index_head_dim=8, index_n_heads=4, index_kpool=4, linear_head_dim=8, linear_num_heads=4,
        linear_conv_kernel_dim=4, hc_mult=2, hc_sinkhorn_iters=3, pad_token_id=0, eos_token_id=1,
        initializer_range=0.2,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "dense", "sparse"],
    )


def _glm5_next_vl() -> Any:
    from transformers import Glm5NextConfig

    vision = {"depth": 2, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "projection_intermediate_size": 32, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2}
    return Glm5NextConfig(text_config=_glm5_next().to_dict(), vision_config=vision)


TINY_VLM_CONFIGS: dict[str, Callable[[], Any]] = {"qwen3_5": _qwen3_5_vl, "qwen3_5_moe": _qwen3_5_moe_vl,
                                                   "glm5_next": _glm5_next_vl}
"""Tiny vision-language (``...ForConditionalGeneration``) configs of the families that have them."""


def tiny_vlm_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random vision-language model of ``family`` (a key of :data:`TINY_VLM_CONFIGS`; float32, CPU, eval)."""
    from transformers import AutoModelForImageTextToText

    if family not in TINY_VLM_CONFIGS:
        raise InputError(f"family: expected one of {sorted(TINY_VLM_CONFIGS)}; got {family!r}")
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(TINY_VLM_CONFIGS[family](), dtype=torch.float32).eval()


def tiny_config(family: str) -> Any:
    """The tiny config of ``family`` (a key of :data:`TINY_CONFIGS`)."""
    if family not in TINY_CONFIGS:
        raise InputError(f"family: expected one of {sorted(TINY_CONFIGS)}; got {family!r}")
    return TINY_CONFIGS[family]()


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM of ``family`` (float32, CPU, eval mode), seeded for reproducibility."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise MissingExtraError("tiny_model", "hf", err) from err

    config = tiny_config(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over the tiny models' vocabulary: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then the
    words ``w3`` ... ``w{VOCAB - 1}`` (ids 3 to ``VOCAB - 1``), split on whitespace. Built in memory, for trainers
    (TRL's ``SFTTrainer``) that need a ``processing_class``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
