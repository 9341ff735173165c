"""The step batcher speaks to its worker through one interface, ``engine.worker.batching.StageHost``.

Read from the source: every attribute the batcher reads of its worker (``self.w``) must be a member of
``StageHost``, and the TaskWorker must have every member with the signature the protocol gives. A batcher
that reaches into the worker again (a private method, the consumer, a counter) fails here.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

from engine.worker.batching import StageHost, StepBatcher
from engine.worker.taskworker import TaskWorker


def members(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


def reached(source: str, attr: str = "w") -> set[str]:
    """The attributes the methods in ``source`` read of ``self.<attr>``."""
    tree = ast.parse(textwrap.dedent(source))
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == attr and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}


def test_the_batcher_reads_nothing_of_its_worker_but_the_interface() -> None:
    used = reached(inspect.getsource(StepBatcher))
    assert used, "the batcher reads its worker through self.w"
    assert used <= members(StageHost), sorted(used - members(StageHost))


def test_the_taskworker_is_a_stage_host() -> None:
    for name in members(StageHost):
        want = [p for p in inspect.signature(getattr(StageHost, name)).parameters if p != "self"]
        got = [p for p in inspect.signature(getattr(TaskWorker, name)).parameters if p != "self"]
        assert got == want, (name, got, want)


def test_a_batcher_reaching_past_the_interface_is_caught() -> None:
    planted = """
        class Reaching:
            def take(self) -> None:
                self.w.consumer.recv_many(8, timeout=0.0)
                self.w._record(1.0)
                self.w.admit(None)
        """
    assert reached(planted) - members(StageHost) == {"consumer", "_record"}
