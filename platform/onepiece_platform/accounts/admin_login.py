"""The admin's sign-in, with failed attempts limited per client address like API keys' (429 + Retry-After).

Django's admin has no throttle of its own: a password could be guessed at
whatever rate the server answers. Failures count in the same Redis counter as
failed API-key authentications (onepiece_platform.accounts.authentication).
With Redis away the limit cannot be read, so a sign-in (POST) is answered 503
with Retry-After before any password is checked: never a 500, and never an
unlimited guess.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse

from engine.store import outage
from onepiece_platform.accounts.authentication import failure_wait, record_failure


def _store_down() -> HttpResponse:
    return HttpResponse("the sign-in limit's store is unavailable; retry shortly\n", status=503,
                        content_type="text/plain", headers={"Retry-After": str(outage.RETRY_AFTER_S)})


def throttled_login(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
    if request.method == "POST":
        try:
            wait = failure_wait(request)
        except outage.UNAVAILABLE:
            return _store_down()
        if wait is not None:
            return HttpResponse("too many failed sign-ins from this address; retry later\n", status=429,
                                content_type="text/plain", headers={"Retry-After": str(wait)})
    response = admin.site.login(request, extra_context)
    if request.method == "POST" and response.status_code == 200:  # the form again: the sign-in failed
        try:
            record_failure(request)
        except outage.UNAVAILABLE:  # gone since the check: the failure must count, so it is not answered
            return _store_down()
    return response
