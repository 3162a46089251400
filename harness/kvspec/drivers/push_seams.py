"""The seam the clock driver (drivers/clock_driver.py) puts on a producer rank's push
writer, so that a WRITE parked on P's handshake with D is re-driven when the spec says
(KVClock `push_deferred`), not as soon as the handshake's callback queued it: P's step
(its reaper, the scheduler's free) may come in between, as it may in vLLM.
"""

from __future__ import annotations

import queue
from typing import Any

from kvspec.drivers.vllm_inbox import Waits

# (request id, P's block ids, D's registration): what `_on_handshake` puts
# (push_worker.py:477)
Deferred = tuple[str, Any, Any]


class _Gated(queue.Queue[Deferred]):
    """A Queue whose `get_nowait` returns only entries the driver allowed. The writer's
    drain (step 2 of `_push_writer_loop`, push_worker.py:247-252) calls `get_nowait` until
    `queue.Empty`; Queue's `get` asks `_qsize` whether there is one and takes it with
    `_get`, both under the queue's mutex, so gating those two gates the drain and leaves
    `put` (the handshake's callbacks) as it is. A Queue subclass and not a filter around
    the writer loop: the loop is vLLM's, run on its own thread."""

    def __init__(self) -> None:
        super().__init__()
        self.allowed: set[str] = set()

    def _qsize(self) -> int:
        return sum(1 for item in self.queue if item[0] in self.allowed)

    def _get(self) -> Deferred:
        for i, item in enumerate(self.queue):
            rid, blocks, reg = item
            if rid in self.allowed:
                del self.queue[i]
                self.allowed.discard(rid)
                return (rid, blocks, reg)
        raise queue.Empty  # (unreachable: Queue.get asked _qsize first)

    def held(self) -> list[str]:
        with self.mutex:
            return [str(item[0]) for item in self.queue]

    def allow(self, rid: str) -> None:
        with self.mutex:
            self.allowed.add(rid)


class HeldInbox:
    """Producer rank `nw`'s `_deferred_push_inbox` (push_worker.py:127), gated until the
    driver releases each entry (`release`), then drained by vLLM's writer thread."""

    def __init__(self, nw: Any, waits: Waits) -> None:
        self.nw, self.waits = nw, waits
        self.real = nw._deferred_push_inbox
        self.gated = _Gated()
        nw._deferred_push_inbox = self.gated

    def held(self) -> list[str]:
        """The request ids the handshake's callbacks queued and the writer has not taken."""
        return self.gated.held()

    def await_queued(self, rids: list[str], what: str) -> None:
        self.waits.until(lambda: set(rids) <= set(self.held()), what)

    def release(self, rid: str) -> None:
        """The writer may take rid now: it is woken (as `_on_handshake` wakes it)."""
        self.gated.allow(rid)
        self.nw._push_writer_wake.set()

    def restore(self) -> None:
        """Give the writer its own queue back. What is still held belongs to a trace that is
        over: dropped, so no WRITE of it reaches the pooled cluster's next trace."""
        self.nw._deferred_push_inbox = self.real
