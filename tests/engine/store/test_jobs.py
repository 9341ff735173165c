"""The result store and event stream on a real redis-server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from engine.store import JobStore, keys


@pytest.fixture
def store(redis_server) -> Iterator[JobStore]:
    s = JobStore.from_url(redis_server.url, ttl=60)
    s.r.flushdb()
    yield s
    s.close()


def _uid() -> str:
    return uuid.uuid4().hex


def test_accept_then_complete_once(store: JobStore) -> None:
    uid = _uid()
    store.accept(uid, "sd-t2i", 2.5)
    st = store.status(uid)
    assert st is not None and st.state == keys.QUEUED and st.workflow == "sd-t2i"
    assert store.inflight("sd-t2i") == (1, 2.5)
    assert store.event(uid, keys.STAGE_STARTED, "denoise", 10, state=keys.IN_PROGRESS)
    assert store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png-1")
    # a second finisher (a redelivered request) writes nothing: no duplicate result, no second event
    assert not store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png-2")
    assert not store.finish(uid, "sd-t2i", keys.FAILED, "image_encode", detail="late")
    assert store.result(uid) == b"png-1"
    assert store.inflight("sd-t2i") == (0, 0.0)
    types = [e["type"] for e in store.events(uid)]
    assert types == [keys.ACCEPTED, keys.STAGE_STARTED, keys.COMPLETED]
    st = store.status(uid)
    assert st is not None and st.state == keys.COMPLETED and st.progress == 100 and st.terminal
    assert 0 < store.r.ttl(keys.result_key(uid)) <= 60


def test_no_events_after_a_terminal_state(store: JobStore) -> None:
    uid = _uid()
    store.accept(uid, "wan2.1-i2v", 1.0)
    assert store.finish(uid, "wan2.1-i2v", keys.CANCELLED, detail="by client")
    assert not store.event(uid, keys.PROGRESS, "denoise", 50, state=keys.IN_PROGRESS)
    st = store.status(uid)
    assert st is not None and st.state == keys.CANCELLED
    assert store.result(uid) is None


def test_timeline_events_after_the_terminal_one_are_still_recorded(store: JobStore) -> None:
    """A stage that finished while a cancel landed (or whose next stage completed the job first) still
    has its time on record; only the status hash refuses to move."""
    uid = _uid()
    store.accept(uid, "sd-t2i", 1.0)
    store.event(uid, keys.STAGE_STARTED, "vae_decode", 60, state=keys.IN_PROGRESS)
    assert store.finish(uid, "sd-t2i", keys.CANCELLED, "vae_decode", detail="by client")
    assert store.event(uid, keys.STAGE_FINISHED, "vae_decode", 80)
    assert store.event(uid, keys.STAGE_STOPPED, "image_encode", 80, state=keys.IN_PROGRESS)
    assert not store.event(uid, keys.PROGRESS, "image_encode", 90, state=keys.IN_PROGRESS)
    types = [(e["type"], e["stage"]) for e in store.events(uid)]
    assert types[-3:] == [(keys.CANCELLED, "vae_decode"), (keys.STAGE_FINISHED, "vae_decode"),
                          (keys.STAGE_STOPPED, "image_encode")]
    st = store.status(uid)
    assert st is not None and st.state == keys.CANCELLED and st.stage == "vae_decode"


def test_a_caller_chosen_uid_is_accepted_once(store: JobStore) -> None:
    uid = _uid()
    assert store.accept(uid, "sd-t2i", 1.0)
    assert not store.accept(uid, "sd-t2i", 9.0)
    assert store.inflight("sd-t2i") == (1, 1.0)
    assert [e["type"] for e in store.events(uid)] == [keys.ACCEPTED]


def test_event_fields_and_validation(store: JobStore) -> None:
    uid = _uid()
    store.accept(uid, "sd-t2i", 1.0)
    store.event(uid, keys.PROGRESS, "denoise", 42, detail="step 2/5")
    e = store.events(uid)[-1]
    assert set(e) == {"uid", "type", "stage", "progress", "ts", "detail", "attempt"} and e["attempt"] == "1"
    assert (e["type"], e["stage"], e["progress"], e["detail"]) == ("progress", "denoise", "42", "step 2/5")
    with pytest.raises(ValueError):
        store.event(uid, keys.COMPLETED)
    with pytest.raises(ValueError):
        store.finish(uid, "sd-t2i", keys.COMPLETED)  # completed needs its result
    with pytest.raises(ValueError):
        store.finish(uid, "sd-t2i", "running")


def test_cancel_flag_and_done_markers(store: JobStore) -> None:
    uid = _uid()
    assert not store.cancel_requested(uid)
    store.request_cancel(uid)
    assert store.cancel_requested(uid)
    assert not store.is_done(uid, "denoise")
    store.mark_done(uid, "denoise")
    assert store.is_done(uid, "denoise") and not store.is_done(uid, "vae_decode")
    assert store.status(_uid()) is None


def test_a_job_lost_with_its_node_is_started_again_then_given_up(store: JobStore) -> None:
    uid, wf = uuid.uuid4().hex, "sd-t2i"
    store.accept(uid, wf, 1.0, message=b"the request as it entered")
    store.located(uid, "node-a", "sd-t2i.denoise.0")
    store.event(uid, keys.STAGE_STARTED, "denoise", 40, state=keys.IN_PROGRESS)
    store.mark_done(uid, "text_encode")
    assert store.orphans([wf], {"node-a", "node-b"}) == []  # its node is alive
    (orphan,) = [o for o in store.orphans([wf], {"node-b"}) if o.uid == uid]
    assert (orphan.node, orphan.instance, orphan.stage) == ("node-a", "sd-t2i.denoise.0", "denoise")
    route = ["text_encode", "denoise", "vae_decode", "image_encode"]
    assert store.retry(orphan, route, max_attempts=2) == b"the request as it entered"
    assert store.retry(orphan, route, max_attempts=2) is None  # claimed once: a second sweeper gets nothing
    assert not store.is_done(uid, "text_encode")  # the fresh start runs every stage again
    st = store.status(uid)
    assert st is not None and st.state == keys.QUEUED and "node node-a was lost" in st.detail
    assert [e["type"] for e in store.events(uid)][-1] == keys.RETRIED
    # the second attempt's events say so: its stage runs are not the first attempt's
    assert store.events(uid)[-1]["attempt"] == "2"
    store.event(uid, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    assert [e["attempt"] for e in store.events(uid)][-4:] == ["1", "1", "2", "2"]
    # lost again, out of attempts: failed with the reason, not left hanging
    store.located(uid, "node-b", "sd-t2i.vae_decode.1")
    (orphan,) = [o for o in store.orphans([wf], set()) if o.uid == uid]
    assert store.retry(orphan, route, max_attempts=1) is None
    st = store.status(uid)
    assert st is not None and st.state == keys.FAILED and "node node-b was lost" in st.detail
    assert "gave up after 1 attempts" in st.detail
    assert not store.r.exists(keys.input_key(uid))  # the kept request goes with the job's end
    assert uid not in [o.uid for o in store.orphans([wf], set())]


def test_drain_sample_counts_each_terminal_transition_once(store: JobStore) -> None:
    """The Proxy's drain meter reads how many jobs completed: a job completed twice (a redelivery) counts
    once, and an expired one not at all."""
    uids = [_uid() for _ in range(3)]
    for uid in uids:
        store.accept(uid, "sd-t2i", 1.0)
    assert store.drain_sample(["sd-t2i", "wan2.1-i2v"]) == {"sd-t2i": (3, 0), "wan2.1-i2v": (0, 0)}
    store.finish(uids[0], "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    store.finish(uids[0], "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    store.finish(uids[1], "sd-t2i", keys.EXPIRED, "denoise")
    assert store.drain_sample(["sd-t2i"]) == {"sd-t2i": (1, 1)}  # the expired one is no capacity


def test_the_endings_stream_has_one_entry_per_finished_job_and_nothing_else(store: JobStore) -> None:
    from engine.store import keys

    after, _ = store.read_events("$", None, stream=keys.ENDINGS)
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    store.event(uid, keys.STAGE_STARTED, "denoise", 10, state=keys.IN_PROGRESS)
    store.event(uid, keys.PROGRESS, "denoise", 50, state=keys.IN_PROGRESS)
    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png")
    store.finish(uid, "sd-t2i", keys.FAILED, "image_encode")  # refused: already finished
    _, ended = store.read_events(after, None, stream=keys.ENDINGS)
    assert [(e["uid"], e["type"]) for e in ended if e["uid"] == uid] == [(uid, keys.COMPLETED)]


def test_one_sweep_drops_finished_entries_and_finds_the_jobs_of_lost_nodes(store: JobStore) -> None:
    from engine.store import keys

    wf, lost, done, fine = "sd-t2i", uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
    for uid in (lost, done, fine):
        store.accept(uid, wf, 1.0)
    store.located(lost, "node-gone", "sd-t2i.denoise.0")
    store.located(fine, "node-here", "sd-t2i.denoise.1")
    store.r.zadd(keys.inflight_key(wf), {done: 1.0})
    store.r.hset(keys.job_key(done), "state", keys.COMPLETED)  # finished without its entry removed
    dropped, orphans = store.sweep_inflight([wf], {"node-here"})
    assert dropped == 1 and [o.uid for o in orphans] == [lost]
    assert done.encode() not in store.r.zrange(keys.inflight_key(wf), 0, -1)
    assert store.sweep_inflight([wf], None) == (0, [])  # membership unknown: nobody is judged lost
