"""The package's layering, read from its imports: every module imports only its own layer or those below it
(docs/architecture.md), the packages form no import cycle, and the light entry points load nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "hybrid_pack"

# Lowest first: a module may import from its own layer and every layer before it.
LAYERS = (
    ("hybrid_pack.errors", "hybrid_pack.schema", "hybrid_pack.distributed", "hybrid_pack.lazy"),
    ("hybrid_pack.boundaries",),
    ("hybrid_pack.multimodal", "hybrid_pack.mrope", "hybrid_pack.data"),
    ("hybrid_pack.collate",),
    ("hybrid_pack.packing",),
    ("hybrid_pack.isolation",),
    ("hybrid_pack.ops",),
    ("hybrid_pack.backends", "hybrid_pack.loss"),
    ("hybrid_pack.modeling",),
    ("hybrid_pack.parallel",),
    ("hybrid_pack.testing",),
    ("hybrid_pack.integrations",),
    ("hybrid_pack.training",),
    ("hybrid_pack.bench", "hybrid_pack.cli"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if any(module == name or module.startswith(name + ".") for name in layer):
            return index
    return None


def _imports(path: Path) -> set[str]:
    """Every hybrid_pack module ``path`` imports, at module level or inside a function."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:   # ``from package import submodule`` imports the submodule
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name.startswith("hybrid_pack.")}


def test_every_module_has_a_layer():
    assert [name for name in MODULES if name != "hybrid_pack" and _layer(name) is None] == []


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{name} -> {imported}" for name, path in MODULES.items() if name != "hybrid_pack"
              for imported in sorted(_imports(path)) if _layer(imported) > _layer(name)]
    assert upward == []


def test_the_self_check_imports_nothing_of_the_dispatch():
    """ops/selfcheck proves a backend; ops/dispatch chooses one on that proof: the proof sits below the choice."""
    upward = [f"{name} -> {imported}" for name, path in MODULES.items() if name.startswith("hybrid_pack.ops.selfcheck")
              for imported in sorted(_imports(path)) if imported.startswith("hybrid_pack.ops.dispatch")]
    assert upward == []


def test_no_import_cycle_between_modules():
    graph = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}
    cycles = []
    for start in graph:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                if nxt == start and len(trail) > 1:
                    cycles.append(" -> ".join((*trail, start)))
                elif nxt not in seen and nxt > start:   # each cycle once, from its smallest module
                    seen.add(nxt)
                    stack.append((nxt, (*trail, nxt)))
    assert cycles == []


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_ops_import_neither_fsdp_nor_the_transforms():
    loaded = _loaded_after("import hybrid_pack.ops")
    heavy = sorted(m for m in loaded if m.startswith(("hybrid_pack.parallel", "torch.distributed.fsdp",
                                                      "torch.distributed.algorithms._checkpoint")))
    assert heavy == []


@pytest.mark.parametrize("entry", ["import hybrid_pack", "import hybrid_pack.testing.pytest_plugin"])
def test_light_entry_points_import_no_torch(entry):
    assert "torch" not in _loaded_after(entry)
