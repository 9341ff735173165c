"""Content negotiation for endpoints that return bytes: errors are JSON whatever the client accepts.

A download client sends ``Accept: application/octet-stream`` (or video/mp4);
DRF would answer its JSON error with 406 instead of the real 404/409/410.
"""

from __future__ import annotations

from typing import Any

from rest_framework.negotiation import BaseContentNegotiation


class BytesOrJsonNegotiation(BaseContentNegotiation):
    def select_parser(self, request: Any, parsers: list[Any]) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Any, renderers: list[Any], format_suffix: str | None = None) -> tuple[Any, str]:
        return renderers[0], renderers[0].media_type
