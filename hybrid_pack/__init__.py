"""hybrid_pack: packed (padding-free) training for hybrid LMs that never mixes documents.

Data flow: ``packing`` (plans) -> ``collate`` (PackingCollator) -> ``boundaries``
(PackedBoundaries) -> ``ops`` (boundary-safe kernels, chosen by ``backends``) -> ``modeling`` /
``integrations`` -> ``training`` and the ``testing`` harness.

Every name loads on first use, so importing the package (e.g. its pytest plugin) imports no torch.
"""

from __future__ import annotations

from hybrid_pack.lazy import lazy_attributes

__version__ = "0.1.0"

_LAZY = {
    "PackedBoundaries": "hybrid_pack.boundaries",
    "PackPlan": "hybrid_pack.packing",
    "plan_packs": "hybrid_pack.packing",
    "PackedBatchSampler": "hybrid_pack.packing",
    "pack_rollouts": "hybrid_pack.packing",
    "PackingCollator": "hybrid_pack.collate",
    "packed_loss": "hybrid_pack.loss",
    "use_backends": "hybrid_pack.backends",
    "batch_invariant": "hybrid_pack.ops.invariant",
}

__all__ = ["__version__", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY)
