"""An operator action's body that is not a JSON object, or is nested past the parser's stack, is a 400
(issue 25: each was a 500), and nothing is recorded."""

from __future__ import annotations

import pytest
from django.test import Client

from onepiece_platform.engine_link.models import OperatorAction

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("body", ["[]", '[{"action": "drain_node"}]', "null", '"drain_node"', "7", "true",
                                  "[" * 100_000 + "]" * 100_000,
                                  '{"action": "drain_node", "args": ' + "[" * 100_000 + "]" * 100_000 + "}",
                                  b'{"action": "\xff"}'],
                         ids=["list", "list-of-object", "null", "string", "number", "bool", "deep", "deep-args",
                              "not-utf8"])
def test_an_action_body_that_is_not_a_json_object_is_400(body: str | bytes) -> None:
    from django.contrib.auth import get_user_model

    c = Client()
    c.force_login(get_user_model().objects.create_user("ops", password="pw", is_staff=True))
    r = c.post("/dashboard/api/actions", body, content_type="application/json")
    assert r.status_code == 400, r.content[:200]
    assert r.json()["error"]
    assert not OperatorAction.objects.exists()
