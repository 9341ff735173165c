"""Reading a request: the body (JSON or multipart), its fields, and its content checked against the spec.

:class:`Parser` is the first half of taking a request in (:class:`engine.proxy.intake.Intake` adds cost
and admission): everything here refuses with :class:`BadRequest` (400, 409 for a taken UID, or 413 for
sizes) naming the field, never with an unexpected exception: malformed JSON, JSON nested deeper than
Python's recursion limit, ``NaN``/``Infinity`` (not JSON, though Python's parser takes them), bytes that
are not UTF-8, unknown top-level fields, bad base64, missing or extra inputs, images that are not images
or are too large, and parameters outside the workflow spec's limits
(:meth:`engine.workflow.spec.WorkflowSpec.validate_request`). Pure and synchronous; holds no connection.
"""

from __future__ import annotations

import base64
import binascii
import email.message
import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from engine.dispatch import order
from engine.workflow import InvalidRequest, WorkflowSpec, images, request_workflow
from engine.workflow.images import ImageTooLarge
from engine.workflow.options import Options, deadline_of
from engine.workflow.request import Request

FIELDS = frozenset({"workflow", "params", "inputs", "deadline_s", "priority", "uid"})
MAX_PARTS = 16
MAX_NAME_CHARS = 64


class BadRequest(Exception):
    """A refusal naming the offending field; ``status`` 400, 409 for a taken UID, or 413 for sizes."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def _no_constant(name: str) -> Any:
    raise BadRequest("body", f"{name} is not a JSON number; send finite numbers only")


def loads(raw: bytes | str, field: str = "body") -> Any:
    """JSON, strictly: RFC 8259 numbers only, UTF-8 only, nesting bounded by the recursion limit."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except BadRequest as exc:
        raise BadRequest(field, str(exc)) from None
    except RecursionError:
        raise BadRequest(field, f"{field} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise BadRequest(field, f"{field} is not JSON: {exc}") from None


def is_uid(value: object) -> bool:
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def parse_multipart(body: bytes, content_type: str) -> tuple[Any, dict[str, bytes]]:
    """(the ``request`` part's JSON, {name: bytes} of the other parts) of a multipart/form-data body."""
    header = email.message.Message()
    header["Content-Type"] = content_type
    boundary = header.get_param("boundary")
    if not isinstance(boundary, str) or not boundary or len(boundary) > 200:
        raise BadRequest("body", "multipart body without a boundary")
    delim = b"\r\n--" + boundary.encode("latin-1")
    chunks = (b"\r\n" + body).split(delim)
    if len(chunks) < 3 or chunks[0]:
        raise BadRequest("body", "malformed multipart body")
    if len(chunks) > MAX_PARTS + 2:
        raise BadRequest("body", f"more than {MAX_PARTS} multipart parts")
    doc: Any = None
    inputs: dict[str, bytes] = {}
    seen: set[str] = set()
    for chunk in chunks[1:-1]:
        head, sep, content = chunk.partition(b"\r\n\r\n")
        if not sep or not head.startswith(b"\r\n"):
            raise BadRequest("body", "malformed multipart part")
        part = email.message.Message()
        for line in head[2:].decode("latin-1").split("\r\n"):
            key, colon, value = line.partition(":")
            if colon:
                part[key.strip()] = value.strip()
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS:
            raise BadRequest("body", "every multipart part needs a short name")
        if name in seen:
            raise BadRequest(name, f"multipart part {name!r} appears twice")
        seen.add(name)
        if name == "request":
            doc = loads(content, "request")
        else:
            inputs[name] = content
    if not chunks[-1].startswith(b"--"):
        raise BadRequest("body", "multipart body is not terminated")
    if doc is None:
        raise BadRequest("request", "multipart submissions need a 'request' JSON part")
    return doc, inputs


def largest(values: dict[str, Any]) -> str:
    """The name of the value whose JSON is longest (the field to blame for an oversized header)."""
    return max(values, key=lambda k: len(json.dumps(values[k])), default="params")


def taken() -> BadRequest:
    """The 409 of a caller-chosen UID that already names an accepted request."""
    return BadRequest("uid", "a request with this uid was already accepted", 409)


class Parser:
    """A request's body to a validated :class:`Request` (see the module's docstring). Thread-safe."""

    def __init__(self, max_image_bytes: int = images.MAX_BYTES, max_image_pixels: int = images.MAX_PIXELS,
                 limits: Callable[[str], Mapping[str, Mapping[str, Any]] | None] | None = None) -> None:
        """``limits(workflow)``: the loaded model's parameter limits (:mod:`engine.workflow.limits`; the
        Proxy's come with the routes), None where unknown: the spec's own apply."""
        self.max_image_bytes = max_image_bytes
        self.max_image_pixels = max_image_pixels
        self.limits = limits

    def spec(self, workflow: object) -> WorkflowSpec:
        """The spec a request names, bound to the loaded model's limits and defaults where known;
        :class:`BadRequest` naming ``workflow`` for an unknown one."""
        try:
            spec = request_workflow(workflow)
        except InvalidRequest as exc:
            raise BadRequest(exc.field, str(exc)) from None
        return spec.bound(self.limits(spec.name)) if self.limits is not None else spec

    def parse(self, body: bytes, content_type: str) -> Request:
        """A validated submission from a JSON or multipart body; raises :class:`BadRequest`."""
        if content_type.lower().startswith("multipart/"):
            doc, inputs = parse_multipart(body, content_type)
        else:
            doc, inputs = loads(body), {}
        if not isinstance(doc, dict):
            raise BadRequest("body", "the request must be a JSON object")
        unknown = sorted(set(doc) - FIELDS)
        if unknown:
            raise BadRequest(unknown[0], f"unknown field(s): {', '.join(unknown)}; known: {', '.join(sorted(FIELDS))}")
        raw = doc.get("inputs") or {}
        if not isinstance(raw, dict):
            raise BadRequest("inputs", "inputs must map names to base64 strings")
        for name, value in raw.items():
            if len(name) > MAX_NAME_CHARS or name in inputs:
                raise BadRequest("inputs", f"input name {name[:MAX_NAME_CHARS]!r} is too long or given twice")
            if not isinstance(value, str):
                raise BadRequest(name, f"input {name!r} must be a base64 string")
            if len(value) > (self.max_image_bytes + 2) // 3 * 4:
                raise BadRequest(name, f"input {name!r} is over {self.max_image_bytes} bytes", 413)
            try:
                inputs[name] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise BadRequest(name, f"input {name!r} is not valid base64") from None
        params = doc.get("params") or {}
        return self.submission(doc.get("workflow"), params, inputs, doc.get("deadline_s"),
                               doc.get("priority", order.DEFAULT), doc.get("uid"))

    def submission(self, workflow: object, params: object, inputs: dict[str, bytes], deadline_s: object = None,
                   priority: object = order.DEFAULT, uid: object = None) -> Request:
        """A validated submission from its parts; raises :class:`BadRequest`."""
        spec = self.spec(workflow)
        try:
            if not isinstance(params, dict):
                raise BadRequest("params", "params must be an object")
            resolved = spec.validate_request(params, inputs, self.max_image_bytes, self.max_image_pixels)
        except ImageTooLarge as exc:
            raise BadRequest(exc.field, str(exc), 413) from None
        except InvalidRequest as exc:
            raise BadRequest(exc.field, str(exc)) from None
        try:
            deadline_of(deadline_s)  # the deadline's refusal first, then the priority's (who may use which
            params, options = Options.split(resolved, priority, deadline_s)  # level is the platform's rule)
        except InvalidRequest as exc:
            raise BadRequest(exc.field, str(exc)) from None
        if uid is not None and not is_uid(uid):
            raise BadRequest("uid", "uid must be 32 lowercase hex digits")
        deadline = time.time() + options.deadline_s if options.deadline_s else None
        return Request(spec, params, inputs, options, deadline, uid if isinstance(uid, str) else None)
