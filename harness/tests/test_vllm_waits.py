"""Waits and timeouts of the vLLM driver, decided by construction (an injected clock, a
poll that finds nothing k - 1 times): an expired wait is a timeout, retried with a longer
limit, then inconclusive; never a divergence.
"""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from kvspec.drivers.base import WaitTimeout
from kvspec.drivers.vllm_inbox import (
    ClusterError,
    NotifInbox,
    Waits,
    wait_until,
)
from kvspec.matrix import ModelRow
from kvspec.model import Action
from kvspec.replay import (
    ReplayResult,
    SpecTrace,
    replay,
    replay_fresh,
    retry_timeouts,
    trace_from_actions,
)
from vllm_tests import PREFILL, require_vllm_driver

pytestmark = pytest.mark.vllm

require_vllm_driver()

from kvspec.drivers import vllm_consumers  # noqa: E402
from kvspec.drivers.vllm_driver import VllmDriver  # noqa: E402


def row() -> ModelRow:
    from kvspec.matrix import Topology

    return ModelRow("t", "v0.30-shipped", "nixl", Topology(1, 1, 1), 2, 2, False)


def test_a_wait_times_out_by_its_clock_not_the_wall_clock() -> None:
    ticks = itertools.count()
    polls: list[float] = []
    with pytest.raises(WaitTimeout, match="the READ did not happen in 120.0s") as exc:
        # Each poll advances the fake clock by 10 s: it times out on the 14th, at once.
        wait_until(lambda: False, "the READ", clock=lambda: 10.0 * next(ticks), sleep=polls.append)
    assert (exc.value.what, exc.value.limit_s) == ("the READ", 120.0)
    assert len(polls) == 12
    done = iter([False, False, True])
    wait_until(lambda: next(done), "x", clock=lambda: 0.0, sleep=lambda _: None)


def test_vllms_own_handshake_timeout_is_a_wait_timeout_any_other_failure_is_not() -> None:
    import zmq

    def handshake(exc: BaseException) -> None:
        fut: Future[None] = Future()
        fut.set_exception(exc)
        cw = SimpleNamespace(_ensure_handshake=lambda *a: fut, _remote_agents={})
        vllm_consumers.handshake(cw, "engine", 1, 1, Waits())

    with pytest.raises(WaitTimeout, match="side-channel reply did not happen in 5.0s"):
        handshake(zmq.Again())  # vLLM's RCVTIMEO expired: a timeout under load
    with pytest.raises(ClusterError, match="failed: incompatible"):
        handshake(RuntimeError("incompatible NixlHandshakePayload"))


def _spec_trace(rw: ModelRow, *actions: str) -> SpecTrace:
    return trace_from_actions(rw, [Action.parse(a) for a in actions], f"{rw.name}/t")


def _arrives_on_poll(inbox: NotifInbox, k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow network, by construction: the driver's first k - 1 polls for a notification
    find nothing; the k-th returns it once it has really arrived (the default guard)."""
    polls: Counter[bytes] = Counter()

    def take(msg: bytes) -> tuple[str, bytes] | None:
        polls[msg] += 1
        if polls[msg] < k:
            return None
        got: list[tuple[str, bytes] | None] = [None]

        def arrived() -> bool:
            got[0] = NotifInbox.take_arrived(inbox, msg)
            return got[0] is not None

        wait_until(arrived, f"{msg!r} (test)")
        return got[0]

    monkeypatch.setattr(inbox, "take_arrived", take)


def test_a_late_notification_is_a_timeout_then_a_longer_wait_conforms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rw = row()
    trace = _spec_trace(rw, *PREFILL, *PREFILL, "heartbeat(1)")  # one wait: HB's arrival
    with VllmDriver(rw):
        pass  # the pool holds the built cluster: no handshake runs under the fake clock
    # Nor does the pool's reset (its own bound, cluster_pool.POOL_WAITS, on the real
    # clock): it waits for the timed-out attempt's heartbeat to land, and the cluster goes
    # back to the pool.
    results: list[ReplayResult] = []

    def once(scale: float) -> ReplayResult:
        # Each poll advances the clock by 1 s: a limit of 3 s allows 4 polls, 6 s allows 7.
        waits = Waits(limit_s=3.0 * scale, clock=itertools.count().__next__, sleep=lambda _: None)
        d = VllmDriver(rw, waits=waits)
        _arrives_on_poll(d.c.inboxes[0], 6, monkeypatch)
        with d:
            results.append(replay(d, trace))
        return results[-1]

    res = retry_timeouts(once, attempts=3, growth=2.0)
    first = results[0]
    assert first.failure is None and first.timeout is not None  # inconclusive, not MISSING
    assert (first.timeout.step, first.timeout.action) == (7, "heartbeat(1)")
    assert (first.timeout.what, first.timeout.limit_s) == ("notification b'HB:req-1'", 3.0)
    assert res.ok and res.attempts == 2 and len(results) == 2


def test_a_zero_wait_limit_is_never_a_divergence() -> None:
    rw = row()
    trace = _spec_trace(
        rw, *PREFILL, *PREFILL, "consumer_start_load_kv(1, 0)", "consumer_get_finished(1, 0)",
        "heartbeat(2)", *PREFILL,
    )  # fmt: skip
    # Whether UCX finished before the first poll (of the handshake, if the pool has no
    # cluster of this shape; of a READ; of a notification) is up to the machine: either
    # way the replay conformed or was inconclusive, never "vLLM cannot take this step".
    res = replay_fresh(lambda rw: VllmDriver(rw, waits=Waits(limit_s=0.0)), trace)
    assert res.failure is None
    assert res.ok or (res.timeout is not None and res.timeout.limit_s == 0.0)
    assert replay_fresh(VllmDriver, trace).ok
