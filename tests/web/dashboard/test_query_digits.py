"""The dashboard's whole-number query values (``limit``, ``minutes``, ``step``) take ASCII digits only:
``int()`` also reads full-width ``１０``, which is a 400 naming the value (issue 39, finding 7)."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def _staff() -> Client:
    from django.contrib.auth import get_user_model

    c = Client()
    c.force_login(get_user_model().objects.create_user("ops", password="pw", is_staff=True))
    return c


def test_full_width_digits_in_the_dashboards_query_are_refused() -> None:
    c = _staff()
    assert c.get("/dashboard/api/jobs", {"limit": "10"}).status_code == 200
    for path, query in (("/dashboard/api/jobs", {"limit": "１０"}), ("/dashboard/api/traffic", {"minutes": "１０"}),
                        ("/dashboard/api/traffic", {"step": "１０"})):
        r = c.get(path, query)
        assert r.status_code == 400, (path, query, r.status_code)
        assert next(iter(query)) in r.json()["error"], r.json()
