"""How a call of an op reaches a backend: the registry, the selector, and the self-check a kernel
passes before it serves (docs/api.md §5, §5a). Nothing here knows any particular op: each op folder
registers its contract and its backends."""
