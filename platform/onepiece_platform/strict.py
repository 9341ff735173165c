"""Input strictness shared by the APIs: JSON that cannot hurt the parser, and no unknown fields.

* :class:`StrictJSONParser`: DRF's parser (already refusing ``NaN`` and
  ``Infinity``) that also answers JSON nested deeper than Python's recursion
  limit with 400 instead of letting ``RecursionError`` become a 500.
* :func:`loads`: the same rules for JSON inside a form field (multipart ``params``).
* :class:`RefuseUnknownFields`: a serializer mixin; a misspelt or unsupported
  field is a 400 naming it, never silently ignored (a typo would otherwise fall
  back to a default the caller did not ask for).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from drf_spectacular.extensions import OpenApiSerializerExtension
from rest_framework import serializers
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser


class StrictJSONParser(JSONParser):
    strict = True

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: str | bytes) -> Any:
    """Strict JSON (finite numbers only); ``ValueError`` for anything else, deep nesting included."""
    try:
        return json.loads(raw, parse_constant=_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


class RefuseUnknownFields(serializers.Serializer):
    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(k for k in data if k not in self.fields)
            if unknown:
                raise serializers.ValidationError({unknown[0]: [
                    f"unknown field; known: {', '.join(sorted(self.fields))}"]})
        return super().to_internal_value(data)


class RefuseUnknownFieldsSchema(OpenApiSerializerExtension):
    """The OpenAPI schema says what :class:`RefuseUnknownFields` does: ``additionalProperties: false`` on
    request bodies, so generated clients and schema-driven testers do not send fields that are refused."""

    target_class = RefuseUnknownFields
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: str) -> dict[str, Any]:
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        if direction == "request":
            schema["additionalProperties"] = False
        return schema
