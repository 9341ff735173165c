"""The engine's ETA on the pages (issue 28 item 4), in chromium against the real ASGI app and the real Proxy
(whose jobs never run here): the owner's watch page shows "ETA ~Xs (p90 Ys) · provisional" from the job
socket's ``eta`` message and drops it when the job ends; the operator's job view shows it from the polled
job detail."""

from __future__ import annotations

import re
from typing import Any

from django.test import Client

from tests.browser.conftest import login, make_user, shot
from tests.fixtures.web import sd_body

ETA = re.compile(r"^ETA ~\d+(\.\d+)?s \(p90 \d+(\.\d+)?s\) · provisional")


def _submit(owner: Any) -> str:
    c = Client()
    c.force_login(owner)
    r = c.post("/api/v1/jobs", sd_body(), content_type="application/json")
    assert r.status_code == 202, r.content
    return str(r.json()["uid"])


def test_watch_page_and_job_view_show_the_eta(proxy_url: str, live_asgi: Any, browser: Any) -> None:
    from onepiece_platform.jobs import ledger

    owner = make_user("client", staff=False)
    make_user("ops", staff=True)
    uid = _submit(owner)
    session = Client()
    session.force_login(owner)
    ctx = browser.new_context(viewport={"width": 1200, "height": 900})
    try:
        ctx.add_cookies([{"name": "sessionid", "value": session.cookies["sessionid"].value, "url": live_asgi.url}])
        page = ctx.new_page()
        page.goto(f"{live_asgi.url}/jobs/{uid}/watch")
        page.wait_for_selector("#watch-eta:not([hidden])", timeout=10_000)
        text = page.inner_text("#watch-eta")
        assert ETA.match(text), text
        shot(page, "watch-eta")
        ledger.finish(uid, "cancelled", "cancelled by owner")  # the socket's job update: no ETA any more
        page.wait_for_selector("#watch-eta", state="hidden", timeout=10_000)
        assert "cancelled" in page.inner_text("#watch-state")

        other = _submit(owner)
        ops = ctx.browser.new_context(viewport={"width": 1700, "height": 900})
        page = ops.new_page()
        login(page, live_asgi.url, "ops")
        page.click('nav a[data-view="jobs"]')
        page.click(f'tr[data-uid="{other}"]', timeout=10_000)
        page.wait_for_selector("#job-eta:not([hidden])", timeout=10_000)
        text = page.inner_text("#job-eta")
        assert ETA.match(text), text
        shot(page, "job-eta")
        ops.close()
    finally:
        ctx.close()
