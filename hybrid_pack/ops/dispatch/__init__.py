"""How a call of an op reaches a backend (docs/api.md §5, §5a, §9b): the route (``route.py``), the registry and
:func:`available` (``registry.py``), the choice (``selector.py``), the self-checks (``selfcheck.py``,
``cp_check.py``), the verdicts (``verdicts.py``) and the warm-up (``warmup.py``). Each op folder registers its own."""
