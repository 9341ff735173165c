"""The platform's engine link asks the Proxy for presigned result URLs (real Proxy, Redis and Swift s3api)."""

from __future__ import annotations

import os
import time
import urllib.request
from typing import Any

import pytest

from engine.store import JobStore, keys
from engine.store.objects import ObjectStore
from onepiece_platform.engine_link.proxy import ProxyEngineClient
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db
SD = sd_body()["params"]
PNG = b"\x89PNG\r\n\x1a\n" + os.urandom(20_000)


@pytest.fixture
def proxy_object_store(object_store: ObjectStore) -> Any:
    """An object store behind ``proxy_url``'s Proxy (tests/fixtures/proxy.py), as ONEPIECE_OBJECT_STORE puts one."""
    return ObjectStore(object_store.config)


def test_result_url_is_a_presigned_get_of_the_output(proxy_url: str, object_store: ObjectStore) -> None:
    from onepiece_platform.redis_conn import get_redis

    c = ProxyEngineClient(proxy_url, timeout=5)
    uid = c.submit("sd-t2i", SD, {}).uid
    assert c.result_url(uid) is None  # not completed: nothing to sign
    worker = JobStore(get_redis(), objects=ObjectStore(object_store.config))  # the last stage's worker
    assert worker.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
    before = int(time.time())
    got = c.result_url(uid, 90)
    assert got is not None and (got.size, got.content_type) == (len(PNG), "image/png")
    assert before + 90 <= got.expires_at <= int(time.time()) + 90
    with urllib.request.urlopen(got.url, timeout=10) as r:  # no credential: the URL is the grant
        assert r.read() == PNG
    assert c.result(uid) == PNG  # the bytes through the Proxy as well
    assert c.result_url("0" * 32) is None
    worker.objects.close()


def test_the_platform_reads_results_from_the_object_store(settings, s3_server, object_store: ObjectStore,
                                                           web_redis: str) -> None:
    """Where the web process reads the job store itself (the in-process engine client, a video's stream),
    a result the worker put in the object store is read from there."""
    from engine.store.fragments import Fragments
    from onepiece_platform.engine_link import objects
    from onepiece_platform.engine_link.local import LocalEngineClient
    from onepiece_platform.redis_conn import get_redis

    settings.ONEPIECE = {**settings.ONEPIECE,
                         "OBJECT_STORE": s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}"}
    try:
        c = LocalEngineClient()
        uid = c.submit("sd-t2i", SD, {}).uid
        worker = JobStore(get_redis(), objects=ObjectStore(object_store.config))
        assert worker.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
        assert get_redis().get(keys.result_key(uid)) is None  # only the reference in Redis
        assert c.result(uid) == PNG
        assert b"".join(Fragments(objects.job_store()).iter(uid)) == PNG  # ?stream=true of a finished job
        worker.objects.close()
    finally:
        objects._stores.clear()
    settings.ONEPIECE = {**settings.ONEPIECE, "OBJECT_STORE": ""}
    assert objects.get_object_store() is None and LocalEngineClient().result(uid) is None  # Redis alone has none


def test_clean_up_deletes_the_objects_of_old_and_deleted_jobs(settings, s3_server, object_store: ObjectStore,
                                                              alice) -> None:
    """The Celery clean-up drops deleted (hidden) and expired jobs' results: their objects go too."""
    import datetime as dt

    from engine.store.objects import result_prefix
    from onepiece_platform.engine_link import objects
    from onepiece_platform.engine_link.tasks import clean_up
    from onepiece_platform.jobs.models import Job
    from onepiece_platform.redis_conn import get_redis

    settings.ONEPIECE = {**settings.ONEPIECE,
                         "OBJECT_STORE": s3_server.url.rsplit("/", 1)[0] + f"/{object_store.config.bucket}"}
    _, c, _ = alice
    worker = JobStore(get_redis(), objects=ObjectStore(object_store.config))
    try:
        old, deleted, fresh = (c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(3))
        for uid in (old, deleted, fresh):
            assert worker.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=PNG)
            c.get(f"/api/v1/jobs/{uid}")
        Job.objects.filter(uid=old).update(finished_at=dt.datetime.now(dt.UTC) - dt.timedelta(days=40))
        Job.objects.filter(uid=deleted).update(hidden=True)
        assert clean_up.apply(kwargs={"retention_days": 30}).get()["results"] == 2
        for uid, kept in ((old, False), (deleted, False), (fresh, True)):
            assert (object_store.newest(result_prefix(uid)) is not None) == kept, uid
    finally:
        worker.objects.close()
        objects._stores.clear()
