"""One long-lived object per key (a Redis client per URL, an engine client per settings), made on first use."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Keyed(Generic[T]):
    """``get(key)`` makes ``make(key)`` once and returns it after; ``clear()`` closes and forgets them all.
    Thread-safe."""

    def __init__(self, make: Callable[[Hashable], T], close: Callable[[T], None]) -> None:
        self._make, self._close = make, close
        self._items: dict[Hashable, T] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> T:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                item = self._items[key] = self._make(key)
            return item

    def clear(self) -> None:
        with self._lock:
            for item in self._items.values():
                self._close(item)
            self._items.clear()
