"""Completion webhooks in one process: the outbox written with the terminal state, the event names of each
surface, Standard Webhooks signatures checked by the official verifiers, retries with one webhook-id,
timeouts, the endpoint API and its scoping. The receiver is a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import datetime as dt
import json
import socket
import time
import urllib.request
from typing import Any

import openai
import pytest
import standardwebhooks
from rest_framework.test import APIClient

from onepiece_platform.jobs import ledger
from onepiece_platform.webhooks import outbox
from onepiece_platform.webhooks.delivery import Deliverer
from onepiece_platform.webhooks.models import DELIVERED, FAILED, PENDING, WebhookDelivery, WebhookEndpoint
from onepiece_platform.webhooks.sender import Outcome
from tests.fixtures.web import client_for, make_user, sd_body
from tests.web.webhooks.conftest import add_endpoint, finished_job, key_prefix
from tests.web.webhooks.receiver import Receiver

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _verify_both(secret: str, r: Any) -> dict[str, Any]:
    """The delivery as the two official verifiers see it (each raises on a bad signature or timestamp)."""
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(r.body, r.headers, secret=secret)
    doc = standardwebhooks.Webhook(secret).verify(r.body, r.headers)
    assert doc == json.loads(r.body) and event.id == doc["id"]
    return doc


def test_video_completed_through_the_api_verifies_with_openai_and_standardwebhooks(
        oa: Any, workers: Any, hooks_settings: Any, receiver: Receiver) -> None:
    """A text-to-video job submitted with the openai client through /v1/videos: the outbox row is written
    when the poll finishes it, the delivery worker sends it, and both official verifiers accept it."""
    client, user = oa
    req = urllib.request.Request(str(client.base_url).replace("/v1/", "/api/v1/webhooks"), method="POST",
                                 data=json.dumps({"url": receiver.url}).encode(),
                                 headers={"Authorization": f"Bearer {client.api_key}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        created = json.loads(r.read())
    secret = created["secret"]
    assert secret.startswith("whsec_") and created["url"] == receiver.url

    v = client.videos.create_and_poll(prompt="a cat on the moon", size="64x64", seconds="1", poll_interval_ms=50,
                                      extra_body={"num_inference_steps": 2})
    assert v.status == "completed"
    assert Deliverer().run_once() == [DELIVERED]
    [got] = receiver.wait_for(1)
    event = openai.OpenAI(api_key="unused", webhook_secret=secret).webhooks.unwrap(got.body, got.headers)
    assert event.type == "video.completed" and event.data.id == v.id and event.object == "event"
    doc = _verify_both(secret, got)
    assert set(doc) == {"id", "object", "type", "created_at", "data"} and doc["data"] == {"id": v.id}
    assert doc["id"].startswith("evt_") and got.webhook_id.startswith("msg_")
    assert got.headers["content-type"] == "application/json"
    with pytest.raises(openai.InvalidWebhookSignatureError):  # another endpoint's secret does not verify
        openai.OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=_other_secret())


def _other_secret() -> str:
    from onepiece_platform.webhooks.signing import new_secret

    return new_secret()


def test_event_names_follow_the_surface_and_each_terminal_state_queues_once(alice: Any, hooks_settings: Any) -> None:
    user, client, key = alice
    add_endpoint(client, "http://127.0.0.1:9/x")
    prefix = key_prefix(key)
    cases = [("completed", "sd-t2i", "openai", "image.completed"), ("failed", "sd-t2i", "openai", "image.failed"),
             ("completed", "wan2.1-t2v", "openai", "video.completed"),
             ("cancelled", "wan2.1-i2v", "openai", "video.failed"), ("expired", "wan2.1-t2v", "openai", "video.failed"),
             ("completed", "sd-t2i", "native", "job.completed"), ("failed", "wan2.1-i2v", "native", "job.failed"),
             ("cancelled", "sd-t2i", "native", "job.cancelled"), ("expired", "sd-t2i", "native", "job.expired")]
    for state, workflow, api, expected in cases:
        job = finished_job(user, prefix, state, workflow, api)
        d = WebhookDelivery.objects.get(job=job)
        assert d.event_type == expected, (state, workflow, api)
        assert json.loads(d.body) == {"id": d.event_id, "object": "event", "type": expected,
                                      "created_at": int(job.finished_at.timestamp()), "data": {"id": job.uid}}
        # a replayed terminal event changes nothing; a second enqueue (it cannot happen) adds no row
        assert not ledger.finish(job.uid, "failed", "again")
        outbox.enqueue(job)
        assert WebhookDelivery.objects.filter(job=job).count() == 1
    # a job without an API key (a signed-in session) or whose key has no endpoint makes no event
    assert WebhookDelivery.objects.filter(job=finished_job(user, None)).count() == 0
    _, other_key = make_user("no-endpoint")
    assert WebhookDelivery.objects.filter(job=finished_job(user, key_prefix(other_key))).count() == 0


def test_500_twice_then_200_is_three_attempts_with_one_webhook_id(alice: Any, hooks_settings: Any,
                                                                  receiver: Receiver) -> None:
    user, client, key = alice
    secret = add_endpoint(client, receiver.url)["secret"]
    receiver.answer(500, 500, 200)
    job = finished_job(user, key_prefix(key))
    worker = Deliverer()
    states: list[str] = []
    for _ in range(200):
        states += worker.run_once()
        if DELIVERED in states:
            break
        time.sleep(0.02)
    assert states == [PENDING, PENDING, DELIVERED]
    got = receiver.wait_for(3)
    assert [r.answered for r in got] == [500, 500, 200]
    assert len({r.webhook_id for r in got}) == 1 and len({r.body for r in got}) == 1
    for r in got:  # every attempt is signed on its own (its timestamp), and each verifies
        _verify_both(secret, r)
    d = WebhookDelivery.objects.get(job=job)
    assert d.state == DELIVERED and d.attempt_count == 3 and d.msg_id == got[0].webhook_id
    # the attempts, as the API shows them
    page = client.get(f"/api/v1/webhooks/{d.endpoint_id}/deliveries").json()
    [row] = page["results"]
    assert row["webhook_id"] == d.msg_id and row["state"] == "delivered" and row["next_attempt_at"] is None
    assert [(a["number"], a["status_code"]) for a in row["attempts"]] == [(1, 500), (2, 500), (3, 200)]
    assert row["attempts"][0]["error"].startswith("HTTP 500") and row["attempts"][2]["error"] == ""
    assert all(a["latency_ms"] >= 0 and a["address"] == "127.0.0.1" for a in row["attempts"])
    assert client.get(f"/api/v1/webhooks/{d.endpoint_id}/deliveries?state=pending").json()["count"] == 0
    from django.test import Client

    text = Client().get("/metrics", HTTP_ACCEPT="text/plain;version=0.0.4").content.decode()
    assert 'onepiece_webhook_deliveries{state="delivered"} 1.0' in text
    assert "onepiece_webhook_oldest_pending_seconds 0.0" in text


def test_backoff_schedule_then_failed_after_24_hours(alice: Any, settings: Any) -> None:
    """The default schedule on a fake clock, a receiver that always answers 503: 5 s, 30 s, 2 min, ...,
    then the final attempt at the 24 h mark, and the delivery fails."""
    user, client, key = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": True, "WEBHOOK_RETRY_JITTER": 0.0}
    add_endpoint(client, "http://127.0.0.1:9/x")
    job = finished_job(user, key_prefix(key))
    d = WebhookDelivery.objects.get(job=job)
    now = [d.next_attempt_at]
    sent: list[dt.datetime] = []

    def post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> Outcome:
        sent.append(now[0])
        return Outcome(503, 3, "HTTP 503")

    worker = Deliverer(clock=lambda: now[0], post=post)
    while True:
        [state] = worker.run_once()
        d.refresh_from_db()
        assert state == d.state
        if state != PENDING:
            break
        assert worker.run_once() == []  # not due before its time
        now[0] = d.next_attempt_at
    gaps = [round((b - a).total_seconds()) for a, b in zip(sent, sent[1:], strict=False)]
    assert gaps[:10] == [5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800, 28800]
    assert sent[-1] == d.give_up_at and d.state == FAILED and d.attempt_count == len(sent) == 12
    assert d.last_error == "HTTP 503" and d.attempts.count() == 12


def test_a_slow_receiver_times_out_and_is_retried(alice: Any, hooks_settings: Any, receiver: Receiver) -> None:
    user, client, key = alice
    hooks_settings.ONEPIECE = {**hooks_settings.ONEPIECE, "WEBHOOK_TIMEOUT_S": 0.5}
    add_endpoint(client, receiver.url)
    receiver.answer("hang")
    finished_job(user, key_prefix(key))
    assert Deliverer().run_once() == [PENDING]
    d = WebhookDelivery.objects.get()
    [attempt] = d.attempts.all()
    assert attempt.status_code is None and "timed out after 0.5s" in attempt.error
    assert 400 <= attempt.latency_ms < 3000
    receiver.release()


def test_endpoint_api_secret_once_one_per_key_scoped_to_the_key(alice: Any, bob: Any, hooks_settings: Any) -> None:
    user, client, key = alice
    created = add_endpoint(client, "http://127.0.0.1:9/a", events=["video.completed", "job.failed"],
                           description="mine")
    assert created["secret"].startswith("whsec_") and created["secret_hint"] == created["secret"][:10] + "..."
    assert created["events"] == ["video.completed", "job.failed"]
    listed = client.get("/api/v1/webhooks").json()
    assert [e["id"] for e in listed] == [created["id"]] and "secret" not in listed[0]
    one = client.get(f"/api/v1/webhooks/{created['id']}").json()
    assert "secret" not in one and one["api_key"] == created["api_key"]
    r = client.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/b"}, format="json")
    assert r.status_code == 409 and r.json()["field"] == "api_key"
    r = client.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/b", "events": ["video.done"]}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "events"
    r = client.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/b", "secret": "mine"}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "secret"
    # another user's endpoint, and another key of the same user, see nothing of it
    assert bob[1].get(f"/api/v1/webhooks/{created['id']}").status_code == 404
    assert bob[1].patch(f"/api/v1/webhooks/{created['id']}", {"enabled": False}, format="json").status_code == 404
    from onepiece_platform.accounts.models import ApiKey

    _, second = ApiKey.issue(user, "second")
    assert client_for(second).get(f"/api/v1/webhooks/{created['id']}").status_code == 404
    assert client_for(second).get("/api/v1/webhooks").json() == []
    # a signed-in session manages every key's endpoint, naming the key
    session = APIClient()
    session.force_login(user)
    assert [e["id"] for e in session.get("/api/v1/webhooks").json()] == [created["id"]]
    r = session.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/c"}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "api_key"
    second_id = ApiKey.objects.get(name="second").pk
    assert session.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/c", "api_key": second_id},
                        format="json").status_code == 201
    r = session.post("/api/v1/webhooks", {"url": "http://127.0.0.1:9/c", "api_key": bob[0].api_keys.get().pk},
                     format="json")
    assert r.status_code == 400 and r.json()["field"] == "api_key"
    # update and delete
    r = client.patch(f"/api/v1/webhooks/{created['id']}", {"enabled": False, "url": "http://127.0.0.1:9/z"},
                     format="json")
    assert r.status_code == 200 and r.json()["enabled"] is False and r.json()["url"] == "http://127.0.0.1:9/z"
    assert client.delete(f"/api/v1/webhooks/{created['id']}").status_code == 204
    assert client.get(f"/api/v1/webhooks/{created['id']}").status_code == 404


def test_per_request_webhook_url_signed_with_the_keys_endpoint_secret(alice: Any, hooks_settings: Any,
                                                                      receiver: Receiver, workers: Any) -> None:
    user, client, key = alice
    r = client.post("/api/v1/jobs", {**sd_body(), "webhook_url": receiver.url}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "webhook_url"  # no endpoint: no secret to sign with
    session = APIClient()
    session.force_login(user)
    r = session.post("/api/v1/jobs", {**sd_body(), "webhook_url": receiver.url}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "webhook_url"  # no API key: no endpoint
    # an endpoint used for signing only (disabled): the request's own URL still gets its job's event
    created = add_endpoint(client, "http://127.0.0.1:9/never", enabled=False)
    r = client.post("/api/v1/jobs", {**sd_body(), "webhook_url": receiver.url}, format="json")
    assert r.status_code == 202 and r.json()["webhook_url"] == receiver.url
    uid = r.json()["uid"]
    for _ in range(400):  # the native status read finishes the row once the playing workers did
        if client.get(f"/api/v1/jobs/{uid}").json()["state"] == "completed":
            break
        time.sleep(0.02)
    [d] = WebhookDelivery.objects.filter(job__uid=uid)
    assert d.target == "request" and d.event_type == "job.completed"
    assert Deliverer().run_once() == [DELIVERED]
    [got] = receiver.wait_for(1)
    assert _verify_both(created["secret"], got)["data"]["id"] == uid
    # enabled again: the endpoint's URL and the request's each get their own delivery (own webhook-id)
    client.patch(f"/api/v1/webhooks/{created['id']}", {"enabled": True, "url": receiver.url}, format="json")
    job = finished_job(user, key_prefix(key), "failed", webhook_url=receiver.url)
    rows = WebhookDelivery.objects.filter(job=job)
    assert sorted(d.target for d in rows) == ["endpoint", "request"] and len({d.msg_id for d in rows}) == 2
    assert len({d.event_id for d in rows}) == 1


def test_private_addresses_refused_in_production_settings(alice: Any, settings: Any, receiver: Receiver) -> None:
    user, client, key = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": False, "WEBHOOK_REQUIRE_HTTPS": True}
    for url in ("https://127.0.0.1/x", "https://localhost/x", "https://10.1.2.3/x", "https://192.168.0.10/x",
                "https://169.254.169.254/latest/meta-data", "https://[::1]/x", "https://[::ffff:127.0.0.1]/x",
                "https://[fe80::1]/x", "https://0.0.0.0/x", "https://100.64.0.1/x", "https://224.0.0.1/x",
                "https://[2002:a00:1::]/x", "http://93.184.216.34/x", "ftp://93.184.216.34/x",
                "https://user:pw@93.184.216.34/x", "https://no-such-host.invalid/x", "not a url"):
        r = client.post("/api/v1/webhooks", {"url": url}, format="json")
        assert r.status_code == 400 and r.json()["field"] == "url", (url, r.json())
    assert not WebhookEndpoint.objects.exists()
    assert client.post("/api/v1/webhooks", {"url": "https://93.184.216.34/hooks"}, format="json").status_code == 201
    r = client.post("/api/v1/jobs", {**sd_body(), "webhook_url": "https://10.0.0.7/x"}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "webhook_url"
    # vetted again at delivery (the name may resolve elsewhere now): nothing is sent to a private address
    WebhookEndpoint.objects.update(url=receiver.url.replace("http:", "https:"))
    finished_job(user, key_prefix(key))
    assert Deliverer().run_once() == [PENDING]
    attempt = WebhookDelivery.objects.get().attempts.get()
    assert attempt.status_code is None and attempt.error.startswith("refused:") and "loopback" in attempt.error
    assert receiver.received == []


def _ca_and_cert(tmp: Any, host: str) -> tuple[str, str, str]:
    """(CA file, server cert file, server key file): a test CA and a certificate for ``host`` it signed."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = dt.datetime.now(dt.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("test CA")).issuer_name(name("test CA"))
          .public_key(ca_key.public_key()).serial_number(1).not_valid_before(now - dt.timedelta(hours=1))
          .not_valid_after(now + dt.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name(host)).issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(2).not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = []
    for fname, data in (("ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
                        ("cert.pem", cert.public_bytes(serialization.Encoding.PEM)),
                        ("key.pem", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))):
        (tmp / fname).write_bytes(data)
        files.append(str(tmp / fname))
    return files[0], files[1], files[2]


def test_https_to_the_vetted_address_with_the_names_certificate_and_dns_rebinding_refused(
        alice: Any, settings: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """Production settings, a name that resolves to a public address at registration: the attempt connects to
    the address that was vetted (the test's network routes it to a local TLS receiver) and checks the
    certificate against the name; once the name resolves to a private address, nothing is sent."""
    import ssl

    from onepiece_platform.webhooks import sender

    user, client, key = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": False, "WEBHOOK_REQUIRE_HTTPS": True}
    host, public = "hooks.example.test", "93.184.216.34"
    ca, cert, pkey = _ca_and_cert(tmp_path, host)
    answers = {host: public}
    real_resolve, real_connect = socket.getaddrinfo, socket.create_connection
    connected: list[str] = []

    def resolve(name: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        return real_resolve(answers.get(name, name), port, *args, **kwargs)

    def connect(addr: tuple[str, int], *args: Any, **kwargs: Any) -> Any:
        connected.append(addr[0])  # only ever a vetted address, never the name (no second lookup)
        return real_connect(("127.0.0.1" if addr[0] == public else addr[0], addr[1]), *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    monkeypatch.setattr(socket, "create_connection", connect)
    trusting_ca = ssl.create_default_context(cafile=ca)  # the test CA stands for the public ones
    monkeypatch.setattr(sender, "tls_context", lambda: trusting_ca)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, pkey)
    receiver = Receiver().start(tls)
    try:
        secret = add_endpoint(client, f"https://{host}:{receiver.port}/hooks")["secret"]
        finished_job(user, key_prefix(key))
        assert Deliverer().run_once() == [DELIVERED]
        [got] = receiver.wait_for(1)
        assert got.headers["host"] == f"{host}:{receiver.port}" and connected == [public]
        _verify_both(secret, got)
        attempt = WebhookDelivery.objects.get().attempts.get()
        assert attempt.address == public and attempt.status_code == 200
        # the name now resolves to loopback (DNS rebinding): refused before any connection
        answers[host] = "127.0.0.1"
        finished_job(user, key_prefix(key))
        assert Deliverer().run_once() == [PENDING]
        refused = WebhookDelivery.objects.get(state=PENDING).attempts.get()
        assert refused.error.startswith("refused:") and "127.0.0.1" in refused.error
        assert len(receiver.received) == 1 and connected == [public]
        # a certificate for another name is refused by the TLS check (the name is what is verified)
        answers[host] = public
        WebhookEndpoint.objects.update(url=f"https://other.example.test:{receiver.port}/hooks")
        answers["other.example.test"] = public
        WebhookDelivery.objects.filter(state=PENDING).update(next_attempt_at=dt.datetime.now(dt.UTC))
        assert Deliverer().run_once() == [PENDING]
        assert "CERTIFICATE_VERIFY_FAILED" in WebhookDelivery.objects.get(state=PENDING).last_error
    finally:
        receiver.stop()


def test_the_admin_sends_again_only_failed_deliveries_and_a_run_claims_what_fits_in_a_lease(
        alice: Any, hooks_settings: Any, rf: Any) -> None:
    """A delivered row re-queued would reach its receiver twice, and a pending one may be in a worker's
    hands: the admin's action re-queues failed rows only. run_once claims no more rows than it can send,
    one by one, before its lease on them ends (else a second worker could send the same rows meanwhile)."""
    from django.contrib.admin.sites import site
    from django.contrib.messages.storage.fallback import FallbackStorage

    user, client, key = alice
    add_endpoint(client, "http://127.0.0.1:9/x")
    rows = [WebhookDelivery.objects.get(job=finished_job(user, key_prefix(key))) for _ in range(3)]
    for row, state in zip(rows, (DELIVERED, FAILED, PENDING), strict=True):
        WebhookDelivery.objects.filter(pk=row.pk).update(state=state, claim_token="held" if state == PENDING else "")
    request = rf.post("/admin/")
    request.user = user
    request.session = {}
    request._messages = FallbackStorage(request)
    site._registry[WebhookDelivery].send_again(request, WebhookDelivery.objects.filter(pk__in=[r.pk for r in rows]))
    after = {r.pk: WebhookDelivery.objects.get(pk=r.pk) for r in rows}
    assert after[rows[0].pk].state == DELIVERED
    assert after[rows[1].pk].state == PENDING and after[rows[1].pk].claim_token == ""
    assert after[rows[2].pk].claim_token == "held"  # a row in flight is left to its worker
    hooks_settings.ONEPIECE = {**hooks_settings.ONEPIECE, "WEBHOOK_LEASE_S": 3.0, "WEBHOOK_TIMEOUT_S": 1.0}
    for _ in range(5):
        finished_job(user, key_prefix(key))
    assert len(Deliverer().run_once()) == 2  # 3 s of lease, 1 s per attempt, one second to spare
