"""The debug error page (onepiece up --debug) shows no service URL: they carry passwords."""

from __future__ import annotations

from typing import Any

from django.views.debug import get_default_exception_reporter_filter


def test_service_urls_are_hidden_from_the_debug_page(settings: Any) -> None:
    settings.ETCD_URL = "http://onepiece:s3cret@127.0.0.1:2379"
    settings.REDIS_URL = "redis://:s3cret@127.0.0.1:6379/0"
    shown = get_default_exception_reporter_filter().get_safe_settings()
    assert "s3cret" not in repr(shown)
    assert shown["ETCD_URL"] == shown["REDIS_URL"] == "********************"
    assert shown["DEBUG"] is False  # other settings are still shown
