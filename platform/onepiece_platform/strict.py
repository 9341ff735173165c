"""Input strictness shared by the APIs: JSON that cannot hurt the parser, and no unknown fields.

* :class:`StrictJSONParser`: DRF's parser (already refusing ``NaN`` and
  ``Infinity``) that also answers JSON nested deeper than Python's recursion
  limit with 400 instead of letting ``RecursionError`` become a 500.
* :func:`loads`: the same rules for JSON inside a form field (multipart ``params``).
* :class:`StrictMultiPartParser`, :class:`StrictFormParser`: DRF's, but a field
  (name or value) that is not UTF-8 is a 400 naming it. Django decodes form
  fields with ``errors="replace"``, so bad bytes became U+FFFD and the job was
  accepted with a prompt the client never sent.
* :class:`RefuseUnknownFields`: a serializer mixin; a misspelt or unsupported
  field is a 400 naming it, never silently ignored (a typo would otherwise fall
  back to a default the caller did not ask for).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import unquote_to_bytes

from django.utils.http import parse_header_parameters
from drf_spectacular.extensions import OpenApiSerializerExtension
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ParseError
from rest_framework.pagination import PageNumberPagination
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser


class StrictJSONParser(JSONParser):
    strict = True

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            return super().parse(stream, media_type, parser_context)
        except RecursionError:
            raise ParseError("JSON parse error - the body is nested too deeply") from None


def _utf8(name: bytes, value: bytes) -> None:
    """Both as UTF-8, or a 400 naming the field (its name shown with U+FFFD where it is not UTF-8)."""
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        shown = name.decode("utf-8", errors="replace")
        raise serializers.ValidationError({shown: ["the field's name is not valid UTF-8"]}) from None
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        raise serializers.ValidationError({name.decode(): ["not valid UTF-8"]}) from None


def _form_fields(raw: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(name, value) bytes of an urlencoded body, split as Django's QueryDict splits it."""
    for pair in raw.split(b"&"):
        if pair:
            name, _, value = pair.partition(b"=")
            yield unquote_to_bytes(name.replace(b"+", b" ")), unquote_to_bytes(value.replace(b"+", b" "))


def _multipart_fields(raw: bytes, media_type: str) -> Iterator[tuple[bytes, bytes]]:
    """(name, value) bytes of the non-file parts of a multipart body (files are bytes, not text)."""
    boundary = parse_header_parameters(media_type)[1].get("boundary", "")
    if not boundary:
        return  # Django's parser refuses it
    for part in raw.split(b"--" + boundary.encode("latin-1"))[1:]:
        head, sep, body = part.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        if not sep:
            continue  # the closing delimiter, or a malformed part Django's parser answers for
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.decode("latin-1").partition(":") for line in head.split(b"\r\n"))}
        params = parse_header_parameters(headers.get("content-disposition", ""))[1]
        if "filename" in params or "filename*" in params or "name" not in params:
            continue
        value = body.removesuffix(b"\r\n")
        if headers.get("content-transfer-encoding", "").lower() == "base64":
            try:
                value = base64.b64decode(value)
            except binascii.Error:
                continue  # Django keeps the text as sent
        name = params["name"]
        try:
            yield name.encode("latin-1"), value
        except UnicodeEncodeError:  # already decoded (RFC 2231 name*=utf-8''...)
            yield name.encode("utf-8"), value


class StrictFormParser(FormParser):
    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        raw = stream.read()
        for name, value in _form_fields(raw):
            _utf8(name, value)
        return super().parse(io.BytesIO(raw), media_type, parser_context)


class StrictMultiPartParser(MultiPartParser):
    """Reads the body once into memory to check its text fields (it is already bounded and buffered by the
    ASGI entry's BodyLimit), then parses it as DRF does."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        raw = stream.read() if stream is not None else b""
        for name, value in _multipart_fields(raw, media_type or ""):
            _utf8(name, value)
        return super().parse(io.BytesIO(raw), media_type, parser_context)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads(raw: str | bytes) -> Any:
    """Strict JSON (finite numbers only); ``ValueError`` for anything else, deep nesting included."""
    try:
        return json.loads(raw, parse_constant=_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


EMPTY_NAME = "(empty name)"  # how a field sent with an empty name is named in a refusal


class StrictCharField(serializers.CharField):
    """Text only: a JSON number or boolean is refused, not turned into its string (a prompt of ``42``)."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            raise serializers.ValidationError(f"must be a string, got {type(data).__name__}")
        return super().to_internal_value(data)


class StrictRegexField(StrictCharField, serializers.RegexField):
    pass


class AsciiIntegerField(serializers.IntegerField):
    """An integer written with ASCII digits: Python's ``int()`` also reads full-width and other Unicode
    digits (``６４``), which no client means to send."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, str) and not data.strip().lstrip("+-").isascii():
            self.fail("invalid")
        return super().to_internal_value(data)


class AsciiPageNumberPagination(PageNumberPagination):
    """DRF's page-number pagination reading ``page`` and ``page_size`` as ASCII digits only (Django's
    paginator and DRF's ``_positive_int`` call ``int()``, which reads ``２`` as 2): a page written otherwise
    is an invalid page (404, as ``page=abc``), a page size written otherwise is ignored (the default, as
    ``page_size=abc``)."""

    def get_page_number(self, request: Any, paginator: Any) -> Any:
        raw = request.query_params.get(self.page_query_param) or ""
        if not raw.isascii():
            raise NotFound("Invalid page: a page number is written in ASCII digits.")
        return super().get_page_number(request, paginator)

    def get_page_size(self, request: Any) -> Any:
        if self.page_size_query_param and not request.query_params.get(self.page_size_query_param, "").isascii():
            return self.page_size
        return super().get_page_size(request)


class AsciiFloatField(serializers.FloatField):
    """A number written with ASCII numerals: Python's ``float()`` also reads full-width and other Unicode
    digits (``６０``); a boolean is not a number either (``float(True)`` is 1.0)."""

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, bool) or (isinstance(data, str) and not data.isascii()):
            self.fail("invalid")
        return super().to_internal_value(data)


class RefuseUnknownFields(serializers.Serializer):
    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, Mapping):
            unknown = sorted(k for k in data if k not in self.fields)
            if unknown:
                # a field with an empty name is still named (an empty param would read as "no field")
                raise serializers.ValidationError({unknown[0] or EMPTY_NAME: [
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
