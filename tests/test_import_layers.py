"""No import cycle among the engine's modules, and no import that the layer table of docs/seams.md forbids.

Imports are read with ``ast`` from every ``engine/**/*.py``, wherever they stand: at the top, inside a function
(the lazy imports that keep ``import engine`` light are edges like any other), under ``if TYPE_CHECKING:``.
Relative imports are resolved; ``from pkg import name`` imports the module ``pkg.name`` where that is a module,
else ``pkg``; importing ``a.b.c`` also imports the packages ``a.b`` and ``a`` (their ``__init__`` runs), except
the importer's own packages, which are already importing. Imports by a computed name (``importlib``) are not
seen (docs/seams.md says which).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEAMS = REPO / "docs" / "seams.md"
HEADING = "## Layers: who may import whom"

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of its first import}


def modules(root: Path, top: str = "engine") -> dict[str, Path]:
    """Dotted name -> file of every module under ``root/top`` (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted((root / top).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imported(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, known: dict[str, Path]) -> Iterator[str]:
    """The dotted names one import statement of module ``name`` imports (unresolved against ``known`` yet)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for a in node.names:
        yield f"{source}.{a.name}" if f"{source}.{a.name}" in known else source


def graph(root: Path, top: str = "engine") -> Graph:
    """Every module's imports of modules under ``top``, with the line of each."""
    known = modules(root, top)
    out: Graph = {}
    for name, path in known.items():
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}  # its packages
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported(node, name, path.name == "__init__.py", known):
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    t = ".".join(parts[:i])
                    if t in known and t not in own and t != name:
                        edges.setdefault(t, node.lineno)
        out[name] = edges
    return out


def cycles(g: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def layers(markdown: str) -> dict[str, int]:
    """unit -> layer from the table under :data:`HEADING`: each row ``| layer | `unit`, `unit` | ... |``, a unit
    being a package folder (``engine/store/``) or a module file (``engine/envs.py``)."""
    section = markdown.split(HEADING, 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            out.update(dict.fromkeys(re.findall(r"`([^`]+)`", cells[1]), int(cells[0])))
    return out


def unit_of(module: str, table: dict[str, int]) -> str | None:
    """The table's unit that places ``module``: its own file, else its nearest package folder."""
    parts = module.split(".")
    candidates = ["/".join(parts) + ".py", "/".join(parts) + "/__init__.py"]
    candidates += ["/".join(parts[:i]) + "/" for i in range(len(parts), 0, -1)]
    return next((c for c in candidates if c in table), None)


def forbidden(g: Graph, table: dict[str, int], paths: dict[str, Path], root: Path) -> list[str]:
    """``file:line importer -> imported (why)`` for each import the table forbids, and each module it does not
    place. Allowed: within one unit, and from a unit to a unit of a lower layer."""
    out = []
    for module in sorted(g):
        src = unit_of(module, table)
        where = paths[module].relative_to(root)
        if src is None:
            out.append(f"{where}: {module} is in no layer of the table")
            continue
        for target, line in sorted(g[module].items()):
            dst = unit_of(target, table)
            if dst is None or dst == src or table[dst] < table[src]:
                continue
            why = (f"another unit of layer {table[src]}, {src}'s" if table[dst] == table[src]
                   else f"in layer {table[dst]}, above {src} in {table[src]}")
            out.append(f"{where}:{line} {module} -> {target} ({dst} is {why})")
    return out


def test_no_import_cycle_among_engine_modules() -> None:
    found = cycles(graph(REPO))
    assert not found, "import cycles (move the shared piece into a lower module):\n" + "\n".join(map(str, found))


def test_no_import_breaks_the_layer_table() -> None:
    table = layers(SEAMS.read_text())
    found = forbidden(graph(REPO), table, modules(REPO), REPO)
    assert not found, "imports the layers of docs/seams.md forbid:\n" + "\n".join(found)


def test_the_table_places_units_that_exist() -> None:
    table = layers(SEAMS.read_text())
    assert len(table) >= 15 and set(table.values()) == set(range(8))
    missing = [u for u in table if not (REPO / u).exists()]
    assert not missing, f"the layer table names what is not there: {missing}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_cycle_check_sees_a_planted_cycle(tmp_path: Path) -> None:
    """A cycle held open by an import inside a function, written three ways (relative, ``from pkg import
    module``, plain), through a package whose ``__init__`` imports: found; cut, it is gone."""
    files = {"engine/__init__.py": "", "engine/p/__init__.py": "", "engine/q/__init__.py": "",
             "engine/r/__init__.py": "from engine.r.three import X\n",
             "engine/p/one.py": "def f():\n    from ..q import two\n    return two\n",
             "engine/q/two.py": "from engine import r\n",
             "engine/r/three.py": "import engine.p.one\nX = 1\n",
             "engine/p/fine.py": "from . import one\nfrom engine.q.two import r\n"}
    g = graph(_tree(tmp_path, files))
    assert g["engine.p.one"] == {"engine.q": 2, "engine.q.two": 2}
    assert cycles(g) == [["engine.p.one", "engine.q.two", "engine.r", "engine.r.three"]]
    (tmp_path / "engine/r/three.py").write_text("X = 1\n")
    assert cycles(graph(tmp_path)) == []


def test_the_layer_check_sees_planted_violations(tmp_path: Path) -> None:
    """Upward (inside a function, and from a package to a module placed above it), sideways (another unit of
    the same layer) and unplaced: each named with its file and line; downward and within a unit: not."""
    table = layers("# Seams\n\n" + HEADING + "\n\nSome words.\n\n| layer | units | what |\n|---|---|---|\n"
                   "| 0 | `engine/__init__.py`, `engine/base.py` | base |\n| 1 | `engine/low/` | low |\n"
                   "| 2 | `engine/left/`, `engine/right/` | two units |\n| 3 | `engine/left/top.py` | above |\n"
                   "\n## Next section\n\n| 9 | `engine/elsewhere/` | not the table |\n")
    assert table == {"engine/__init__.py": 0, "engine/base.py": 0, "engine/low/": 1, "engine/left/": 2,
                     "engine/right/": 2, "engine/left/top.py": 3}
    files = {"engine/__init__.py": "", "engine/base.py": "import os\n",
             "engine/low/__init__.py": "from engine import base\n\n\ndef f():\n    from engine.left import thing\n",
             "engine/left/__init__.py": "", "engine/right/__init__.py": "",
             "engine/left/thing.py": "import engine.low\nfrom engine.right import other\nfrom . import top\n",
             "engine/left/top.py": "from engine.left import thing\nfrom engine.low import f\n",
             "engine/right/other.py": "from engine import base\n", "engine/stray.py": ""}
    root = _tree(tmp_path, files)
    found = forbidden(graph(root), table, modules(root), root)
    assert found == [
        "engine/left/thing.py:3 engine.left.thing -> engine.left.top (engine/left/top.py is in layer 3, above "
        "engine/left/ in 2)",
        "engine/left/thing.py:2 engine.left.thing -> engine.right (engine/right/ is another unit of layer 2, "
        "engine/left/'s)",
        "engine/left/thing.py:2 engine.left.thing -> engine.right.other (engine/right/ is another unit of layer 2, "
        "engine/left/'s)",
        "engine/low/__init__.py:5 engine.low -> engine.left (engine/left/ is in layer 2, above engine/low/ in 1)",
        "engine/low/__init__.py:5 engine.low -> engine.left.thing (engine/left/ is in layer 2, above engine/low/ in 1)",
        "engine/stray.py: engine.stray is in no layer of the table"]
