"""A pooled cluster's reset waits for the notifications still in flight to the producer
(vllm_inbox.SentToProducer), so none of one trace lands in the next. Decided by
construction: a fake agent whose messages arrive on a chosen poll, an injected clock.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from kvspec.drivers.base import WaitTimeout
from kvspec.drivers.vllm_inbox import NotifInbox, SentToProducer, Waits


class FakeAgent:
    """The slice of nixl_agent the ledger counts (send_notif, make_prepped_xfer,
    transfer); what it sends reaches `peer` after `delay` polls of the peer."""

    def __init__(self, peer: FakeAgent | None = None, delay: int = 0) -> None:
        self.peer, self.delay = peer, delay
        self.in_flight: list[tuple[int, bytes]] = []  # (polls left, message)
        self.handles = itertools.count()
        self.notif: dict[int, bytes] = {}

    def send_notif(self, remote_agent_name: str, notif_msg: bytes = b"") -> None:
        assert self.peer is not None
        self.peer.in_flight.append((self.delay, notif_msg))

    def make_prepped_xfer(self, op: str, *a: Any, notif_msg: bytes = b"") -> int:
        h = next(self.handles)
        self.notif[h] = notif_msg
        return h

    def transfer(self, handle: int, notif_msg: bytes = b"") -> str:
        msg = notif_msg or self.notif[handle]
        if msg:  # sent with the transfer's completion, not through send_notif
            assert self.peer is not None
            self.peer.in_flight.append((self.delay, msg))
        return "PROC"

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        ready = [m for d, m in self.in_flight if d <= 0]
        self.in_flight = [(d - 1, m) for d, m in self.in_flight if d > 0]
        return {"D": ready} if ready else {}


def _pair(delay: int) -> tuple[FakeAgent, NotifInbox, SentToProducer]:
    p = FakeAgent()
    d = FakeAgent(peer=p, delay=delay)
    ledger = SentToProducer()
    ledger.watch(d)
    return d, NotifInbox(p), ledger


NOW = Waits(limit_s=120.0, clock=lambda: 0.0, sleep=lambda _: None)


def test_the_ledger_counts_notifications_and_notifying_transfers_only() -> None:
    d, _, ledger = _pair(0)
    d.send_notif("P", b"req-1:1")  # notify-only (pull_worker.py:379)
    d.transfer(d.make_prepped_xfer("READ", 0, [1], 0, [1], notif_msg=b"req-2:1"))
    d.transfer(d.make_prepped_xfer("READ", 0, [1], 0, [1]))  # no notification
    assert ledger.sent == 2
    assert type(d).__name__ == "CountedFakeAgent" and isinstance(d, FakeAgent)


def test_an_instance_seam_removed_afterwards_leaves_the_counting_in_place() -> None:
    # The driver's seams patch send_notif on the instance and delete it when done
    # (decode_seams.HeldReads.restore): the ledger's counting must survive that.
    d, _, ledger = _pair(0)
    real = d.send_notif
    d.send_notif = lambda agent, notif_msg=b"": real(agent, notif_msg)  # type: ignore[method-assign,assignment]
    d.send_notif("P", b"a:1")
    del d.send_notif
    d.send_notif("P", b"b:1")
    assert ledger.sent == 2


def test_reset_waits_for_a_late_notification_so_the_next_trace_never_sees_it() -> None:
    d, inbox, ledger = _pair(delay=3)  # lands on the producer's 4th poll
    d.send_notif("P", b"req-1:1")
    ledger.wait_landed([inbox], NOW)
    inbox.reset()
    assert inbox.take_arrived(b"req-1:1") is None
    assert inbox.received == 1


def test_negative_control_without_the_wait_the_late_notification_reaches_the_next_trace() -> (
    None
):
    d, inbox, _ = _pair(delay=3)
    d.send_notif("P", b"req-1:1")
    inbox.reset()  # what the reset did before: clear and go on
    got = [inbox.take_arrived(b"req-1:1") for _ in range(4)]
    assert ("D", b"req-1:1") in got  # the next trace's inbox holds the old message


def test_a_notification_that_never_lands_is_a_timeout_by_the_injected_clock() -> None:
    d, inbox, ledger = _pair(delay=10**9)
    d.send_notif("P", b"req-1:1")
    ticks = itertools.count()
    waits = Waits(limit_s=1.0, clock=lambda: float(next(ticks)), sleep=lambda _: None)
    with pytest.raises(WaitTimeout, match="1 notifications sent to the producer to land"):
        ledger.wait_landed([inbox], waits)
