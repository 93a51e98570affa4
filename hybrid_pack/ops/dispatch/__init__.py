"""How a call of an op reaches a backend (docs/api.md §5, §5a, §9b): the one route every op's calls take, a
dictionary look-up per call (``route.py``), the one registry of whole-row and sharded backends (``registry.py``),
the full choice made once per call key (``selector.py``: never a collective), the self-checks a kernel passes
before it serves (``selfcheck.py``; ``cp_check.py`` for a sharded backend, collectively), the verdicts kept and
settled (``verdicts.py``), and the one warm-up that settles them for every rank (``warmup.py``). Nothing here knows
any particular op: each op folder registers its contract, its backends and its route."""
