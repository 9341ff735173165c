"""Each stage instance's counters and published figures on Redis (``keys.instance_key``, a hash each).

A worker counts its requests and busy seconds and publishes its last stage time, its pricing fits per
workflow and its calibration report; its TaskManager reads them into the node's report, the Proxy reads
the pricing fits, the benchmarks read the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from engine.store import keys


class InstanceStats:
    """Instances' counters on ``client`` (a ``redis.Redis``)."""

    def __init__(self, client: Any) -> None:
        self.r = client

    def record(self, instance: str, fields: Mapping[str, float | int | str], busy_s: float) -> None:
        """One request served: its fields set, ``requests`` counted and ``busy_s`` added (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.instance_key(instance), mapping=dict(fields))
        pipe.hincrby(keys.instance_key(instance), "requests", 1)
        pipe.hincrbyfloat(keys.instance_key(instance), "busy_s", busy_s)
        pipe.execute()

    def count(self, instance: str, name: str, n: int = 1) -> None:
        """Add ``n`` to one of an instance's counters (e.g. ``cfg_halves``: steps it helped a peer with)."""
        self.r.hincrby(keys.instance_key(instance), name, n)

    def price_fits(self, served: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """(instance, workflow) -> the pricing fit (engine.workflow.pricing) the instance published last for
        that workflow's requests (an instance of a shared pool fits each workflow apart), for those that have
        one: one round trip for them all."""
        pairs = list(served)
        if not pairs:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for name, workflow in pairs:
            pipe.hget(keys.instance_key(name), f"price_fit.{workflow}")
        return {p: v.decode() for p, v in zip(pairs, pipe.execute(), strict=True) if v is not None}

    def read(self, instance: str) -> dict[str, str]:
        """Every field of the instance's hash ({} for an instance that never reported)."""
        return {k.decode(): v.decode() for k, v in self.r.hgetall(keys.instance_key(instance)).items()}
