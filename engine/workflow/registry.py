"""Workflow name -> spec, discovered from the modules in :mod:`engine.workflow.specs`."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from engine import envs
from engine.workflow import specs
from engine.workflow.spec import InvalidRequest, WorkflowSpec


@cache
def workflows() -> dict[str, WorkflowSpec]:
    """Every workflow spec, keyed by name (each graph validated once)."""
    found: dict[str, WorkflowSpec] = {}
    for info in pkgutil.iter_modules(specs.__path__):
        module = importlib.import_module(f"{specs.__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, WorkflowSpec):
            spec.validate_graph()
            if spec.name in found:
                raise ValueError(f"two workflow specs named {spec.name!r}")
            found[spec.name] = spec
    # benchmarks only (ONEPIECE_BENCH_WORKFLOWS): workflows no user deployment offers, e.g. the single-stage sd-t2i
    for path in filter(None, (m.strip() for m in (envs.BENCH_WORKFLOWS or "").split(","))):
        spec = importlib.import_module(path).SPEC
        spec.validate_graph()
        if spec.name in found:
            raise ValueError(f"two workflow specs named {spec.name!r}")
        found[spec.name] = spec
    return found


def get_workflow(name: str) -> WorkflowSpec:
    """The spec named ``name``; ``KeyError`` listing the known names otherwise."""
    try:
        return workflows()[name]
    except KeyError:
        raise KeyError(f"unknown workflow {name!r}; known: {', '.join(sorted(workflows()))}") from None


def takes_image(spec: WorkflowSpec) -> bool:
    """Whether a request must give the workflow an image (a request input that is an image file and not
    optional)."""
    return any(t.media == "image" and not t.optional for t in spec.request_inputs)


def default_workflow(output: str, image: bool = False) -> str:
    """The workflow a request for ``output`` (a spec's ``final_output``: ``"image"``, ``"video"``) gets when it
    names none: the one spec declaring ``default`` among those ending in ``output`` that take an image iff
    ``image``. ``LookupError`` when none or several do."""
    found = [s.name for s in workflows().values() if s.default and s.final_output == output and takes_image(s) == image]
    if len(found) != 1:
        raise LookupError(f"{len(found)} workflows declare themselves the default for {output!r} "
                          f"{'with' if image else 'without'} an image: {found}")
    return found[0]


def request_workflow(name: object) -> WorkflowSpec:
    """The spec a request names; :class:`InvalidRequest` on field ``workflow`` otherwise (for APIs)."""
    if not isinstance(name, str) or name not in workflows():
        raise InvalidRequest("workflow", f"unknown workflow {name!r}; known: {', '.join(sorted(workflows()))}")
    return workflows()[name]
