"""A KVClock replay whose wait expires is retried on a fresh driver with longer waits, and
one still expired is a timeout (inconclusive), never a verdict (clock_traces.replay_retrying,
used by the conformance rows and the kept counterexamples alike). No vLLM, no clock: the
fake drivers expire by construction."""

from __future__ import annotations

from typing import Any

import kvspec.clock_traces as ct
import pytest
from kvspec.clock_traces import WAIT_GROWTH, ClockReplay, replay_retrying
from kvspec.drivers.base import WaitTimeout

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

    def __call__(self, row: Any, patch: str | None, wait_scale: float) -> _Driver:
        self.scales.append(wait_scale)
        return _Driver(len(self.scales) <= self.expire)


@pytest.fixture(autouse=True)
def _replay_ends_at_step_3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "replay_clock", lambda doc, driver: ClockReplay(3, None))


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
