"""How a call of an op reaches a backend (docs/api.md §5, §5a, §9b): the route (``route.py``), the registry
(``registry.py``, ``backend.py``), the choice (``selector.py``), the verdicts in force (``verdicts.py``) and the warm-up
that settles them (``warmup.py``, on the keys ``discovery.py`` meets). The checks themselves live in
:mod:`hybrid_pack.ops.selfcheck`. Each op folder registers its own."""
