"""Parsing and validating a submission: pure, synchronous, CPU-bound (the Proxy runs it in a thread).

Everything here refuses with :class:`BadRequest` (400, or 413 for sizes)
naming the field, never with an unexpected exception: malformed JSON, JSON
nested deeper than Python's recursion limit, ``NaN``/``Infinity`` (not JSON,
though Python's parser takes them), bytes that are not UTF-8, unknown
top-level fields, bad base64, images that are not images or are too large
(:func:`engine.workflow.images.check_image`), and parameters outside the
workflow spec's limits.
"""

from __future__ import annotations

import base64
import binascii
import email.message
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from engine.workflow import InvalidRequest, WorkflowSpec, request_workflow
from engine.workflow.images import ImageTooLarge, check_image

FIELDS = frozenset({"workflow", "params", "inputs", "deadline_s", "priority", "uid"})
MAX_DEADLINE_S = 7 * 86400.0
MAX_PRIORITY = 1000
MAX_PARTS = 16
MAX_NAME_CHARS = 64


class BadRequest(Exception):
    """A refusal naming the offending field; ``status`` 400, or 413 for sizes."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


@dataclass
class Submission:
    spec: WorkflowSpec
    params: dict[str, Any]
    inputs: dict[str, bytes]
    deadline: float | None  # absolute (epoch seconds)
    priority: int
    uid: str | None  # caller-supplied (32 lowercase hex), or None: the Proxy draws one


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


def parse(body: bytes, content_type: str, max_image_bytes: int, max_image_pixels: int) -> Submission:
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
        if len(value) > (max_image_bytes + 2) // 3 * 4:
            raise BadRequest(name, f"input {name!r} is over {max_image_bytes} bytes", 413)
        try:
            inputs[name] = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(name, f"input {name!r} is not valid base64") from None
    try:
        spec = request_workflow(doc.get("workflow"))
        params = doc.get("params") or {}
        if not isinstance(params, dict):
            raise BadRequest("params", "params must be an object")
        resolved = spec.validate_request(params, inputs)
        for t in spec.request_inputs:
            if t.name == "image":
                check_image(inputs["image"], "image", max_image_bytes, max_image_pixels)
    except ImageTooLarge as exc:
        raise BadRequest(exc.field, str(exc), 413) from None
    except InvalidRequest as exc:
        raise BadRequest(exc.field, str(exc)) from None
    deadline_s = doc.get("deadline_s")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or not math.isfinite(deadline_s) or not 0 < deadline_s <= MAX_DEADLINE_S):
        raise BadRequest("deadline_s", f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:.0f}]")
    priority = doc.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) > MAX_PRIORITY:
        raise BadRequest("priority", f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    uid = doc.get("uid")
    if uid is not None and not is_uid(uid):
        raise BadRequest("uid", "uid must be 32 lowercase hex digits")
    deadline = time.time() + float(deadline_s) if deadline_s else None
    return Submission(spec, resolved, inputs, deadline, priority, uid)


def largest(values: dict[str, Any]) -> str:
    """The name of the value whose JSON is longest (the field to blame for an oversized header)."""
    return max(values, key=lambda k: len(json.dumps(values[k])), default="params")
