"""A compact hybrid causal LM built only on the boundary-safe ops (docs/api.md §6).

Layers mix Gated DeltaNet (``G``), Mamba-2 (``M``) and softmax attention (``A``) in any pattern:
Qwen3-Next style (``"GGGA" * k``) or Bamba style (Mamba-2 with a few attention layers). Presets in
the top-level ``models/`` folder load by name with :func:`from_preset`.
"""

from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.model import CausalLMOutput, HybridForCausalLM, HybridModel
from hybrid_pack.modeling.presets import from_preset, list_presets, preset_config
from hybrid_pack.modeling.vocab import VocabRemap, expand_vocabulary

__all__ = ["HybridConfig", "HybridModel", "HybridForCausalLM", "CausalLMOutput", "from_preset", "list_presets",
           "preset_config", "VocabRemap", "expand_vocabulary"]
