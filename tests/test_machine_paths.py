"""Guard: no test or benchmark reads a fixed machine path (issue 35 item 1).

A folder that one machine happens to hold (``/tmp/tiny``, a model built by hand under ``/root``) is not on a
new one: CI on a fresh clone failed ten tests that way. Every test reads only what a fixture or the test
itself made (``tmp_path``, the session's ``tiny_models``), and every benchmark builds what it needs in a
temporary folder when it is not told where to look. The scan is static: each string literal of ``tests/``,
``benchmarks/`` and ``engine/bench/`` that names an absolute path under a machine-local root is a read, unless
it is an input handed to a refusal: a literal inside a ``pytest.raises`` block, or inside a collection bound
to a name that says so (``bad``, ``invalid``, ``refused``, ``rejected``, ``traversal``), or inside
``pytest.mark.parametrize`` arguments next to such a name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("tests", "benchmarks", "engine/bench")
# roots whose contents depend on the machine (and, for /tmp, on what ran there before)
MACHINE_ROOTS = ("/tmp", "/var/tmp", "/root", "/home", "/work", "/mnt", "/srv", "/opt", "/data", "/scratch")
REFUSAL_NAME = re.compile(r"bad|invalid|refus|reject|travers|attack|evil|malformed", re.IGNORECASE)


def _machine_path(value: str) -> bool:
    return any(value == r or value.startswith(r + "/") for r in MACHINE_ROOTS)


def _is_raises(item: ast.withitem) -> bool:
    call = item.context_expr
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "raises"


def _refusal_context(node: ast.AST) -> bool:
    """Whether ``node`` (an ancestor of the literal) marks what lies inside it as input to a refusal."""
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return any(_is_raises(i) for i in node.items)
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Name) and REFUSAL_NAME.search(t.id) for t in targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "parametrize":
        first = node.args[0] if node.args else None
        return isinstance(first, ast.Constant) and bool(REFUSAL_NAME.search(str(first.value)))
    return False


def fixed_path_reads(source: str) -> list[tuple[int, str]]:
    """(line, literal) of every machine path in ``source`` that is not a refusal's input."""
    tree = ast.parse(source)
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and _machine_path(node.value)):
            continue
        up: ast.AST | None = node
        while up is not None and not _refusal_context(up):
            up = parents.get(up)
        if up is None:
            found.append((node.lineno, node.value))
    return sorted(found)


def _sources() -> list[Path]:
    """Every scanned module but this one (its literals are the roots and the control samples)."""
    me = Path(__file__).resolve()
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py") if p.resolve() != me)


def test_no_test_or_benchmark_reads_a_fixed_machine_path() -> None:
    offenders = [f"{p.relative_to(ROOT)}:{line}: {value!r}" for p in _sources()
                 for line, value in fixed_path_reads(p.read_text())]
    assert offenders == [], "read what a fixture or the test made (tmp_path, tiny_models), not:\n" + "\n".join(offenders)


def test_the_guard_sees_a_test_that_names_tmp_tiny() -> None:
    """The guard can fail: the two preview tests that broke CI on a fresh machine, in the shapes they had,
    and the other shapes a fixed path takes (a Path root joined later, an f-string, a default argument)."""
    broken = '''
TINY = "/tmp/tiny"
MODEL = Path("/tmp/tiny") / "sd-t2i"
ROOT = Path("/root") / ".cache"

def test_x(job_store):
    runner = LocalRunner("sd-t2i", f"/home/dev/models/{name}")

def helper(models="/work/models"):
    return models
'''
    assert [v for _, v in fixed_path_reads(broken)] == ["/tmp/tiny", "/tmp/tiny", "/root", "/home/dev/models/",
                                                        "/work/models"]


def test_inputs_that_test_a_refusal_are_not_reads() -> None:
    refusals = '''
BAD = [([{"name": "ink", "path": "/tmp/x.safetensors"}], "must be")]

def test_refuses(sd):
    bad = [[{"path": "/tmp/x"}], [{"name": "/root/.ssh/id_rsa"}]]
    with pytest.raises(InvalidRequest):
        sd.resolve_params({"lora": [{"path": "/home/x"}]})

@pytest.mark.parametrize("traversal", ["/tmp/../etc/passwd"])
def test_traversal(traversal):
    pass
'''
    assert fixed_path_reads(refusals) == []
    assert fixed_path_reads('path = "/etc/passwd"\nname = "tmp/x"\nurl = "http://h/tmp/x"\n') == []
