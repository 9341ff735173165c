"""Hot adapters of one denoise instance: an LRU of LoRA adapters loaded into its model, loaded off the
request path, applied per group of requests with diffusers' PEFT integration.

* **Off the request path.** :meth:`HotAdapters.request` hands a missing adapter to a reader thread of its
  own (``onepiece-adapter-load``), which reads and checks the file (its sha256 must be the digest the request
  carries) and converts it as the pipeline's ``load_lora_weights`` does (``lora_state_dict``; Wan's t2v-to-i2v
  expansion). The serving thread only installs a finished read (``load_lora_adapter``, between steps, so no
  forward ever sees a model half-changed) and goes on stepping the requests whose adapters are ready: a
  request waits for its own adapter's read, never for another's.
* **Applied per group.** :meth:`activate` is ``set_adapters(names, weights)`` for a request's adapter set
  (``disable_lora`` for none): the forward pass is then PEFT's own (base layer, plus each active adapter's
  ``lora_B(lora_A(x)) * scale`` in the request's order), the code the one-call pipeline runs after
  ``load_lora_weights`` + ``set_adapters``, so the bytes are the same.
* **LRU.** At most ``max_adapters`` stay loaded; beyond that the least recently used one that no request in
  flight needs is deleted (``delete_adapters``). Adapters are keyed by digest: two names of the same bytes
  share one slot.

Hot-swap (``load_lora_adapter(hotswap=True)``) replaces an adapter's weights in place so that a compiled model
need not recompile; this engine does not compile its models, and a delete + load keeps the PEFT layers
exactly those of a fresh ``load_lora_weights`` (hot-swap pads ranks), so it is not used.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from engine.adapters.registry import AdapterStore, digest_of, store

log = logging.getLogger("onepiece.adapters")

AdapterSet = tuple[tuple[str, float, str], ...]  # ((name, scale, digest), ...), engine.adapters.request.adapter_set


class AdapterLoadFailed(RuntimeError):
    """An adapter a request needs could not be loaded (file missing, digest changed, unreadable)."""


def slot(digest: str) -> str:
    """The PEFT adapter name of the adapter with these bytes (PEFT names may not contain '.')."""
    return f"lora_{digest[:24]}"


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class HotAdapters:
    """The loaded adapters of ``model`` (a diffusers model with ``PeftAdapterMixin``) for ``workflow``.

    ``read(path, digest)`` -> (state_dict, network_alphas, metadata): the loader's read, replaceable by tests (a
    deliberately slow store). Every method but the loader's read runs on the serving thread (or under the
    caller's model lock)."""

    def __init__(self, model: Any, workflow: str, max_adapters: int = 8, adapters: AdapterStore | None = None,
                 read: Callable[[Path, str], tuple[Any, Any, Any]] | None = None, *,
                 adapts: tuple[str, str]) -> None:
        """``adapts``: (the model's component, the diffusers pipeline whose LoRA loader reads its adapters),
        as the executor that serves ``model`` declares it (``StageExecutor.adapts``)."""
        self.model, self.workflow = model, workflow
        self.component, pipeline = adapts
        import diffusers

        self.pipeline_cls = getattr(diffusers, pipeline)
        self.max_adapters = max(1, int(max_adapters))
        self.store = adapters or store()
        self.read = read or self._read
        self.loaded: OrderedDict[str, str] = OrderedDict()  # slot -> a name it was loaded for (LRU order)
        self.pending: dict[str, Future] = {}
        self.failed: dict[str, str] = {}  # slot -> why (until asked again)
        self._readers: list[threading.Thread] = []
        self._active: tuple[tuple[str, float], ...] | None = None  # what the model has active now
        self.load_s: deque[float] = deque(maxlen=1024)  # read + install, per adapter loaded
        self.swap_s: deque[float] = deque(maxlen=4096)  # set_adapters / disable_lora, per change
        self.evicted = 0

    # -- the loader thread -------------------------------------------------------------------
    def _read(self, path: Path, digest: str) -> tuple[Any, Any, Any]:
        if digest_of(path) != digest:
            raise AdapterLoadFailed(f"{path.name}: its bytes are not the registered digest {digest[:12]}")
        got = self.pipeline_cls.lora_state_dict(str(path), return_lora_metadata=True)
        state, alphas, meta = got if len(got) == 3 else (got[0], None, got[1])
        expand = getattr(self.pipeline_cls, "_maybe_expand_t2v_lora_for_i2v", None)
        if expand is not None:
            state = expand(transformer=self.model, state_dict=state)
        return state, alphas, meta

    def _read_into(self, fut: Future, path: Path, digest: str) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        t0 = time.perf_counter()
        try:
            got = self.read(path, digest)
        except BaseException as exc:
            fut.set_exception(exc)
        else:
            fut.set_result((time.perf_counter() - t0, got))

    # -- the serving thread -----------------------------------------------------------------
    def request(self, adapters: AdapterSet) -> None:
        """Start loading what ``adapters`` needs and is neither loaded nor being read."""
        for name, _scale, digest in adapters:
            s = slot(digest)
            if s in self.loaded or s in self.pending:
                continue
            self.failed.pop(s, None)
            entry = self.store.get(name)
            try:
                if entry is None or entry.digest != digest:
                    raise AdapterLoadFailed(f"adapter {name!r} ({digest[:12]}) is no longer in the registry")
                path = self.store.file(entry)
            except Exception as exc:
                self.failed[s] = str(exc)
                continue
            fut: Future = Future()
            fut.name = name  # type: ignore[attr-defined]
            self.pending[s] = fut
            # one reader thread per adapter being read: a slow read never holds up another adapter's
            reader = threading.Thread(target=self._read_into, args=(fut, path, digest), daemon=True,
                                      name="onepiece-adapter-load")
            self._readers = [t for t in self._readers if t.is_alive()] + [reader]
            reader.start()

    def _install(self, needed: Iterable[str] = ()) -> None:
        """Install every finished read into the model, then evict beyond ``max_adapters``."""
        for s, fut in list(self.pending.items()):
            if not fut.done():
                continue
            del self.pending[s]
            try:
                read_s, (state, alphas, meta) = fut.result()
                t0 = time.perf_counter()
                self.model.load_lora_adapter(state, prefix=self.component, network_alphas=alphas,
                                             adapter_name=s, metadata=meta)
                self.loaded[s] = fut.name  # type: ignore[attr-defined]
                self._active = None  # loading may change which adapters PEFT has active
                self.load_s.append(read_s + time.perf_counter() - t0)
            except Exception as exc:
                log.warning("could not load adapter %s: %s", getattr(fut, "name", s), exc)
                self.failed[s] = str(exc)
        keep = set(needed)
        while len(self.loaded) > self.max_adapters:
            victim = next((s for s in self.loaded if s not in keep), None)
            if victim is None:
                break  # every loaded adapter is needed by a request in flight: over the bound until they end
            del self.loaded[victim]
            self.model.delete_adapters(victim)
            self._active = None
            self.evicted += 1

    def ready(self, adapters: AdapterSet, needed: Iterable[str] = ()) -> bool:
        """Whether every adapter of ``adapters`` is loaded (installing finished reads first); raises
        :class:`AdapterLoadFailed` when one of them could not be loaded. ``needed``: slots not to evict."""
        self._install(needed)
        ok = True
        for name, _scale, digest in adapters:
            s = slot(digest)
            if s in self.failed:
                raise AdapterLoadFailed(f"adapter {name!r}: {self.failed.pop(s)}")
            if s not in self.loaded:
                if s not in self.pending:
                    self.request(((name, _scale, digest),))
                    if s in self.failed:
                        raise AdapterLoadFailed(f"adapter {name!r}: {self.failed.pop(s)}")
                ok = False
        return ok

    def wait_any(self, timeout: float) -> None:
        """Block until a read finishes (or ``timeout``): what a stage with nothing ready to step does."""
        futures = list(self.pending.values())
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def activate(self, adapters: AdapterSet) -> None:
        """Make ``adapters`` (loaded) the model's active set with their scales, in order; none: LoRA off."""
        want = tuple((slot(d), float(sc)) for _n, sc, d in adapters)
        if want == self._active:
            return
        t0 = time.perf_counter()
        if not want:
            if self.loaded:
                self.model.disable_lora()
        else:
            for s, _w in want:
                self.loaded.move_to_end(s)
            self.model.enable_lora()
            self.model.set_adapters([s for s, _ in want], [w for _, w in want])
        self._active = want
        self.swap_s.append(time.perf_counter() - t0)

    # -- mixed batches ----------------------------------------------------------------------------
    def mixable(self, sets: Sequence[AdapterSet]) -> bool:
        """Whether requests with these adapter sets can share one forward pass with PEFT's per-sample
        ``adapter_names`` (:meth:`mixed`): each has at most one adapter, an adapter has one scale among them,
        and every LoRA layer of the model is a kind that takes mixed batches (Linear, Conv)."""
        scales: dict[str, float] = {}
        for st in sets:
            if len(st) > 1:
                return False
            for _n, sc, d in st:
                if scales.setdefault(d, float(sc)) != float(sc):
                    return False
        return bool(self._layers())

    def _layers(self) -> list[Any]:
        if getattr(self, "_layer_cache", None) is None or self._layer_cache[0] != frozenset(self.loaded):
            from peft.tuners.lora import layer as lora

            kinds = (lora.Linear, lora.Conv2d)
            mods = [m for m in self.model.modules() if isinstance(m, lora.LoraLayer)]
            self._layer_cache = (frozenset(self.loaded), mods if all(isinstance(m, kinds) for m in mods) else [])
        return self._layer_cache[1]

    def mixed(self, sets: Sequence[AdapterSet], rows: int) -> Any:
        """A context in which one forward pass serves rows of several adapter sets (``rows`` rows per set, in
        order): every adapter of ``sets`` active with its scale (``set_adapters``), and each LoRA layer given
        PEFT's per-sample ``adapter_names`` (``__base__`` for a request without adapters). PEFT then adds each
        adapter's ``lora_B(lora_A(x)) * scale`` to its own rows only: per row, the arithmetic of a solo pass."""
        import contextlib

        union: dict[str, tuple[str, float, str]] = {}
        for st in sets:
            for n, sc, d in st:
                union.setdefault(d, (n, sc, d))
        names = [slot(st[0][2]) if st else "__base__" for st in sets for _ in range(rows)]
        self.activate(tuple(union.values()))
        if not union:
            return contextlib.nullcontext()

        def inject(_module: Any, args: Any, kwargs: Any) -> Any:
            return args, {**kwargs, "adapter_names": names}

        @contextlib.contextmanager
        def hooks() -> Any:
            handles = [m.register_forward_pre_hook(inject, with_kwargs=True) for m in self._layers()]
            try:
                yield
            finally:
                for h in handles:
                    h.remove()

        return hooks()

    # -- reports --------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The adapters loaded now (the names they were loaded for), least recently used first."""
        return list(self.loaded.values())

    def report(self) -> dict[str, Any]:
        return {"loaded": self.names(), "loading": [getattr(f, "name", s) for s, f in self.pending.items()],
                "max": self.max_adapters, "evicted": self.evicted,
                "load_s_p50": _percentile(self.load_s, 0.5), "load_s_p99": _percentile(self.load_s, 0.99),
                "swap_s_p50": _percentile(self.swap_s, 0.5), "swap_s_p99": _percentile(self.swap_s, 0.99)}

    def close(self) -> None:
        """Wait for the reads in progress (tests: no reader thread outlives them)."""
        for reader in self._readers:
            reader.join()
        self._readers = []
