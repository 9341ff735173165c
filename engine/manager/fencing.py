"""Fenced values: what the leader writes carries its token; readers drop older tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Fenced:
    token: int
    payload: Any

    def encode(self) -> str:
        return json.dumps({"token": self.token, "payload": self.payload}, sort_keys=True)

    @classmethod
    def decode(cls, raw: str | bytes) -> Fenced:
        d = json.loads(raw)
        return cls(int(d["token"]), d["payload"])


class FenceGate:
    """Accepts a value only if its token is at least the newest seen (per key family).

    A TaskManager keeps one gate for the assignments it receives: a deposed leader's
    write that raced past etcd's check (or an old value replayed by a watch) is ignored.
    """

    def __init__(self) -> None:
        self.newest = 0
        self.refused = 0

    def admit(self, value: Fenced) -> bool:
        if value.token < self.newest:
            self.refused += 1
            return False
        self.newest = value.token
        return True
