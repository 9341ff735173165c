"""The executor classes are readable without torch: what a stage loads is declared on its class, and the
processes that only read declarations (the Proxy, the Node Manager, the CLI's help) stay light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.lazy import LazyModule

REPO_ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "diffusers", "transformers")

# every executor of every registered spec, imported in a fresh interpreter: a heavy module listed is one an
# executor module (or what it imports at its top) pulled in
IMPORT_ALL = f"""
import json, sys
from engine.stages.registry import executor_class
from engine.workflow import get_workflow, workflows
named = [(w, s.name, executor_class(w, s.name).__name__) for w in workflows() for s in get_workflow(w).stages]
print(json.dumps({{"executors": len(named), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def test_every_executor_imports_without_torch_diffusers_or_transformers() -> None:
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["executors"] >= 30  # every stage of the nine workflows
    assert got["heavy"] == []


def test_a_lazy_module_imports_at_first_use_and_then_is_the_module_itself() -> None:
    """The stand-in costs nothing after the first read: it puts the real module in its place."""
    sys.modules.pop("colorsys", None)
    namespace: dict[str, object] = {}
    exec("from engine.lazy import lazy\ncolorsys = lazy('colorsys')", namespace)
    assert isinstance(namespace["colorsys"], LazyModule) and "colorsys" not in sys.modules
    assert namespace["colorsys"].rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)  # type: ignore[attr-defined]
    assert namespace["colorsys"] is sys.modules["colorsys"]
    exec("import sys\nfrom engine.lazy import lazy\nagain = lazy('colorsys')", namespace)
    assert namespace["again"] is sys.modules["colorsys"]  # imported already: the module, no stand-in
