"""TaskWorker: one stage instance in its own process.

It loads its stage executor once, consumes its inbox ring, runs the stage for
each Workflow Message, hands the result to an instance of the next stage
chosen by the ResultDeliver policy (or, at the last stage, writes the result
to the store), and only then releases its input.

Why release last: the ring keeps a delivered-but-unreleased message, and a
consumer that re-attaches with :meth:`RingConsumer.recover` gets it again. So
a worker killed mid-request loses nothing: its TaskManager restarts it, the
new process recovers the same ring and runs the request again. What it may
repeat (a send that happened just before the kill) is made harmless by the
store: a stage whose ``done`` marker is set drops the redelivered input, and
the result is written only by the single transition to ``completed``.

Ring ownership: the worker process is its ring's consumer and so its owner.
It creates the shared-memory segment on first start and recovers it when the
segment exists (a restart after a crash); a clean stop closes and unlinks it.
The TaskManager removes segments left by workers that never came back.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.coord.routes import Route, RouteTable
from engine.dispatch import order
from engine.dispatch.deliver import Outstanding, Producers, make_deliver
from engine.stages.base import Cancelled, DeadlineExceeded, StageContext, StageExecutor, SteppedStage
from engine.store import JobStore, keys
from engine.transport.errors import RegionExists, TransportError
from engine.transport.ring import Delivery, RingConfig, RingConsumer
from engine.worker import chunks
from engine.worker.batching import StepBatcher
from engine.worker.previews import Previews
from engine.workflow import WorkflowSpec, get_workflow
from engine.workflow import message as wm
from engine.workflow.options import Options
from engine.workflow.pricing import Fit, Samples

if TYPE_CHECKING:
    from engine.store.objects import ObjectRef

log = logging.getLogger("onepiece.worker")

RECV_BATCH = 8  # messages taken from the inbox ring per call
STAGE_FAILED = "stage_failed"  # the code of a job an exception inside a stage ended (keys.FAILED's detail)


@dataclass
class Run:
    """One request's run of this stage: its cost shares (for progress), its context and where it stands."""

    costs: dict[str, float]
    before: float
    share: float
    total: float
    ctx: Any = None
    step: int = 0
    steps: int = 0
    reported: float = 0.0


def stage_failed(stage: str, exc: BaseException) -> str:
    """The public detail of a job failed by ``exc`` in ``stage``: ``stage_failed: the <stage> stage failed
    (<kind of error>); ...`` (the message and traceback stay in the log and the stage run)."""
    return f"{STAGE_FAILED}: the {stage} stage failed ({type(exc).__name__}); the request was not completed"


@dataclass
class Held:
    """A message taken off the inbox ring and not yet handled: its place in line (engine.dispatch.order)."""

    d: Delivery
    msg: wm.Message | None  # None: undecodable (handle() fails its job)
    priority: int
    taken: float  # time.monotonic() when it was taken
    seq: int  # the order it was taken in


@dataclass(frozen=True)
class Chain:
    """Where one (workflow, stage) an instance serves sits in its workflow: what the worker needs per message
    when it serves a pool shared across workflows (engine.workflow.pools)."""

    spec: WorkflowSpec
    stage: str
    route: list[str]
    next_stage: str | None

    @classmethod
    def of(cls, workflow: str, stage: str) -> Chain:
        spec = get_workflow(workflow)
        route = spec.route()
        i = route.index(stage)
        return cls(spec, stage, route, route[i + 1] if i + 1 < len(route) else None)


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one TaskWorker process needs (passed as JSON by its TaskManager)."""

    instance: str
    workflow: str
    stage: str
    model_dir: str
    address: str
    redis_url: str
    etcd_url: str
    ring_slots: int = 256
    ring_bytes: int = 64 << 20
    deliver: str = "least-outstanding"
    device: str | None = None
    step_delay_s: float = 0.0  # stretched stage times, applied by the worker process (engine.worker.stretch)
    progress_interval_s: float = 0.25
    result_ttl_s: int = 3600
    route_refresh_s: float = 1.0
    send_timeout_s: float = 30.0
    ready_file: str = ""
    collab_address: str = ""  # Collaboration mode: this instance's collab ring (engine.worker.collab)
    workflow_set: str = "default"  # hand results only to instances of this Workflow Set
    stage_time_s: float = 0.0  # the same (engine.worker.config.StageTiming); 0 / 1: off
    stage_stretch: float = 1.0
    threads: int = 0  # CPU threads for torch's pools (engine.worker.threads); 0: whatever the environment says
    # step-level batching (engine.worker.batching) for a stage that steps (engine.stages.base.SteppedStage):
    # at most this many requests share a step (1: one at a time), and a new batch waits this long for more
    max_batch: int = 1
    batch_wait_ms: float = 0.0
    max_held: int = 0  # requests active at once, paused ones included (engine.worker.batching); 0: 2 * max_batch
    nice: int = 0  # nice levels below its TaskManager, applied first thing (engine.worker.priority); 0: none
    also: tuple[str, ...] = ()  # "workflow/stage" of the other members of a shared pool (engine.workflow.pools)
    # seconds the stage's warm-up calibration may spend (engine.worker.calibrate; the node's --calibrate-s); 0: off
    calibrate_s: float = 0.0

    def members(self) -> list[tuple[str, str]]:
        """Every (workflow, stage) this instance serves, its own first."""
        return [(self.workflow, self.stage), *(tuple(m.split("/", 1)) for m in self.also)]  # type: ignore[misc]


def open_ring(address: str, config: RingConfig) -> RingConsumer:
    """Create the inbox ring, or recover it if a previous incarnation left it behind."""
    try:
        return RingConsumer.create(address, config)
    except RegionExists:
        log.warning("recovering ring %s left by a previous worker", address)
        return RingConsumer.recover(address, config)


class TaskWorker:
    """The core loop of one stage instance (no process concerns: see :func:`main`)."""

    def __init__(self, config: WorkerConfig, store: JobStore, routes: RouteTable,
                 executor: StageExecutor, consumer: RingConsumer, collab: Any = None) -> None:
        self.config = config
        self.collab = collab  # a started engine.worker.collab.CfgService, for Collaboration mode
        self.store = store
        self.routes = routes
        self.executor = executor
        self.consumer = consumer
        # per (workflow, stage) served: one for a stage of one workflow, one per member of a shared pool
        self.chains = {m: Chain.of(*m) for m in config.members()}
        self.producers = Producers(config.send_timeout_s)
        # poll() (non-blocking) reads the consumer's acknowledgements now, so policies see fresh counts
        self.outstanding = Outstanding(self.producers.poll)
        self.deliver = make_deliver(config.deliver, self.outstanding)
        self.handled = 0
        self._runs: dict[str, deque[tuple[float, float]]] = {}  # mode -> (seconds, cost) of the last runs
        self.runs = 0  # stage runs completed by this process
        self.batcher: Any = None  # engine.worker.batching.StepBatcher, when this stage batches
        # per workflow served, (units, steps, seconds) of recent runs: the Proxy prices requests by their fit
        self.samples: dict[str, Samples] = {}
        self.fits: dict[str, Fit] = {}
        self.calibrator: Any = None  # engine.worker.calibrate.Calibrator, while the warm-up calibration runs
        self.last_active = time.monotonic()  # when the last message was handled (drain waits for quiet)
        self._started: set[str] = set()  # admitted requests whose stage_started the admission wrote
        self.chunks = chunks.Receiver(self)  # requests whose input arrives in chunks (engine.worker.chunks)
        self.previews = Previews(store, executor)  # live previews (preview_every), off the step loop

    # -- loop --------------------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool]) -> None:
        """Handle messages until ``should_stop()``; checked at least every 100 ms while idle.

        What the ring holds is taken (``recv_many``: runs of records verified by one native call each) and
        held; the next message handled is the held one of highest priority, with aging
        (:mod:`engine.dispatch.order`: one that waited ``order.AGING_S`` here is served as if high, and ties
        go to the one taken first, so no later arrival passes it after that), and ``should_stop()`` is
        checked between messages. Each message is still released on its own, last, by :meth:`handle`: a
        stop or a crash leaves the held rest unreleased, exactly like messages not yet taken. A stage
        that steps (SteppedStage) with ``max_batch`` > 1 is served by :class:`engine.worker.batching.StepBatcher`
        instead, under the same release rule.
        """
        should_stop = self._calibrating(should_stop)
        if self.config.max_batch > 1 and isinstance(self.executor, SteppedStage):
            self.batcher = StepBatcher(self, self.executor, self.config.max_batch,
                                       self.config.batch_wait_ms / 1000.0, RECV_BATCH, self.config.max_held or None,
                                       self._batch_key)
            self.batcher.serve(should_stop)
            return
        held = order.Line()  # taken off the ring, not yet handled (each unreleased until handled)
        seq = 0
        while not should_stop():
            batch = self.consumer.recv_many(RECV_BATCH, timeout=0.0 if held else 0.1)
            while batch:  # everything the ring holds now, so the choice is among all of it
                for d in batch:
                    held.add(self._hold(d, seq))
                    seq += 1
                batch = self.consumer.recv_many(RECV_BATCH, timeout=0.0)  # a batch may stop short of the rest
            self.chunks.sweep()  # held chunks of requests that ended meanwhile (at most every second)
            if not held:
                self.producers.poll_all()  # retransmit what a restarted downstream consumer dropped
                continue
            h = held.pop(time.monotonic())
            self.handle(h.d, h.msg)
            self.last_active = time.monotonic()

    def _calibrating(self, should_stop: Callable[[], bool]) -> Callable[[], bool]:
        """``should_stop`` that, between messages while the instance is idle, runs the warm-up calibration one
        measurement at a time (engine.worker.calibrate): the loop checks its ring between them, so a request
        waits at most for the one in hand. ``should_stop`` itself where there is nothing to calibrate."""
        from engine.worker import calibrate

        if self.config.calibrate_s > 0:
            self.calibrator = calibrate.Calibrator.of(self.executor, self.config.model_dir, list(self.chains),
                                                      self.config.calibrate_s, self._calibrated, self._step_share)
        if self.calibrator is None:  # said, so that whoever waits for the calibration does not wait for this
            why = "off" if self.config.calibrate_s <= 0 else "not calibrated here (learns from its runs)"
            for workflow, _stage in self.chains:
                self._publish(f"calibration.{workflow}", json.dumps({"points": 0, "done": True, "notes": [why]}))
            return should_stop

        def check() -> bool:
            if should_stop():
                return True
            cal, b = self.calibrator, self.batcher
            if cal is not None and time.monotonic() - self.last_active >= calibrate.IDLE_S \
                    and not (b is not None and (b.active or b.waiting)):
                target = cal.tick()
                if target is not None:
                    self._publish(f"calibration.{target.spec.name}", json.dumps(cal.report(target.spec.name)))
                if not cal.pending:
                    self.calibrator = None
            return False

        return check

    def _samples(self, workflow: str) -> Samples:
        """The pricing samples of ``workflow``'s runs here (a fit of degree 2 where its cost model says a step
        may grow with the square of its units)."""
        if workflow not in self.samples:
            chain = next(c for (wf, _st), c in self.chains.items() if wf == workflow)
            model = chain.spec.costs.get(chain.stage)
            self.samples[workflow] = Samples(degree=2 if model is not None and model.growth >= 2 else 1)
        return self.samples[workflow]

    def _step_share(self, workflow: str, params: Mapping[str, Any]) -> float:
        """The share of a step timed alone that a request of ``params`` costs here now: in Collaboration mode a
        peer computes the unconditional half of a guided step (the executor's ``cfg_share``), else all of it."""
        share = getattr(self.executor, "cfg_share", None)
        if self.collab is None or share is None or self.routes.mode(workflow) != "collaboration":
            return 1.0
        return float(share(params))

    def _calibrated(self, workflow: str, units: float, steps: float, seconds: float) -> Fit | None:
        """A calibration measurement: into the samples, and their fit published (as a run's is, by record)."""
        fit = self._samples(workflow).calibrated(units, steps, seconds)
        if fit is not None:
            self.fits[workflow] = fit
            self._publish(f"price_fit.{workflow}", fit.to_json())
        return fit

    def _publish(self, name: str, value: str) -> None:
        """One of the instance's fields, without counting a request (InstanceStats.record counts one); a store
        away is logged (the next run's record publishes the fit again)."""
        try:
            self.store.r.hset(keys.instance_key(self.config.instance), name, value)
        except Exception as exc:
            log.warning("could not publish %s: %s", name, exc)

    @staticmethod
    def _hold(d: Delivery, seq: int) -> Held:
        """A taken message with what its place in line needs (an undecodable one keeps normal priority:
        :meth:`handle` fails its job)."""
        try:
            msg: wm.Message | None = wm.decode(d.view)
        except wm.MessageError:
            msg = None
        return Held(d, msg, msg.header.priority if msg is not None else 0, time.monotonic(), seq)

    # -- the inbox, as a batcher sees it (engine.worker.batching.StageHost) ------------------------
    def receive(self, n: int, timeout: float) -> list[Delivery]:
        """Up to ``n`` messages off the inbox ring, waiting up to ``timeout`` for a first one."""
        return self.consumer.recv_many(n, timeout=timeout)

    def idle(self) -> None:
        """Nothing to serve: retransmit what a restarted downstream consumer dropped."""
        self.producers.poll_all()

    def busy(self) -> None:
        """Work was done now (a drain waits for quiet: :attr:`last_active`)."""
        self.last_active = time.monotonic()

    def handled_one(self) -> None:
        """One message is done with (handed on, ended, failed or refused) and released."""
        self.handled += 1

    def run_alone(self, h: wm.Header, msg: wm.Message) -> bool:
        """:meth:`run_plain`, its time recorded as the instance's occupation when it ran to its end."""
        t0 = time.perf_counter()
        ok = self.run_plain(h, msg)
        if ok:
            self.record(time.perf_counter() - t0, h.workflow)
        return ok

    def finish_run(self, h: wm.Header, run: Run, values: dict[str, Any], out: dict[str, Any], share_s: float,
                   batch: int, wall_s: float) -> None:
        """A batched request's end: :meth:`close_run` with its share of the steps, and that share recorded."""
        self.close_run(h, run, values, out, share_s, batch, wall_s=wall_s)
        self.record(share_s, h.workflow)

    def handle(self, d: Delivery, msg: wm.Message | None = None) -> None:
        """Run the stage on one message (``msg``: its decoded form, when the caller has it); the input is
        released on every path, last."""
        try:
            msg = wm.decode(d.view) if msg is None else msg
        except wm.MessageError as exc:
            self.undecodable(d, exc)
            return
        h = msg.header
        if h.chunk >= 0:  # one of several messages of a request: held until its final one (engine.worker.chunks)
            self.chunks.take(d, msg)
            self.handled += 1
            return
        release = True
        t0 = time.perf_counter()
        try:
            if self.admit(h) and self.run_plain(h, msg):
                self.record(time.perf_counter() - t0, h.workflow)
        except Exception as exc:  # one bad request must not stop the instance
            if not self.fail(h, exc):
                # The store itself is unreachable: the failure cannot be recorded, so
                # keep the input unreleased and let this process die; the restarted
                # worker recovers the ring and gets the request again.
                release = False
                raise
        finally:
            del msg
            if release:
                d.release()
        self.handled += 1

    def undecodable(self, d: Delivery, exc: wm.MessageError) -> None:
        """A message this stage cannot decode fails its job with the reason (when its UID can be read),
        never leaving it queued for ever; released only once that is recorded (as in :meth:`handle`)."""
        st, uid = self.config.stage, wm.peek_uid(d.view)
        log.error("undecodable message %s from producer %d: %s", uid or "(no uid)", d.producer, exc)
        if uid is not None:
            self.store.finish(uid, self.config.workflow, keys.FAILED, st,
                              detail=f"{st} could not decode the request: {exc}"[:500])
        d.release()
        self.handled += 1

    def admit(self, h: wm.Header, start: bool = True) -> bool:
        """Whether to run the stage at all: not misrouted, finished, repeated, cancelled or expired. With
        ``start``, an admitted request's ``stage_started`` is written by the same round trip as the check
        (:meth:`JobStore.gate`), and :meth:`open_run` writes none."""
        uid = h.uid
        chain = self.chain(h)
        st = chain.stage
        expired = self._expired(h)  # decided here, acted on only once the store says the job may run
        progress = self._progress_before(h, chain) if start and expired is None else None
        state, done, cancel, started = self.store.gate(uid, st, progress)
        if state in keys.TERMINAL or done:
            return False  # finished meanwhile, or a redelivery of work already handed on
        if cancel:
            self.store.finish(uid, h.workflow, keys.CANCELLED, st, detail=f"cancelled before {st}")
            return False
        if expired is not None:
            self.store.finish(uid, h.workflow, keys.EXPIRED, st, detail=expired)
            return False
        if started:
            self._started.add(uid)
        return True

    def _expired(self, h: wm.Header) -> str | None:
        """Why the request must not start here for its deadline (None: it may)."""
        if h.deadline is None:
            return None
        st, left = h.stage, h.deadline - time.time()
        if left <= 0:
            return f"deadline passed before {st} started"
        # Work that cannot end in time is not started: under overload the device time goes to requests
        # that can still make their deadlines, not to ones that would expire half-way through.
        need = self._fastest_for(h)
        if need > left:
            return f"cannot finish by its deadline: {st} alone takes at least {need:.2f}s here, {left:.2f}s left"
        return None

    @staticmethod
    def _progress_before(h: wm.Header, chain: Chain) -> int:
        """The job's progress when this stage starts: the predicted cost of the stages before it."""
        costs = chain.spec.estimate_cost(h.params)
        total = sum(costs.values()) or 1.0
        return int(100 * sum(costs.get(s, 0.0) for s in chain.route[:chain.route.index(chain.stage)]) / total)

    def chain(self, h: wm.Header) -> Chain:
        """The (workflow, stage) of this instance a message is for; a message for one it does not serve is
        misrouted (an error the job fails with, never a silent drop)."""
        chain = self.chains.get((h.workflow, h.stage))
        if chain is None:
            raise ValueError(f"misrouted: message for {h.workflow}/{h.stage} reached {self.config.instance} "
                             f"(serves {', '.join('/'.join(m) for m in self.chains)})")
        return chain

    def _mode(self, h: wm.Header) -> str:
        return "collaboration" if self.collab is not None and self.routes.mode(h.workflow) == "collaboration" \
            else "individual"

    def _fastest_for(self, h: wm.Header) -> float:
        """A lower bound on this stage's time here for this request: over the last runs in the same mode,
        a run of at most this request's predicted cost is no slower than it, and a run of a larger cost c_i
        that took t_i takes at least t_i * c / c_i at cost c (a fixed part plus a part growing with the
        cost scales no faster than that). 0 before any run in this mode: nothing is expired on a guess."""
        cost = self.chain(h).spec.estimate_cost(h.params).get(h.stage, 0.0)
        runs = self._runs.get(self._mode(h), ())
        if cost <= 0 or not runs:
            return 0.0
        return min(t * min(1.0, cost / c) for t, c in runs)

    def run_plain(self, h: wm.Header, msg: wm.Message) -> bool:
        """Run the stage and hand its output on; False when it stopped early (cancel, deadline)."""
        if chunks.sends_chunks(self.executor) and self.chain(h).next_stage is not None:
            return chunks.run_chunked(self, h, msg)  # the output handed on in chunks as it comes
        run = self.open_run(h)
        values = self.values_of(msg)
        if self.collab is not None and self.routes.mode(h.workflow) == "collaboration":
            run.ctx.cfg_parallel = self.collab.remote_for(h, self.routes)
        t0 = time.perf_counter()
        ok, out = self.attempt(h, run, lambda: self.executor.run(self.inputs_of(h, values), h.params, run.ctx))
        if ok:
            self.close_run(h, run, values, out, time.perf_counter() - t0)
        return ok

    def _batch_key(self, h: wm.Header) -> Any:
        """A request's batch key; None (it runs alone, on the plain path) while its workflow is in
        Collaboration mode here, where a peer computes its uncond halves (:meth:`run_plain`)."""
        if self.collab is not None and self.routes.mode(h.workflow) == "collaboration":
            return None
        return self.executor.batch_key(h.params, Options.from_json(h.options))

    def attempt(self, h: wm.Header, run: Run, work: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``work`` (the stage's computation for ``h``): ``(True, its result)``, or ``(False, None)`` when
        it stopped (a cancel or the deadline, recorded as stopped); any other error is recorded and raised."""
        try:
            return True, work()
        except (Cancelled, DeadlineExceeded) as exc:
            self.stopped(h, run, exc)
            return False, None
        except Exception as exc:
            self.errored(h, exc)
            raise

    def open_run(self, h: wm.Header) -> Run:
        """The stage starts on ``h``: its ``stage_started`` event, and the context its steps report to."""
        uid, cfg, chain = h.uid, self.config, self.chain(h)
        st = chain.stage
        costs = chain.spec.estimate_cost(h.params)
        total = sum(costs.values()) or 1.0
        before = sum(costs.get(s, 0.0) for s in chain.route[:chain.route.index(st)])
        share = costs.get(st, 0.0)
        if uid in self._started:  # the admission's round trip wrote it (admit)
            self._started.discard(uid)
        else:
            self.store.event(uid, keys.STAGE_STARTED, st, int(100 * before / total), state=keys.IN_PROGRESS)
        run = Run(costs, before, share, total)

        def progress(step: int, n: int) -> None:
            run.step, run.steps = step, n
            now = time.monotonic()
            if step == n or now - run.reported >= cfg.progress_interval_s:
                run.reported = now
                pct = int(100 * (before + share * step / max(n, 1)) / total)
                self.store.event(uid, keys.PROGRESS, st, pct, detail=f"step {step}/{n}", state=keys.IN_PROGRESS)

        run.ctx = StageContext(progress=progress, cancelled=lambda: self.store.cancel_requested(uid),
                               deadline=h.deadline, options=Options.from_json(h.options))
        self.previews.attach(run.ctx, uid, st, h.params)
        return run

    def inputs_of(self, h: wm.Header, values: dict[str, Any]) -> dict[str, Any]:
        """The stage's declared inputs (in the request's own workflow) among a message's values."""
        return {k: values[k] for k in self.chain(h).spec.stage(h.stage).inputs}

    @staticmethod
    def values_of(msg: wm.Message) -> dict[str, Any]:
        from engine.stages.components import to_torch

        values: dict[str, Any] = {k: to_torch(t) for k, t in msg.tensors.items()}
        values.update(msg.blobs)
        return values

    def stopped(self, h: wm.Header, run: Run, exc: Exception) -> None:
        """The stage gave up between steps (cancel, deadline): recorded where, and the job ended so."""
        st = h.stage
        where = f"stopped at step {run.step} of {run.steps}: {exc}"
        self.store.event(h.uid, keys.STAGE_STOPPED, st, detail=where)
        state = keys.CANCELLED if isinstance(exc, Cancelled) else keys.EXPIRED
        self.store.finish(h.uid, h.workflow, state, st, detail=where)

    def errored(self, h: wm.Header, exc: Exception) -> None:
        # the device time spent until the error is on record before handle() fails the job; the full
        # message goes to the stage run (the admin's view), never to the job's public detail
        self.store.event(h.uid, keys.STAGE_STOPPED, h.stage, detail=f"{type(exc).__name__}: {exc}"[:500])

    def fail(self, h: wm.Header, exc: Exception) -> bool:
        """Fail the job an exception in this stage ended; False when the store cannot record it (the input
        must then stay unreleased, and the caller lets the process die: its restart gets it again)."""
        log.error("request %s of %s failed in %s", h.uid, h.workflow, h.stage, exc_info=exc)
        try:
            # the client gets a stable code, the stage and the kind of error; the message and the
            # traceback are internals (tensor shapes, paths): the log has them, and the stage run
            # the ledger records (the admin's view) has the message
            self.store.finish(h.uid, h.workflow, keys.FAILED, h.stage, detail=stage_failed(h.stage, exc))
        except Exception:
            return False
        return True

    def close_run(self, h: wm.Header, run: Run, values: dict[str, Any], out: dict[str, Any], elapsed: float,
                  batch: int = 1, wall_s: float | None = None, pinned: Route | None = None,
                  uploaded: ObjectRef | None = None) -> None:
        """The stage's outputs handed on (or the result written), timed and sampled for pricing. ``elapsed``:
        the seconds the request cost the instance (its share of batched steps); ``wall_s``: since it began,
        when that differs (reported in the stage_finished event); ``pinned``: the instance the request's
        earlier chunks went to (engine.worker.chunks); ``uploaded``: the last stage's result is in the object
        store already, streamed as it was made (JobStore.finish checks it is the result)."""
        from engine.stages.components import values_to_message

        chain = self.chain(h)
        uid, st, costs, share, spec = h.uid, chain.stage, run.costs, run.share, chain.spec
        if share > 0:  # (seconds, predicted cost) of this run, for _fastest_for
            self._runs.setdefault(self._mode(h), deque(maxlen=32)).append((elapsed, share))
        model = spec.costs.get(st)
        if model is not None and self.runs:  # a process's first run pays one-off costs (see record)
            d = spec.dims(h.params)
            self.fits[h.workflow] = self._samples(h.workflow).add(model.units(d), model.steps(d), elapsed)
        ctx = run.ctx
        helped = f" (collaboration: {ctx.cfg_parallel.steps_helped} halves by {ctx.cfg_parallel.helper.instance})" \
            if ctx is not None and ctx.cfg_parallel is not None else ""
        values.update(out)
        tensors, blobs = values_to_message({k: values[k] for k in spec.carried_after(st)})
        h.timestamps[st] = time.time()
        if chain.next_stage is None:
            final = blobs.get(spec.final_output)
            if final is None:
                raise RuntimeError(f"last stage {st} did not produce {spec.final_output!r}")
        # Before the hand-off (or the terminal event): once the next stage has the message it may finish
        # the job before this line runs, and the stream must show this stage's end first.
        skipped = ctx.stats.get("cache_skipped") if ctx is not None else None
        self.store.event(uid, keys.STAGE_FINISHED, st, int(100 * (run.before + share) / run.total),
                         detail=f"{elapsed if wall_s is None else wall_s:.3f}s{helped}"
                                + (f" batch={batch}" if batch > 1 else "")
                                + (f" cache_skipped={skipped:.3f}" if skipped is not None else ""))
        if chain.next_stage is None:
            self.store.finish(uid, h.workflow, keys.COMPLETED, st, result=final, uploaded=uploaded)
            self.store.mark_done(uid, st)
        else:
            h.stage = chain.next_stage
            route = self._send(h, tensors, blobs, costs.get(chain.next_stage, 0.0), pinned)
            self.store.handed_on(uid, st, route.node, route.instance)  # where it went, and this stage done

    def record(self, occupied: float, workflow: str | None = None) -> None:
        """Report how long the instance was occupied by one request, from taking it off the ring to handing
        it on (decode, checks, the stage, events, the send): the service time Theorem 1 needs, not just the
        stage's compute. A new process's first run pays one-off costs (lazy initialisation, allocator and
        kernel warm-up): counted as busy time, but not offered to the Node Manager as the stage's service
        time, where it would make every freshly moved instance look slow and the allocation flap."""
        cfg = self.config
        wf = workflow or cfg.workflow
        fields: dict[str, Any] = {"workflow": cfg.workflow, "stage": cfg.stage}
        if self.runs:  # the last run's, and per workflow (a shared pool's members cost differently)
            fields["last_stage_s"] = fields[f"last_stage_s.{wf}"] = round(occupied, 6)
        fit = self.fits.get(wf)
        if fit is not None:
            fields[f"price_fit.{wf}"] = fit.to_json()
        hot = getattr(self.executor, "hot", None)  # LoRA adapters loaded here (engine.adapters.hot), for the report
        if hot is not None:
            fields["adapters"] = json.dumps(hot.report())
        self.runs += 1
        self.store.instances.record(cfg.instance, fields, occupied)

    # -- delivery --------------------------------------------------------------------------------
    def _send(self, h: wm.Header, tensors: dict[str, wm.TensorData], blobs: dict[str, Any], cost: float,
              pinned: Route | None = None) -> Route:
        """Encode straight into a reserved span of the chosen instance's ring (no staging buffer); ``pinned``:
        that instance only (a request's later chunks go where its first went).

        No refill callback is given: the carried inputs are views into our own
        inbox slot, which is released right after, so the producer keeps a copy
        for retransmission instead.
        """
        size = wm.encoded_size(h, tensors, blobs)
        deadline = time.monotonic() + self.config.send_timeout_s
        delay = 0.05
        while True:
            candidates = self.routes.candidates(h.workflow, h.stage)
            if pinned is not None:  # gone from the routes: its chunks are lost with it, so the request fails
                candidates = [r for r in candidates if r.instance == pinned.instance]
            if candidates:
                route = self.deliver.choose_for(candidates, cost, Options.from_json(h.options).lora, h.stage)  # adapter affinity
                try:
                    res = self.producers.get(route).reserve(size, timeout=1.0)
                    wm.encode_into(res.view, h, tensors, blobs)
                    res.commit()
                    self.outstanding.sent(route.instance, cost)
                    return route  # the caller records where it went (JobStore.handed_on)
                except TransportError as exc:
                    log.warning("send to %s failed (%s); retrying", route.instance, exc)
                    self.producers.drop(route.instance)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no instance of {h.workflow}/{h.stage} took the request "
                                   f"within {self.config.send_timeout_s:.0f}s")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            self.routes.candidates(h.workflow, h.stage, fresh=True)

    def close(self) -> None:
        self.previews.close()
        if self.collab is not None:
            self.collab.stop()
        self.producers.close()
        self.consumer.close()
