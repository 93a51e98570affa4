"""How a kernel proves itself before it serves (docs/api.md §5a): each op's contract (``contract.py``: a call's
signature and inputs of a signature), the check on one whole packed row (``whole_row.py``) and on a row split
across a context-parallel group (``sharded_row.py``), their result (``result.py``) and the results kept per
environment (``kept.py``). It imports nothing of :mod:`hybrid_pack.ops.dispatch`, which runs the checks and settles
their verdicts."""
