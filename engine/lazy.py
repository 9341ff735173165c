"""Modules imported on first use: ``torch = lazy("torch")``.

The stage executors' modules name torch at their top, yet the processes that only read an executor's
declarations (the components it loads, for the stage pools' digests; the workflows the CLI lists) must stay
light: the Proxy and the Node Manager never load torch. :func:`lazy` returns a stand-in module whose first
attribute read imports the real one and puts it in the stand-in's place in the namespace of the module that
called :func:`lazy`, so every later read there is a plain global read of the real module (no cost per access
after the first). Type checkers see the real module::

    if TYPE_CHECKING:
        import torch
    else:
        torch = lazy("torch")

A module using it must not touch the stand-in while its body runs (no ``@torch.no_grad()`` on a method, no
``torch.float32`` as a default argument): that would import the real module at once.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class LazyModule(types.ModuleType):
    """A stand-in for the module ``__name__``, imported at the first attribute read (see the module docstring)."""

    def __init__(self, name: str, namespace: dict[str, Any]) -> None:
        super().__init__(name)
        self.__dict__["_lazy_namespace"] = namespace

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        namespace = self.__dict__["_lazy_namespace"]
        for key, value in list(namespace.items()):
            if value is self:
                namespace[key] = module
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__name__!r}>"


def lazy(name: str) -> Any:
    """``name`` itself when it is imported already, else a :class:`LazyModule` bound to the caller's globals."""
    if name in sys.modules:
        return sys.modules[name]
    return LazyModule(name, sys._getframe(1).f_globals)
