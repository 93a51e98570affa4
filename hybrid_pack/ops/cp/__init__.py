"""Context-parallel primitives the ops run on a :class:`~hybrid_pack.boundaries.sharded.ShardedBoundaries`: token
exchange and halos (:mod:`.exchange`), recurrent state passing (:mod:`.state_passing`), layout changes
(:mod:`.relayout`) and the compile rule for sharded calls (:mod:`.eager`). Nothing here wraps a model: the
transforms (FSDP2, activation checkpointing, compile, ``parallelize``) live in :mod:`hybrid_pack.parallel`."""
