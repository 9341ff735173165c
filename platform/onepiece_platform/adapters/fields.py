"""The ``lora`` request field of the native and OpenAI-compatible routes: parsed here, checked by the engine."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from onepiece_platform.strict import loads

LORA_HELP = ('LoRA adapters to apply: [{"name": ..., "scale": ...}], at most 4, names from GET /v1/adapters of '
             "this workflow (scale: default the adapter's; the openai client sends it in extra_body)")


_LORA_SCHEMA = {
    "type": "array", "maxItems": 4,
    "items": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9_.-]{0,63}$",
                 "description": "a registered adapter of this workflow (GET /v1/adapters)"},
        "scale": {"type": "number", "minimum": -4, "maximum": 4,
                  "description": "its weight (default: the adapter's scale_default)"}}},
}


@extend_schema_field(_LORA_SCHEMA)
class LoraField(serializers.Field):
    """A list of ``{"name", "scale"}`` objects; in a multipart form, the same list as a JSON string. The content
    (names, workflow, scales, count) is checked where every request is: the workflow spec
    (engine.adapters.request.resolve_lora), which answers 400 naming ``lora``."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("help_text", LORA_HELP)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str):
            if len(data) > 4000:
                raise serializers.ValidationError("lora is too long")
            try:
                data = loads(data)  # deep nesting, NaN, Infinity: ValueError too (a RecursionError was a 500)
            except ValueError:
                raise serializers.ValidationError('lora must be a JSON list of {"name": ..., "scale": ...}') from None
        if not isinstance(data, list):
            raise serializers.ValidationError('lora must be a list of {"name": ..., "scale": ...}')
        return data

    def to_representation(self, value: Any) -> Any:
        return value


def lora_from_form(data: Any) -> Any:
    """A multipart form's ``lora`` as the openai client sends a list of objects in ``extra_body`` (fields
    ``lora[][name]`` and ``lora[][scale]``, in order) folded back into one ``lora`` list; other forms as they
    are. Entries pair up by position, so either every entry has a scale or none has; else the same 400 as any
    bad ``lora`` (a client can always send the list as one JSON string field)."""
    keys = [k for k in getattr(data, "keys", lambda: [])() if str(k).startswith("lora[")]
    if not keys or not hasattr(data, "getlist"):
        return data
    names, scales = data.getlist("lora[][name]"), data.getlist("lora[][scale]")
    if set(keys) - {"lora[][name]", "lora[][scale]"} or (scales and len(scales) != len(names)) or "lora" in data:
        raise serializers.ValidationError({"lora": ['in a form, send lora as lora[][name] and lora[][scale] for every '
                                                    'entry, or as one JSON string']})

    def number(v: str) -> Any:
        if not v.isascii():  # float() also reads full-width digits ("０.５"): left as text, refused as a scale
            return v
        try:
            return float(v)
        except ValueError:
            return v

    out = {k: v for k, v in data.items() if k not in keys}
    for k in data:  # files and repeated fields as the parser gave them
        if k not in keys and len(data.getlist(k)) > 1:
            out[k] = data.getlist(k)
    out["lora"] = [{"name": n, **({"scale": number(s)} if scales else {})}
                   for n, s in zip(names, scales or [None] * len(names), strict=True)]
    return out
