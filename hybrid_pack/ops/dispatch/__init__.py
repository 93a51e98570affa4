"""How a call of an op reaches a backend (docs/api.md §5, §5a): the one route every op's calls take
(``route.py``), the one registry of whole-row and sharded backends (``registry.py``), the selector
(``selector.py``: a local lookup, never a collective), the self-checks a kernel passes before it serves
(``selfcheck.py``; ``cp_check.py`` for a sharded backend, collectively), and the warm-up that settles one
verdict per key for every rank (``warmup.py``, ``agreement.py``). Nothing here knows any particular op:
each op folder registers its contract, its backends and its route."""
