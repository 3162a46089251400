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
        self.received = 0  # every message ever polled from the agent (SentToProducer)
        self.lock = threading.RLock()
        wrapper.get_new_notifs = self.get_new_notifs

    def poll(self) -> None:
        with self.lock:
            for agent, msgs in self._poll_agent().items():
                self.arrived.extend((agent, m) for m in msgs)
                self.received += len(msgs)

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
        """Forget every notification. The cluster first waits for those still in flight
        (SentToProducer): one that landed after this would stand, in the next trace, for
        a notification that trace's D has not sent."""
        with self.lock:
            self.poll()
            self.arrived.clear()
            self.delivered.clear()

    def restore(self) -> None:
        with contextlib.suppress(AttributeError):
            del self.wrapper.get_new_notifs


class SentToProducer:
    """What the decode agents have sent the producer's agents, counted as NIXL accepts it:
    each `send_notif` (notify-only messages, heartbeats, push registrations) and each
    posted transfer that carries a notification (a READ's "r:n", pull_worker.py:546-556).
    A pooled cluster's reset waits until the producer's inboxes have received as many, so
    no message of one trace lands in the next (a CI run saw a notify-only "req-1:1" of an
    earlier trace arrive after the reset).

    The counting sits in a subclass of the agent's own class, not on the instance: the
    driver's seams and the mutants patch and then delete instance attributes, which
    would remove an instance-level counter with them."""

    def __init__(self) -> None:
        self.sent = 0
        self._lock = threading.Lock()

    def watch(self, wrapper: Any) -> None:
        ledger, base = self, type(wrapper)

        class Counted(base):  # type: ignore[valid-type,misc]
            _kvspec_notif_handles: set[Any]

            def send_notif(self, remote_agent_name: str, *a: Any, **k: Any) -> Any:
                out = super().send_notif(remote_agent_name, *a, **k)
                ledger.count(1)
                return out

            def make_prepped_xfer(self, *a: Any, **k: Any) -> Any:
                handle = super().make_prepped_xfer(*a, **k)
                if k.get("notif_msg", a[5] if len(a) > 5 else b""):
                    self._kvspec_notif_handles.add(handle)
                return handle

            def transfer(self, handle: Any, notif_msg: bytes = b"") -> Any:
                state = super().transfer(handle, notif_msg)
                carries = handle in self._kvspec_notif_handles or bool(notif_msg)
                self._kvspec_notif_handles.discard(handle)
                if carries and state != "ERR":
                    ledger.count(1)
                return state

        Counted.__name__ = f"Counted{base.__name__}"
        wrapper._kvspec_notif_handles = set()
        wrapper.__class__ = Counted

    def count(self, n: int) -> None:
        with self._lock:
            self.sent += n

    def wait_landed(self, inboxes: list[NotifInbox], waits: Waits) -> None:
        """Until the inboxes have received every message counted (WaitTimeout if not)."""

        def landed() -> bool:
            for ib in inboxes:
                ib.poll()
            return sum(ib.received for ib in inboxes) >= self.sent

        waits.until(landed, f"the {self.sent} notifications sent to the producer to land")


def serve_handshake_metadata(listener: Any, md: dict[tuple[int, int], Any], waits: Any) -> None:
    """`set_xfer_handshake_metadata_pp_aware` on a scheduler-role NIXL connector: it starts
    the side-channel listener thread and waits, without a timeout, for its socket
    (base_scheduler.py:319-334). Run on a helper thread, so a listener that died (its port
    taken) is a WaitTimeout (`waits`: a vllm_inbox.Waits) instead of a hang."""
    t = threading.Thread(
        target=listener.set_xfer_handshake_metadata_pp_aware, args=(md,), daemon=True
    )
    t.start()
    waits.until(lambda: not t.is_alive(), "NIXL's side-channel listener to start")
