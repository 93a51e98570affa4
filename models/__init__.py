"""Model presets (JSON HybridConfig files), installed as ``hybrid_pack.presets``; load with
``hybrid_pack.modeling.from_preset(name)``."""
