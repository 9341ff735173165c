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


def test_the_spec_lists_no_components_and_the_adapter_table_is_the_executors() -> None:
    """What a stage loads is said once, on its executor: the spec has no list of its own for a consumer to
    read, and the adapter registry's table of adaptable workflows is what the executors declare."""
    from dataclasses import fields

    from engine.adapters.registry import ADAPTABLE
    from engine.stages.registry import adaptable
    from engine.workflow.spec import StageSpec

    assert "components" not in {f.name for f in fields(StageSpec)}
    assert adaptable() == ADAPTABLE


def test_each_executor_loads_from_a_folder_holding_only_what_it_declares(tiny_models: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """An executor that loaded (or read the config of) a component it does not declare fails here: its folder
    holds only its ``components`` and ``reads`` (and the folder's model_index.json)."""
    from engine.stages.registry import executor_class
    from engine.workflow import get_workflow, workflows

    seen: set[tuple[type, str]] = set()
    for w in sorted(workflows()):
        for s in get_workflow(w).stages:
            cls = executor_class(w, s.name)
            declared = tuple(dict.fromkeys((*cls.components, *cls.reads)))
            if not declared or (cls, w) in seen:
                continue
            seen.add((cls, w))
            folder = tmp_path / f"{w}-{s.name}"
            folder.mkdir()
            (folder / "model_index.json").symlink_to(tiny_models[w] / "model_index.json")
            for c in declared:
                (folder / c).symlink_to(tiny_models[w] / c, target_is_directory=True)
            ex = cls()
            ex.served_workflow = w
            ex.load(folder, "cpu")
    assert len(seen) >= 25


def test_the_routes_default_workflows_are_the_specs_that_declare_them() -> None:
    from engine.workflow import default_workflow, workflows
    from engine.workflow.registry import takes_image

    for output, image in (("image", False), ("video", True), ("video", False)):
        spec = workflows()[default_workflow(output, image)]
        assert spec.default and spec.final_output == output and takes_image(spec) == image
