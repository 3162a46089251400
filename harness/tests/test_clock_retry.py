"""A KVClock or LeaseClock replay whose wait expires is retried on a fresh driver with longer
waits, and one still expired is a timeout (inconclusive), never a verdict: both go through
replay.retry_expired (clock_traces.replay_retrying serves the conformance rows and the kept
counterexamples alike; lease_traces._replay_retrying the lease rows;
decode_traces.replay_with_retry the decode rows). No vLLM, no clock: the
fake drivers expire by construction."""

from __future__ import annotations

from typing import Any

import kvspec.clock_traces as ct
import kvspec.decode_traces as dt
import kvspec.lease_traces as lt
import pytest
from kvspec.clock_traces import ClockReplay, replay_retrying
from kvspec.drivers.base import WaitTimeout
from kvspec.lease_replay import LeaseReplay
from kvspec.replay import WAIT_GROWTH
from kvspec.sweep import SweepRow

DOC: dict[str, Any] = {"states": []}  # never read: replay_clock is replaced below


class _Driver:
    """A driver whose set-up wait expires (a P that never answers) when `expires`."""

    def __init__(self, expires: bool) -> None:
        self.expires = expires

    def __enter__(self) -> _Driver:
        if self.expires:
            raise WaitTimeout("the handshake", 5.0)
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _Factory:
    """Records each driver's wait scale; the first `expire` drivers expire."""

    def __init__(self, expire: int) -> None:
        self.expire = expire
        self.scales: list[float] = []

    def __call__(self, row: Any, patch: Any, wait_scale: float) -> _Driver:
        self.scales.append(wait_scale)
        return _Driver(len(self.scales) <= self.expire)


@pytest.fixture(autouse=True)
def _replay_ends_at_step_3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "replay_clock", lambda doc, driver: ClockReplay(3, None))
    monkeypatch.setattr(lt, "replay_lease", lambda doc, driver: LeaseReplay(3, None))
    monkeypatch.setattr(dt, "replay", lambda trace, driver: dt.Replay(3))


def test_an_expired_wait_is_retried_with_longer_waits() -> None:
    make = _Factory(expire=1)
    assert replay_retrying(DOC, None, None, make) == ClockReplay(3, None)  # type: ignore[arg-type]
    assert make.scales == [1.0, WAIT_GROWTH]


def test_negative_control_still_expired_is_a_timeout_not_a_verdict() -> None:
    make = _Factory(expire=2)
    got = replay_retrying(DOC, None, None, make)  # type: ignore[arg-type]
    assert got.timeout is not None and "the handshake" in got.timeout
    assert got.divergence is None
    assert make.scales == [1.0, WAIT_GROWTH]


@pytest.mark.parametrize(("expire", "timed_out"), [(1, False), (2, True)])
def test_the_lease_rows_retry_the_same_way(expire: int, timed_out: bool) -> None:
    # (requests, wait scale, NotifFirst): the lease factory's arguments
    make = _Factory(expire=expire)
    row = SweepRow("r", {}, 1, "fast")
    got = lt._replay_retrying(DOC, row, lambda n, k, nf: make(n, nf, k), 2)
    assert (got.timeout is not None, got.divergence, make.scales) == (
        timed_out, None, [1.0, WAIT_GROWTH])


@pytest.mark.parametrize(("expire", "timed_out"), [(1, False), (2, True)])
def test_the_decode_rows_retry_the_same_way(expire: int, timed_out: bool) -> None:
    # A decode driver whose set-up wait expired used to escape the retry as an error.
    make = _Factory(expire=expire)
    got = dt.replay_with_retry([], lambda k: make(None, None, k))
    assert (got.timeout is not None, got.divergence, make.scales) == (
        timed_out, None, [1.0, WAIT_GROWTH])
