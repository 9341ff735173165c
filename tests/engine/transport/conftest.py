from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("ring_child.py")
_names = itertools.count()


@pytest.fixture
def ring_name() -> str:
    return f"test-{os.getpid()}-{next(_names)}"


class Children:
    """Child processes started by a test; all are killed and reaped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: object) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [sys.executable, str(CHILD), *map(str, args)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)


@pytest.fixture
def children() -> Iterator[Children]:
    c = Children()
    yield c
    c.close()
