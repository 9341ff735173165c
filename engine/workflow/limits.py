"""Limits and defaults of a workflow's parameters, derived from the model folder it loads.

A spec's static bounds are what the published weights allow (Wan2.1: 1280 px,
129 frames); the model a deployment loads may allow less. The tiny Wan
transformer that ``onepiece models make-tiny`` writes has ``rope_max_seq_len:
32``: more than 32 latent patches per axis fails inside the model with
``RuntimeError: shape '[1, 1, 52, -1]' is invalid``. So every process that
checks a request binds the spec to the loaded model's limits first
(:meth:`engine.workflow.spec.WorkflowSpec.bound`), and the request is refused
at intake naming the field, instead of failing in a stage.

The limits are computed from the components' ``config.json`` files (JSON
only, no torch), by the process that has the model folder (the TaskManager,
which publishes them with its instances' routes), and reach the Proxy and the
web platform with the routes.

``Overrides`` maps a parameter name to the keys of :class:`engine.workflow.spec.ParamSpec`
it replaces (``default``, ``maximum``) plus ``why``: the model fact behind it. The same document carries
the model's dimensions of the spec's value shapes (``C_lat``: the VAE's latent channels, ``D_text``: the text
encoder's width...), as ``{name: {"value": n, "why": ...}}`` entries (:data:`DIM_KEY`), so that the Proxy's
:meth:`engine.workflow.spec.WorkflowSpec.hop_bytes` is exact and a request whose hop would not fit a ring is
refused at intake.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Overrides = dict[str, dict[str, Any]]
Configs = Mapping[str, Mapping[str, Any]]
# A model folder may say which request it serves by default (``{"defaults": {param: value}, "why": ...}``):
# the tiny random-weight models do, so that the default clip runs in seconds on a CPU (the pipeline's
# 832x480 would take minutes there), as a published model's own config names its native sample size.
SERVING_FILE = "serving.json"
# the key of a model dimension's entry (its names are the shapes' dimensions, never a parameter's)
DIM_KEY = "value"


def serving_defaults(folder: str | Path) -> dict[str, Any]:
    """The folder's declared defaults (:data:`SERVING_FILE`), {} when it declares none."""
    try:
        doc = json.loads((Path(folder) / SERVING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    found = doc.get("defaults") if isinstance(doc, dict) else None
    return {str(k): v for k, v in found.items() if isinstance(v, int) and not isinstance(v, bool)} \
        if isinstance(found, dict) else {}


def with_defaults(overrides: Overrides, defaults: Mapping[str, int]) -> Overrides:
    """``overrides`` with the declared defaults, each kept within its (model) maximum."""
    out: Overrides = {k: dict(v) for k, v in overrides.items()}
    for name, value in defaults.items():
        entry = out.setdefault(name, {})
        entry["default"] = min(value, entry["maximum"]) if "maximum" in entry else value
    return out


def dim_entries(dims: Mapping[str, int]) -> Overrides:
    """The overrides' entries of a model's dimensions (positive whole numbers only)."""
    return {name: {DIM_KEY: int(v), "why": "the loaded model's config"}
            for name, v in dims.items() if _whole(v) is not None and int(v) > 0}


def dims_of(overrides: Mapping[str, Mapping[str, Any]] | None) -> dict[str, int]:
    """The model dimensions among ``overrides``."""
    return {k: int(v[DIM_KEY]) for k, v in (overrides or {}).items() if isinstance(v, Mapping) and DIM_KEY in v}


def read_configs(folder: str | Path, components: list[str]) -> dict[str, dict[str, Any]]:
    """component -> its ``config.json`` (or ``scheduler_config.json``, ``tokenizer_config.json``) under ``folder``;
    missing ones are left out."""
    out: dict[str, dict[str, Any]] = {}
    for name in components:
        for file in ("config.json", "scheduler_config.json", "tokenizer_config.json"):
            path = Path(folder) / name / file
            if path.is_file():
                try:
                    out[name] = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                break
    return out


def tighten(overrides: Overrides, name: str, maximum: int, why: str) -> None:
    """Lower ``name``'s maximum to ``maximum`` (never raise it), recording why."""
    entry = overrides.setdefault(name, {})
    if "maximum" not in entry or maximum < entry["maximum"]:
        entry["maximum"] = maximum
        entry["why"] = why


def fit_default(default: int, maximum: int, multiple: int) -> int:
    """``default`` rounded down to a multiple of ``multiple``, and at most ``maximum``."""
    return max(multiple, min(default, maximum) // multiple * multiple)


def merge(a: Overrides | None, b: Overrides | None) -> Overrides | None:
    """The stricter of two overrides (instances of one workflow that loaded different folders)."""
    if not a or not b:
        return a or b
    out: Overrides = {k: dict(v) for k, v in a.items()}
    for name, entry in b.items():
        if "maximum" in entry:
            tighten(out, name, int(entry["maximum"]), str(entry.get("why", "")))
        if "default" in entry:
            cur = out.setdefault(name, {})
            cur["default"] = min(cur.get("default", entry["default"]), entry["default"])
        if DIM_KEY in entry:  # folders that differ: the larger, so a hop's size is never under-counted
            cur = out.setdefault(name, {})
            cur[DIM_KEY] = max(int(cur.get(DIM_KEY, entry[DIM_KEY])), int(entry[DIM_KEY]))
            cur.setdefault("why", str(entry.get("why", "")))
    return out


def _whole(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return int(value) if float(value).is_integer() else None


def parse(raw: Any) -> Overrides | None:
    """Overrides as published (JSON: whole numbers, ints or integral floats), or None when the document is
    not a mapping of mappings. An entry that does not parse is left out, so where a publisher's document
    is malformed the spec's own bounds apply to that parameter (and the stage refuses what its model cannot
    run, as ``stage_failed``): never a 500 at intake. Readers log a malformed document."""
    if not isinstance(raw, dict):
        return None
    out: Overrides = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            return None
        kept = {k: v for k in ("default", "maximum", DIM_KEY) if (v := _whole(entry.get(k))) is not None}
        if kept:
            out[str(name)] = {**kept, "why": str(entry.get("why", ""))}
    return out
