"""The operator dashboard in a real browser: staff see the cluster live; others are refused."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from django.test import Client

from engine.coord.keys import Keyspace
from tests.browser.conftest import login, make_user, shot

pytestmark = pytest.mark.timeout(60)
WF = "sd-t2i"
BOTTLENECK = f"document.querySelector('[data-workflow=\"{WF}\"] .stage.bottleneck')?.dataset.stage"
TIMES = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}
CPU = [{"kind": "cpu", "index": 0, "name": "16 CPU cores", "utilisation": 37.0, "memory_used": 3 << 30,
        "memory_total": 16 << 30, "temperature_c": None, "source": "cpu (no NVML: NVMLError_LibraryNotFound)"}]


def _instances(node: str, times: dict[str, float]) -> dict[str, dict[str, Any]]:
    return {f"{WF}.{s}.{node}": {"workflow": WF, "stage": s, "last_stage_s": t, "ready": True, "requests": 3,
                                 "utilisation": 0.5} for s, t in times.items()}


_user, _login = make_user, login


def test_staff_sees_the_cluster_live_and_acts(live_asgi, etcd_nodes, leader, browser) -> None:
    from onepiece_platform.jobs.models import Job

    etcd_nodes["put_node"]("n1", _instances("n1", TIMES), CPU)
    _user("ops", staff=True)
    owner = _user("client", staff=False)
    Job.objects.create(uid="a" * 32, owner=owner, workflow=WF, state="in_progress", stage="denoise", progress=40)
    Job.objects.create(uid="b" * 32, owner=owner, workflow=WF)
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    page = ctx.new_page()
    page.on("dialog", lambda d: d.accept())  # the confirmation every action asks for
    try:
        _login(page, live_asgi.url, "ops")
        page.wait_for_selector('#conn[data-state="live"]', timeout=10_000)
        node = page.wait_for_selector('[data-node="n1"]', timeout=10_000)
        assert "CPU figures (no GPU)" in node.inner_text()
        # the bottleneck the leading Node Manager published (its Theorem 1 allocation of 5 slots gives
        # denoise, the slowest stage, the spare one, and denoise stays the bottleneck)
        page.wait_for_function(f"{BOTTLENECK} === 'denoise'", timeout=10_000)
        shot(page, "cluster")

        # The cluster changes; the page follows without a reload (a reload would lose this marker).
        page.evaluate("window.__noReload = true")
        etcd_nodes["put_node"]("n2", _instances("n2", {**TIMES, "vae_decode": 1.2}), CPU)
        page.wait_for_selector('[data-node="n2"]', timeout=5_000)
        page.wait_for_function(
            f"document.querySelector('[data-workflow=\"{WF}\"] [data-stage=\"denoise\"] .count')"
            ".textContent === '2 instances'", timeout=5_000)
        # what the page marks and times is what the leader publishes now (never a figure of its own)
        deadline = time.monotonic() + 10
        while True:
            published = json.loads(etcd_nodes["client"].get(Keyspace(etcd_nodes["root"]).capacity(WF))[0])
            shown = page.evaluate(BOTTLENECK), page.inner_text(f'[data-workflow="{WF}"] [data-stage="vae_decode"] .service')
            if shown == (published["bottleneck"], f"service {published['service_s']['vae_decode']:.3f} s"):
                break
            assert time.monotonic() < deadline, (shown, published)
            time.sleep(0.2)
        assert page.evaluate("window.__noReload") is True
        shot(page, "cluster-updated")

        page.click('nav a[data-view="jobs"]')
        row = page.wait_for_selector(f'tr[data-uid="{"a" * 32}"]', timeout=5_000)
        assert "in_progress" in row.inner_text() and "denoise" in row.inner_text()
        assert "queued" in page.inner_text(f'tr[data-uid="{"b" * 32}"]')
        shot(page, "jobs")

        page.click('nav a[data-view="actions"]')
        page.select_option("#scale-form select[name=workflow]", WF)
        page.select_option("#scale-form select[name=stage]", "denoise")
        page.fill("#scale-form input[name=instances]", "3")
        page.click("#scale-form button")
        page.wait_for_function("document.getElementById('action-outcome').textContent.includes('accepted')",
                               timeout=10_000)
        audit_row = page.wait_for_selector("#actions-table tbody tr", timeout=5_000)
        assert "scale_stage" in audit_row.inner_text() and "ops" in audit_row.inner_text()
        assert leader.overrides.stages[f"{WF}/denoise"] == {"min": 3, "max": 3}
        shot(page, "actions")
    finally:
        ctx.close()


def test_reconnects_and_resyncs_jobs_from_rest(live_asgi, etcd_nodes, browser) -> None:
    from onepiece_platform.jobs.models import Job

    etcd_nodes["put_node"]("n1", _instances("n1", TIMES), CPU)
    _user("ops", staff=True)
    owner = _user("client", staff=False)
    page = browser.new_page()
    try:
        _login(page, live_asgi.url, "ops")
        page.wait_for_selector('#conn[data-state="live"]', timeout=10_000)
        page.evaluate("window.__noReload = true")
        live_asgi.stop()  # every websocket drops, as when the web process restarts
        page.wait_for_selector('#conn[data-state="reconnecting"]', timeout=5_000)
        Job.objects.create(uid="c" * 32, owner=owner, workflow=WF)  # happens while the page is cut off
        live_asgi.start()
        page.wait_for_selector('#conn[data-state="live"]', timeout=10_000)
        page.click('nav a[data-view="jobs"]')
        page.wait_for_selector(f'tr[data-uid="{"c" * 32}"]', timeout=5_000)
        assert page.evaluate("window.__noReload") is True
        shot(page, "reconnected-jobs")
    finally:
        page.close()


def test_non_staff_is_refused_page_api_and_websocket(live_asgi, browser) -> None:
    user = _user("client", staff=False)
    c = Client()
    c.force_login(user)
    ctx = browser.new_context()
    ctx.add_cookies([{"name": "sessionid", "value": c.cookies["sessionid"].value, "url": live_asgi.url}])
    page = ctx.new_page()
    try:
        page.goto(live_asgi.url + "/dashboard/")
        assert "/admin/login/" in page.url  # staff_member_required sends them to the admin's login
        status = page.evaluate("fetch('/dashboard/api/jobs').then(r => r.status)")
        assert status == 403
        # Accepted, then closed with 4403 before any message: the browser sees why (a refusal during the
        # handshake would reach it only as an abnormal close, 1006, like a dead server).
        seen = page.evaluate("""() => new Promise(done => {
            let opened = false;
            const ws = new WebSocket(`ws://${location.host}/ws/cluster`);
            ws.onopen = () => { opened = true; };
            ws.onmessage = () => done({opened, message: true});
            ws.onclose = (ev) => done({opened, code: ev.code});
        })""")
        assert seen == {"opened": True, "code": 4403}
        shot(page, "non-staff-refused")
    finally:
        ctx.close()
    _assert_handshake_refused(live_asgi.url, c.cookies["sessionid"].value)
    staff = Client()
    staff.force_login(_user("ops", staff=True))
    _assert_handshake_accepted(live_asgi.url, staff.cookies["sessionid"].value)  # the 403 is about who, not how


def _assert_handshake_refused(url: str, session: str) -> None:
    """What the browser saw, from a plain client: accepted, then closed with 4403 before any frame."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    with connect(url.replace("http", "ws", 1) + "/ws/cluster", origin=url,
                 additional_headers={"Cookie": f"sessionid={session}"}, open_timeout=5) as ws:
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 4403


def _assert_handshake_accepted(url: str, session: str) -> None:
    import json

    from websockets.sync.client import connect

    with connect(url.replace("http", "ws", 1) + "/ws/cluster", origin=url,
                 additional_headers={"Cookie": f"sessionid={session}"}, open_timeout=5) as ws:
        assert json.loads(ws.recv(timeout=5))["type"] == "cluster"
