"""Code-shape guards (issue 29's goals): no function in engine/, platform/ or onepiece_launcher/ over 60 lines, and every module
opens with a docstring whose first line says what it is; migrations are generated and excluded."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60
MIN_WORDS = 3  # "Django app config." is about the shortest sentence that still names what a module is


def _modules() -> list[Path]:
    return sorted(p for top in ("engine", "platform", "onepiece_launcher") for p in (ROOT / top).rglob("*.py")
                  if "migrations" not in p.relative_to(ROOT).parts)


def long_functions(tree: ast.AST, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, first line, length) of every function or method in ``tree`` over ``limit`` lines,
    counted as ``ast`` does (def line to last line, decorators not included, nested functions included in
    their parent and also judged on their own)."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    n = (child.end_lineno or child.lineno) - child.lineno + 1
                    if n > limit:
                        out.append((name, child.lineno, n))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def module_head_problem(source: str) -> str | None:
    """Why ``source`` does not open with a docstring whose first line is a sentence about it (None: it does)."""
    tree = ast.parse(source)
    doc = ast.get_docstring(tree, clean=False)
    if doc is None:
        return "no module docstring"
    if tree.body[0].lineno != 1:
        return f"the docstring starts on line {tree.body[0].lineno}, not line 1"
    first = doc.split("\n", 1)[0].strip()
    if len(first.split()) < MIN_WORDS:
        return f"the docstring's first line {first!r} is not a sentence about the module"
    return None


def test_no_function_over_60_lines() -> None:
    found = [f"{p.relative_to(ROOT)}:{line} {name} is {n} lines (limit {MAX_LINES})"
             for p in _modules() for name, line, n in long_functions(ast.parse(p.read_text(), str(p)))]
    assert not found, "functions over the limit; split them:\n" + "\n".join(found)


def test_every_module_opens_with_a_docstring_that_says_what_it_is() -> None:
    found = [f"{p.relative_to(ROOT)}: {why}" for p in _modules()
             if (why := module_head_problem(p.read_text())) is not None]
    assert not found, "modules without a first line that says what they are:\n" + "\n".join(found)


def test_the_checks_see_what_they_guard() -> None:
    # controls: each check names what it should, so the two tests above cannot pass by seeing nothing
    body = "\n".join(f"        x = {i}" for i in range(60))
    src = f'"""A module for the control."""\n\nclass K:\n    def long(self):\n{body}\n\n    def short(self):\n        pass\n'
    assert long_functions(ast.parse(src)) == [("K.long", 4, 61)]
    assert long_functions(ast.parse(src), limit=61) == []
    assert module_head_problem(src) is None
    assert module_head_problem("import os\n") == "no module docstring"
    assert module_head_problem('"""Apps."""\n') is not None
    assert module_head_problem('# a comment\n"""A module with a comment first."""\n') is not None
    assert len(_modules()) > 100
    assert not any("migrations" in p.parts for p in _modules())
