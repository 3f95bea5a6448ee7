"""The library's import graph: no cycles, and no import against the layering.

Every import counts, at module level or inside a function (a deferred import still ties the two modules
together; it only hides the tie from Python's import order). Relative imports are resolved. The layering:
``models`` (pure modules and configs) import neither ``checkpoints`` nor ``training`` nor ``engine``, and the
compile-ahead module (``aot``) does not import the trainer (``training``)."""

import ast
from pathlib import Path

import dflash_jax

ROOT = Path(dflash_jax.__file__).parent
PACKAGE = "dflash_jax"
FORBIDDEN = {  # importer prefix -> imported prefixes it must not reach
    "dflash_jax.models": ("dflash_jax.checkpoints", "dflash_jax.training", "dflash_jax.engine"),
    "dflash_jax.aot": ("dflash_jax.training",),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from pkg import sub`` is ``pkg.sub`` when that is a
    module; ``from mod import name`` is ``mod``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                module = ".".join(base[:len(base) - node.level + 1] + ([module] if module else []))
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_the_graph_is_read():
    graph = _graph()
    assert "dflash_jax.models.config" in graph["dflash_jax.models.target"]
    assert len(graph) > 50


def test_no_import_cycles():
    graph = _graph()
    described = [" <-> ".join(c) + ": " + ", ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c)
                 for c in _cycles(graph)]
    assert not described, "import cycles:\n" + "\n".join(described)


def test_no_imports_against_the_layering():
    wrong = [f"{name} -> {target}" for name, targets in sorted(_graph().items()) for target in sorted(targets)
             for importer, banned in FORBIDDEN.items() if _within(name, importer)
             for prefix in banned if _within(target, prefix)]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_cycles_are_found():
    """The check itself: a planted cycle is reported, an acyclic chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
