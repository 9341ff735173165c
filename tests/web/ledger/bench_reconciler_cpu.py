"""The reconciler's CPU per job (issue 37, item 7): the thirteen stream events of an sd-t2i job (accepted, each
stage's start and end, three denoise progress events, completed) for 150 jobs, applied by ``Reconciler.step``
against the test database and a real redis-server (the web tests' fixtures), this process's CPU time
divided by the jobs. ``PROBE_OLD=1`` measures the reconciler as it was before the batch pushed each job
once, skipped superseded progress events and wrote a stage run's start with its end (a push per event,
every event written on its own), so both are measured by one protocol; run them alternately:

    for i in 1 2 3; do for old in 1 ""; do PROBE_OLD=$old .venv/bin/python -m pytest -q -s
        tests/web/ledger/bench_reconciler_cpu.py -p no:cacheprovider | grep PROBE; done; done

``PROBE_FOREIGN=1``: the jobs are not the platform's (sent to the Proxy directly, as ``onepiece bench e2e``
sends them). ``PROBE_Q=1`` counts the queries too (Django's debug cursor: slower), ``PROBE_PROF=1`` profiles.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import time
import uuid
from collections import Counter

import pytest

from engine.store import keys

pytestmark = pytest.mark.django_db(transaction=True)
STAGES = ("text_encode", "denoise", "vae_decode", "image_encode")

def test_probe(alice, store) -> None:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from onepiece_platform.engine_link.reconciler import Reconciler
    from onepiece_platform.jobs.models import Job
    user, c, _ = alice
    n = int(os.environ.get("PROBE_JOBS", "150"))
    uids = [uuid.uuid4().hex for _ in range(n)]
    foreign = bool(os.environ.get("PROBE_FOREIGN"))  # jobs sent to the Proxy directly, as bench e2e sends them
    for u in uids if not foreign else ():
        Job.objects.create(uid=u, owner=user, workflow="sd-t2i", params={}, cost_estimate_gpu_s=1.0)
    rec = Reconciler(block_ms=0)
    rec.step(block=False)
    for u in uids:
        store.accept(u, "sd-t2i", 1.0)
        p = 0
        for s in STAGES:
            store.event(u, keys.STAGE_STARTED, s, p, state=keys.IN_PROGRESS)
            if s == "denoise":
                for k in (1, 2, 3):
                    store.event(u, keys.PROGRESS, s, p + 10 * k, detail=f"step {k}/3", state=keys.IN_PROGRESS)
            p += 20
            store.event(u, keys.STAGE_FINISHED, s, p, detail="0.010s")
        store.finish(u, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    from onepiece_platform.engine_link import reconciler as R
    ents = store.read_entries("0", None, 10000)
    print("\nentries", len(ents), "superseded", len(R._superseded_progress(ents)), "batch", rec.batch)
    if os.environ.get("PROBE_OLD"):  # the reconciler before: a push per event, every progress written
        from onepiece_platform.jobs import push as P
        R._superseded_progress = lambda entries: set()
        R._merged_starts = lambda entries: {}
        P.deferred = lambda: contextlib.nullcontext({})
    cpu0, t0 = time.process_time(), time.perf_counter()
    ctx = CaptureQueriesContext(connection) if os.environ.get("PROBE_Q") else contextlib.nullcontext([])
    prof = cProfile.Profile() if os.environ.get("PROBE_PROF") else None
    if prof:
        prof.enable()
    with ctx:
        while rec.step(block=False):
            pass
    if os.environ.get("PROBE_Q"):
        print(Counter(" ".join(x["sql"].split()[:4])[:60] for x in ctx.captured_queries).most_common(20))
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    assert Job.objects.filter(state="completed").count() == (0 if foreign else n)
    print(f"\nPROBE jobs {n}: reconciler CPU {cpu / n * 1e3:.2f} ms/job, wall {wall / n * 1e3:.2f} ms/job, "
          f"queries {len(getattr(ctx, 'captured_queries', [])) / n:.1f}/job")
