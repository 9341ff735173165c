"""engine/envs.py is the only reader of ONEPIECE_* variables in engine/ and platform/ (writing one into a
child's environment is not a read)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REGISTRY = REPO / "engine" / "envs.py"


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` or a bare ``environ``."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (isinstance(node, ast.Name)
                                                                            and node.id == "environ")


def _names(tree: ast.Module) -> dict[str, str]:
    """Module-level constants holding a variable's name (``CONFIG_ENV = "ONEPIECE_..."``)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def readers(source: str) -> list[int]:
    """The lines of ``source`` that read an ONEPIECE_* variable from the environment: ``os.environ.get``,
    ``os.getenv``, ``os.environ[...]`` as a value, or ``pop`` / ``setdefault`` whose result is used."""
    tree = ast.parse(source)
    consts = _names(tree)

    def onepiece(arg: ast.AST) -> bool:
        value = arg.value if isinstance(arg, ast.Constant) else consts.get(arg.id) if isinstance(arg, ast.Name) else None
        return isinstance(value, str) and value.startswith("ONEPIECE_")

    statements = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # calls whose value is dropped
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute | ast.Name):
            f = node.func
            getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv")
            environ_call = isinstance(f, ast.Attribute) and _is_environ(f.value) and (
                f.attr == "get" or (f.attr in ("pop", "setdefault") and id(node) not in statements))
            if not (getenv or environ_call):
                continue
            key = node.args[0]
        else:
            continue
        if onepiece(key):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_but_engine_envs_reads_a_onepiece_variable() -> None:
    found = []
    for folder in ("engine", "platform", "onepiece_launcher"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path == REGISTRY or ".venv" in path.parts:
                continue
            for line in readers(path.read_text()):
                found.append(f"{path.relative_to(REPO)}:{line}")
    assert not found, "read ONEPIECE_* through engine.envs, not the environment: " + ", ".join(found)


def test_the_check_sees_every_kind_of_reader_and_passes_writes() -> None:
    source = '''import os
from os import environ, getenv
NAME = "ONEPIECE_WORKER_CONFIG"
a = os.environ.get("ONEPIECE_X")
b = os.getenv("ONEPIECE_Y", "1")
c = os.environ["ONEPIECE_Z"]
d = environ.get(NAME)
e = os.environ.pop(NAME, "")
f = getenv("ONEPIECE_W")
os.environ["ONEPIECE_X"] = "1"
os.environ.setdefault("ONEPIECE_Y", "2")
os.environ.pop(NAME, None)
g = os.environ.get("HOME")
h = {**os.environ, "ONEPIECE_X": "1"}
'''
    assert readers(source) == [4, 5, 6, 7, 8, 9]
