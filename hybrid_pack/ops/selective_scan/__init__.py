"""The Mamba-1 selective scan (Jamba's mixer): the public function, its packed pure-torch scan, its static form
for :class:`~hybrid_pack.boundaries.StaticBoundaries` and its state passing on a context-parallel shard (``cp.py``).

Pure torch only: unlike the other op folders it registers no backend with the registry (no kernel adapter,
no self-check, no ``backends.py`` or ``check.py``) and no ``torch.library`` custom op; a compiled graph
traces its static form inline.
"""

from hybrid_pack.ops.selective_scan.op import selective_scan

__all__ = ["selective_scan"]
