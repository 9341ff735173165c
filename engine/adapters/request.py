"""A request's ``lora`` field: at most :data:`MAX_PER_REQUEST` registered adapters of its workflow, with scales.

``[{"name": "ghibli", "scale": 0.8}, ...]`` resolves to
``[{"name": "ghibli", "scale": 0.8, "digest": "<sha256>"}, ...]``: what the
request carries in its parameters to the denoise stage (which loads by name and
checks the digest) and to the ledger. Every refusal is a :class:`LoraRefused`
on the field ``lora`` (which the workflow spec's parameter check answers as its
``InvalidRequest``: this module knows no spec), raised before any work: not a list, too many, an entry that is not ``{name[, scale]}``,
a name that is not a registry name (so a path, ``../``, an absolute path or a
URL never reaches a file system), an unknown name, another workflow's adapter,
a scale out of range, the same adapter twice, or a digest that is no longer the
registry's (the adapter was replaced after the platform resolved the request).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engine.adapters.registry import ADAPTABLE, AdapterError, AdapterStore, check_name, check_scale, store

MAX_PER_REQUEST = 4
FIELD = "lora"


class LoraRefused(AdapterError):
    """A request's ``lora`` field refused (see the module docstring); ``field`` is ``lora``."""


def resolve_lora(workflow: str, value: Any, adapters: AdapterStore | None = None) -> list[dict[str, Any]]:
    """The resolved adapter list of a request (see the module docstring); ``[]`` for None or an empty list."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise LoraRefused(FIELD, 'lora must be a list of {"name": ..., "scale": ...} objects')
    if not value:
        return []
    if workflow not in ADAPTABLE:
        raise LoraRefused(FIELD, f"workflow {workflow!r} takes no lora adapters")
    if len(value) > MAX_PER_REQUEST:
        raise LoraRefused(FIELD, f"lora names {len(value)} adapters; at most {MAX_PER_REQUEST} per request")
    reg = adapters or store()
    out: list[dict[str, Any]] = []
    for i, entry in enumerate(value):
        where = f"lora[{i}]"
        if not isinstance(entry, dict) or "name" not in entry or set(entry) - {"name", "scale", "digest"}:
            raise LoraRefused(FIELD, f'{where} must be {{"name": ..., "scale": ...}}')
        try:
            name = check_name(entry["name"], FIELD)
        except AdapterError as exc:
            raise LoraRefused(FIELD, f"{where}: {exc}") from None
        adapter = reg.get(name)
        if adapter is None:
            raise LoraRefused(FIELD, f"{where}: no adapter named {name!r} (GET /v1/adapters lists them)")
        if adapter.workflow != workflow:
            raise LoraRefused(FIELD, f"{where}: adapter {name!r} is for {adapter.workflow}, not {workflow}")
        try:
            scale = check_scale(entry.get("scale", adapter.scale_default), FIELD)
        except AdapterError as exc:
            raise LoraRefused(FIELD, f"{where}: {exc}") from None
        if "digest" in entry and entry["digest"] != adapter.digest:
            raise LoraRefused(FIELD, f"{where}: adapter {name!r} was replaced since this request was resolved")
        if any(o["name"] == name for o in out):
            raise LoraRefused(FIELD, f"{where}: adapter {name!r} is named twice")
        out.append({"name": name, "scale": scale, "digest": adapter.digest})
    return out


def adapter_set(lora: Iterable[Mapping[str, Any]]) -> tuple[tuple[str, float, str], ...]:
    """A request's resolved ``lora`` (its options', engine.workflow.options) as a hashable key:
    ((name, scale, digest), ...) in order."""
    return tuple((e["name"], float(e["scale"]), e["digest"]) for e in lora)
