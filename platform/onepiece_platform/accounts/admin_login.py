"""The admin's sign-in, with failed attempts limited per client address like API keys' (429 + Retry-After).

Django's admin has no throttle of its own: a password could be guessed at
whatever rate the server answers. Failures count in the same Redis counter as
failed API-key authentications (onepiece_platform.accounts.authentication).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse

from onepiece_platform.accounts.authentication import failure_wait, record_failure


def throttled_login(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
    if request.method == "POST":
        wait = failure_wait(request)
        if wait is not None:
            return HttpResponse("too many failed sign-ins from this address; retry later\n", status=429,
                                content_type="text/plain", headers={"Retry-After": str(wait)})
    response = admin.site.login(request, extra_context)
    if request.method == "POST" and response.status_code == 200:  # the form again: the sign-in failed
        record_failure(request)
    return response
