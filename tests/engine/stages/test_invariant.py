"""engine.stages.invariant: inside a batched call a 2-D linear gives each request's rows the bytes of their
own call, in the calling thread only; outside it, nn.Linear is F.linear."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


def test_each_requests_rows_get_the_bytes_of_their_own_call() -> None:
    from engine.stages import invariant

    torch.manual_seed(0)
    for k, n in ((16, 16), (320, 1280)):
        lin = torch.nn.Linear(k, n)
        for requests in (2, 3, 7, 8):
            x = torch.randn(2 * requests, k)
            alone = torch.cat([lin(x[2 * i: 2 * i + 2]) for i in range(requests)])
            with invariant.rows_per_request(2):
                batched = lin(x)
                tokens = lin(x.reshape(requests, 2, k))  # a 3-D input is one call as before
            assert torch.equal(batched, alone)
            assert torch.equal(tokens, F.linear(x.reshape(requests, 2, k), lin.weight, lin.bias))
            assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # outside: the plain call


def test_a_silu_over_rows_gives_each_request_the_bytes_of_its_own_call() -> None:
    """torch's vectorised SiLU takes the tail of a tensor element by element with another exp: a row 48 wide
    (the tiny Qwen transformer's) starts at another place in the loop in a batch than alone. Inside the
    batched call each request's rows are their own call; whether the plain call differs depends on the
    host's vector width, so only the chunked bytes are asserted."""
    from engine.stages import invariant

    torch.manual_seed(0)
    act = torch.nn.SiLU()
    for width in (48, 40, 3072):
        x = torch.randn(5, width)
        alone = torch.cat([F.silu(x[i:i + 1]) for i in range(5)])
        with invariant.rows_per_request(1):
            assert torch.equal(act(x), alone)
            assert torch.equal(act(x.reshape(1, 5, width)), F.silu(x.reshape(1, 5, width)))  # 3-D: one call
        assert torch.equal(act(x), F.silu(x))  # outside: the plain call


def test_only_the_thread_in_the_batched_call_chunks() -> None:
    from engine.stages import invariant

    lin = torch.nn.Linear(32, 32)
    x = torch.randn(8, 32)
    entered, other_done = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def other() -> None:
        entered.wait(10)
        seen["plain"] = torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
        other_done.set()

    t = threading.Thread(target=other)
    t.start()
    with invariant.rows_per_request(2):
        entered.set()
        assert other_done.wait(10)
        inside = lin(x)
    t.join()
    assert seen["plain"]
    assert torch.equal(inside, torch.cat([lin(x[i: i + 2]) for i in range(0, 8, 2)]))
