"""NIXL notifications under the driver's control, and the bounded waits of the vLLM driver.

Real NIXL work (a READ, a notification, the handshake) completes on UCX's threads, so the
driver waits for it. Those waits only guard against a hang: in a healthy run they end in
milliseconds, so they are bounded by HANG_TIMEOUT_S, generous enough that load on the
machine rarely makes a healthy run miss it. When one does expire it raises WaitTimeout,
which no caller turns into a verdict: the trace is retried with a longer limit
(`Waits.scaled`) and otherwise reported inconclusive (kvspec.replay.retry_timeouts).
`Waits` carries the limit, clock and sleep, so a driver's limit is injected, and a test
decides a timeout by construction instead of by racing the wall clock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvspec.drivers.base import WaitTimeout

HANG_TIMEOUT_S = 120.0
POLL_INTERVAL_S = 0.0005


class ClusterError(RuntimeError):
    """The cluster could not be brought to a consistent state (not a timeout)."""


def wait_until(
    done: Callable[[], bool],
    what: str,
    timeout: float = HANG_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll `done` until it holds; WaitTimeout(what, timeout) once `timeout` has passed."""
    deadline = clock() + timeout
    while not done():
        if clock() > deadline:
            raise WaitTimeout(what, timeout)
        sleep(POLL_INTERVAL_S)


@dataclass(frozen=True)
class Waits:
    """How long, and by which clock, the driver and its cluster wait for NIXL's work."""

    limit_s: float = HANG_TIMEOUT_S
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def until(self, done: Callable[[], bool], what: str) -> None:
        wait_until(done, what, self.limit_s, self.clock, self.sleep)

    def scaled(self, factor: float) -> Waits:
        return replace(self, limit_s=self.limit_s * factor)


DEFAULT_WAITS = Waits()


class NotifInbox:
    """Notifications that reached one producer rank's NIXL agent.

    vLLM's `_get_new_notifs` reads them through `nixl_wrapper.get_new_notifs()`; that call
    is routed here. A read's "req:1" notification is held from its arrival until the
    spec's `consumer_get_finished` delivers it (network delay is the spec's, so the driver
    decides when it lands); delivered but unread ones are the spec's `notif`.
    In push mode the producer's `nixl-push-writer` thread calls it too (push_worker.py
    `_push_writer_loop`), hence the lock.
    """

    def __init__(self, wrapper: Any) -> None:
        self.wrapper = wrapper
        self._poll_agent = wrapper.get_new_notifs  # the real bound method
        self.arrived: list[tuple[str, bytes]] = []
        self.delivered: list[tuple[str, bytes]] = []
        self.lock = threading.RLock()
        wrapper.get_new_notifs = self.get_new_notifs

    def poll(self) -> None:
        with self.lock:
            for agent, msgs in self._poll_agent().items():
                self.arrived.extend((agent, m) for m in msgs)

    def get_new_notifs(self, backends: list[str] | None = None) -> dict[str, list[bytes]]:
        with self.lock:
            self.poll()
            out: dict[str, list[bytes]] = {}
            for agent, msg in self.delivered:
                out.setdefault(agent, []).append(msg)
            self.delivered = []
            return out

    def deliver(self, item: tuple[str, bytes]) -> None:
        with self.lock:
            self.delivered.append(item)

    def take_arrived(self, msg: bytes) -> tuple[str, bytes] | None:
        """Remove and return the first arrived (agent, msg); None if it has not arrived."""
        with self.lock:
            self.poll()
            for item in self.arrived:
                if item[1] == msg:
                    self.arrived.remove(item)
                    return item
            return None

    def wait_arrived_where(
        self, pred: Callable[[bytes], bool], what: str, waits: Waits
    ) -> tuple[str, bytes]:
        """The first arrived (agent, msg) with pred(msg), once one has arrived (removed)."""
        got: list[tuple[str, bytes]] = []

        def arrived() -> bool:
            with self.lock:
                self.poll()
                for item in self.arrived:
                    if pred(item[1]):
                        self.arrived.remove(item)
                        got.append(item)
                        return True
            return False

        waits.until(arrived, what)
        return got[0]

    def wait_arrived(self, msg: bytes, waits: Waits) -> tuple[str, bytes]:
        """The arrived (agent, msg), once it has arrived (WaitTimeout if it does not)."""
        got: list[tuple[str, bytes]] = []

        def arrived() -> bool:
            item = self.take_arrived(msg)
            if item is not None:
                got.append(item)
            return item is not None

        waits.until(arrived, f"notification {msg!r}")
        return got[0]

    def reset(self) -> None:
        """Forget every notification. One that a previous trace's READ sends after this
        lands in `arrived` and stays invisible (only `delivered` is the spec's `notif`):
        it carries the same agent and message as the one a later trace would wait for,
        so matching it instead changes nothing the spec observes."""
        with self.lock:
            self.poll()
            self.arrived.clear()
            self.delivered.clear()

    def restore(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.wrapper.get_new_notifs
