"""Static files in production: collectstatic into STATIC_ROOT, served by WhiteNoise with DEBUG off."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]


def _get(path: str, **headers: str) -> tuple[str, dict[str, str], bytes]:
    """One request through the real WSGI application (middleware built afresh from the settings)."""
    from wsgiref.util import setup_testing_defaults

    from django.core.handlers.wsgi import WSGIHandler

    environ: dict[str, Any] = {"PATH_INFO": path, "REQUEST_METHOD": "GET", "HTTP_HOST": "testserver"}
    environ.update({f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()})
    setup_testing_defaults(environ)
    environ["wsgi.input"] = io.BytesIO()
    seen: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen["status"], seen["headers"] = status, dict(hdrs)

    body = b"".join(WSGIHandler()(environ, start_response))
    return seen["status"], seen["headers"], body


@pytest.mark.django_db
def test_collected_dashboard_assets_are_served_with_debug_off(settings: Any, tmp_path: Path) -> None:
    from django.core.management import call_command

    settings.DEBUG = False
    settings.ALLOWED_HOSTS = ["testserver"]
    settings.STATIC_ROOT = tmp_path / "static"
    settings.WHITENOISE_USE_FINDERS = False  # production: only what collectstatic put in STATIC_ROOT
    settings.STATIC_ROOT.mkdir()
    status, _, _ = _get("/static/onepiece/dashboard.js")
    assert status.startswith("404")  # nothing collected yet: Django itself never serves static files

    call_command("collectstatic", "--noinput", verbosity=0)
    source = (REPO_ROOT / "frontend/static/onepiece/dashboard.js").read_bytes()
    assert (settings.STATIC_ROOT / "onepiece/dashboard.js").read_bytes() == source
    status, headers, body = _get("/static/onepiece/dashboard.js")
    assert status.startswith("200") and body == source
    assert "javascript" in headers["Content-Type"]
    status, headers, body = _get("/static/onepiece/dashboard.js", accept_encoding="gzip")
    assert status.startswith("200") and headers.get("Content-Encoding") == "gzip"  # compressed at collect time
    import gzip

    assert gzip.decompress(body) == source
    status, _, _ = _get("/static/onepiece/dashboard.css")
    assert status.startswith("200")
