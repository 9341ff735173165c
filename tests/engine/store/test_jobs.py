"""The result store and event stream on a real redis-server."""

from __future__ import annotations

import uuid

import pytest

from engine.store import JobStore, keys


def _uid() -> str:
    return uuid.uuid4().hex


def test_accept_then_complete_once(job_store: JobStore) -> None:
    uid = _uid()
    job_store.accept(uid, "sd-t2i", 2.5)
    st = job_store.status(uid)
    assert st is not None and st.state == keys.QUEUED and st.workflow == "sd-t2i"
    assert job_store.inflight("sd-t2i") == (1, 2.5)
    assert job_store.event(uid, keys.STAGE_STARTED, "denoise", 10, state=keys.IN_PROGRESS)
    assert job_store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png-1")
    # a second finisher (a redelivered request) writes nothing: no duplicate result, no second event
    assert not job_store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png-2")
    assert not job_store.finish(uid, "sd-t2i", keys.FAILED, "image_encode", detail="late")
    assert job_store.result(uid) == b"png-1"
    assert job_store.inflight("sd-t2i") == (0, 0.0)
    types = [e["type"] for e in job_store.events(uid)]
    assert types == [keys.ACCEPTED, keys.STAGE_STARTED, keys.COMPLETED]
    st = job_store.status(uid)
    assert st is not None and st.state == keys.COMPLETED and st.progress == 100 and st.terminal
    assert 0 < job_store.r.ttl(keys.result_key(uid)) <= 60


def test_no_events_after_a_terminal_state(job_store: JobStore) -> None:
    uid = _uid()
    job_store.accept(uid, "wan2.1-i2v", 1.0)
    assert job_store.finish(uid, "wan2.1-i2v", keys.CANCELLED, detail="by client")
    assert not job_store.event(uid, keys.PROGRESS, "denoise", 50, state=keys.IN_PROGRESS)
    st = job_store.status(uid)
    assert st is not None and st.state == keys.CANCELLED
    assert job_store.result(uid) is None


def test_timeline_events_after_the_terminal_one_are_still_recorded(job_store: JobStore) -> None:
    """A stage that finished while a cancel landed (or whose next stage completed the job first) still
    has its time on record; only the status hash refuses to move."""
    uid = _uid()
    job_store.accept(uid, "sd-t2i", 1.0)
    job_store.event(uid, keys.STAGE_STARTED, "vae_decode", 60, state=keys.IN_PROGRESS)
    assert job_store.finish(uid, "sd-t2i", keys.CANCELLED, "vae_decode", detail="by client")
    assert job_store.event(uid, keys.STAGE_FINISHED, "vae_decode", 80)
    assert job_store.event(uid, keys.STAGE_STOPPED, "image_encode", 80, state=keys.IN_PROGRESS)
    assert not job_store.event(uid, keys.PROGRESS, "image_encode", 90, state=keys.IN_PROGRESS)
    types = [(e["type"], e["stage"]) for e in job_store.events(uid)]
    assert types[-3:] == [(keys.CANCELLED, "vae_decode"), (keys.STAGE_FINISHED, "vae_decode"),
                          (keys.STAGE_STOPPED, "image_encode")]
    st = job_store.status(uid)
    assert st is not None and st.state == keys.CANCELLED and st.stage == "vae_decode"


def test_a_caller_chosen_uid_is_accepted_once(job_store: JobStore) -> None:
    uid = _uid()
    assert job_store.accept(uid, "sd-t2i", 1.0)
    assert not job_store.accept(uid, "sd-t2i", 9.0)
    assert job_store.inflight("sd-t2i") == (1, 1.0)
    assert [e["type"] for e in job_store.events(uid)] == [keys.ACCEPTED]


def test_event_fields_and_validation(job_store: JobStore) -> None:
    uid = _uid()
    job_store.accept(uid, "sd-t2i", 1.0)
    job_store.event(uid, keys.PROGRESS, "denoise", 42, detail="step 2/5")
    e = job_store.events(uid)[-1]
    assert set(e) == {"uid", "type", "stage", "progress", "ts", "detail", "attempt"} and e["attempt"] == "1"
    assert (e["type"], e["stage"], e["progress"], e["detail"]) == ("progress", "denoise", "42", "step 2/5")
    with pytest.raises(ValueError):
        job_store.event(uid, keys.COMPLETED)
    with pytest.raises(ValueError):
        job_store.finish(uid, "sd-t2i", keys.COMPLETED)  # completed needs its result
    with pytest.raises(ValueError):
        job_store.finish(uid, "sd-t2i", "running")


def test_cancel_flag_and_done_markers(job_store: JobStore) -> None:
    uid = _uid()
    assert not job_store.cancel_requested(uid)
    job_store.request_cancel(uid)
    assert job_store.cancel_requested(uid)
    assert not job_store.is_done(uid, "denoise")
    job_store.mark_done(uid, "denoise")
    assert job_store.is_done(uid, "denoise") and not job_store.is_done(uid, "vae_decode")
    assert job_store.status(_uid()) is None


def test_a_job_lost_with_its_node_is_started_again_then_given_up(job_store: JobStore) -> None:
    uid, wf = uuid.uuid4().hex, "sd-t2i"
    job_store.accept(uid, wf, 1.0, message=b"the request as it entered")
    job_store.located(uid, "node-a", "sd-t2i.denoise.0")
    job_store.event(uid, keys.STAGE_STARTED, "denoise", 40, state=keys.IN_PROGRESS)
    job_store.mark_done(uid, "text_encode")
    assert job_store.orphans([wf], {"node-a", "node-b"}) == []  # its node is alive
    (orphan,) = [o for o in job_store.orphans([wf], {"node-b"}) if o.uid == uid]
    assert (orphan.node, orphan.instance, orphan.stage) == ("node-a", "sd-t2i.denoise.0", "denoise")
    route = ["text_encode", "denoise", "vae_decode", "image_encode"]
    assert job_store.retry(orphan, route, max_attempts=2) == b"the request as it entered"
    assert job_store.retry(orphan, route, max_attempts=2) is None  # claimed once: a second sweeper gets nothing
    assert not job_store.is_done(uid, "text_encode")  # the fresh start runs every stage again
    st = job_store.status(uid)
    assert st is not None and st.state == keys.QUEUED and "node node-a was lost" in st.detail
    assert [e["type"] for e in job_store.events(uid)][-1] == keys.RETRIED
    # the second attempt's events say so: its stage runs are not the first attempt's
    assert job_store.events(uid)[-1]["attempt"] == "2"
    job_store.event(uid, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    assert [e["attempt"] for e in job_store.events(uid)][-4:] == ["1", "1", "2", "2"]
    # lost again, out of attempts: failed with the reason, not left hanging
    job_store.located(uid, "node-b", "sd-t2i.vae_decode.1")
    (orphan,) = [o for o in job_store.orphans([wf], set()) if o.uid == uid]
    assert job_store.retry(orphan, route, max_attempts=1) is None
    st = job_store.status(uid)
    assert st is not None and st.state == keys.FAILED and "node node-b was lost" in st.detail
    assert "gave up after 1 attempts" in st.detail
    assert not job_store.r.exists(keys.input_key(uid))  # the kept request goes with the job's end
    assert uid not in [o.uid for o in job_store.orphans([wf], set())]


def test_drain_sample_counts_each_terminal_transition_once(job_store: JobStore) -> None:
    """The Proxy's drain meter reads how many jobs completed: a job completed twice (a redelivery) counts
    once, and an expired one not at all."""
    uids = [_uid() for _ in range(3)]
    for uid in uids:
        job_store.accept(uid, "sd-t2i", 1.0)
    assert job_store.drain_sample(["sd-t2i", "wan2.1-i2v"]) == {"sd-t2i": (3, 0), "wan2.1-i2v": (0, 0)}
    job_store.finish(uids[0], "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    job_store.finish(uids[0], "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    job_store.finish(uids[1], "sd-t2i", keys.EXPIRED, "denoise")
    assert job_store.drain_sample(["sd-t2i"]) == {"sd-t2i": (1, 1)}  # the expired one is no capacity


def test_the_endings_stream_has_one_entry_per_finished_job_and_nothing_else(job_store: JobStore) -> None:
    from engine.store import keys

    after, _ = job_store.read_events("$", None, stream=keys.ENDINGS)
    uid = uuid.uuid4().hex
    job_store.accept(uid, "sd-t2i", 1.0)
    job_store.event(uid, keys.STAGE_STARTED, "denoise", 10, state=keys.IN_PROGRESS)
    job_store.event(uid, keys.PROGRESS, "denoise", 50, state=keys.IN_PROGRESS)
    job_store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png")
    job_store.finish(uid, "sd-t2i", keys.FAILED, "image_encode")  # refused: already finished
    _, ended = job_store.read_events(after, None, stream=keys.ENDINGS)
    assert [(e["uid"], e["type"]) for e in ended if e["uid"] == uid] == [(uid, keys.COMPLETED)]


def test_both_streams_keep_the_caps_they_are_given(job_store: JobStore) -> None:
    """events_maxlen and endings_maxlen bound the two streams (benchmarks/object_memory.py scales both to a
    deployment's steady state); trimming is approximate, by whole stream nodes of 100 entries."""
    from engine.store import keys

    js = JobStore(job_store.r, ttl=60, events_maxlen=300, endings_maxlen=100)
    for _ in range(400):
        uid = _uid()
        js.accept(uid, "sd-t2i", 1.0)
        js.finish(uid, "sd-t2i", keys.CANCELLED, detail="by client")
    assert 300 <= js.r.xlen(keys.EVENTS) < 400 + 100
    assert 100 <= js.r.xlen(keys.ENDINGS) < 100 + 100


def test_one_sweep_drops_finished_entries_and_finds_the_jobs_of_lost_nodes(job_store: JobStore) -> None:
    from engine.store import keys

    wf, lost, done, fine = "sd-t2i", uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
    for uid in (lost, done, fine):
        job_store.accept(uid, wf, 1.0)
    job_store.located(lost, "node-gone", "sd-t2i.denoise.0")
    job_store.located(fine, "node-here", "sd-t2i.denoise.1")
    job_store.r.zadd(keys.inflight_key(wf), {done: 1.0})
    job_store.r.hset(keys.job_key(done), "state", keys.COMPLETED)  # finished without its entry removed
    dropped, orphans = job_store.sweep_inflight([wf], {"node-here"})
    assert dropped == 1 and [o.uid for o in orphans] == [lost]
    assert done.encode() not in job_store.r.zrange(keys.inflight_key(wf), 0, -1)
    assert job_store.sweep_inflight([wf], None) == (0, [])  # membership unknown: nobody is judged lost


def test_lost_after_says_when_the_stream_no_longer_holds_a_readers_cursor(job_store: JobStore) -> None:
    """A reader keeping its own cursor (the platform's reconciler) asks whether the stream's cap trimmed it:
    never for a cursor still held, or for no stream at all; for a cursor at 0-0 only once something was
    trimmed (before any trim the oldest event is simply the first)."""
    s = job_store
    assert s.lost_after("0-0") is None  # no stream yet
    ids = [s.r.xadd(keys.EVENTS, {"uid": _uid(), "type": keys.PROGRESS}).decode() for _ in range(5)]
    assert s.lost_after("0-0") is None and s.lost_after(ids[0]) is None and s.lost_after(ids[-1]) is None
    s.r.xtrim(keys.EVENTS, maxlen=2, approximate=False)  # the cap: ids[0..2] are gone
    assert s.lost_after(ids[2]) == ids[3] and s.lost_after(ids[1]) == ids[3]  # the cursor is gone
    assert s.lost_after(ids[3]) is None  # still held: nothing after it was lost
    assert s.lost_after("0-0") == ids[3]  # a reader that never read: the trimmed ones were lost to it
    s.r.xtrim(keys.EVENTS, maxlen=0, approximate=False)
    assert s.lost_after(ids[4]) is None  # an empty stream holds nothing to compare with
