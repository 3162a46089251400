"""The seams the clock driver (drivers/clock_driver.py) puts on a producer rank's push
writer (`LazyHandshake`: its handshake with D and its inbox), so that a WRITE parked on
P's handshake with D is re-driven when the spec says (KVClock `push_deferred`), not as
soon as the handshake's callback queued it: P's step (its reaper, the scheduler's free)
may come in between, as it may in vLLM.
"""

from __future__ import annotations

import queue
from typing import Any

from kvspec.drivers.decode_seams import HeldHandshake
from kvspec.drivers.push_side import write_handles
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


class LazyHandshake:
    """Producer rank `nw`'s lazy handshake with D (KVClock's phs, claim and defer for that
    rank): the exchange held at decode_seams.HeldHandshake's seam, the requests the
    writer parked on it, and, once it is done, the inbox its callbacks filled, held.
    The clock driver's push_match, push_handshake_done and push_deferred drive it."""

    def __init__(self, nw: Any, engine_id: str, waits: Waits) -> None:
        self.nw, self.engine_id, self.waits = nw, engine_id, waits
        self.held = HeldHandshake(nw, engine_id, waits)
        self.inbox = HeldInbox(nw, waits)
        self.parked: list[str] = []  # matched, waiting for the handshake (claim)
        self.deferred: list[str] = []  # on the inbox, not yet drained (defer)

    def park(self, rid: str) -> None:
        """The writer matched rid's registration (the caller delivered it) and attaches
        its `_on_handshake` to the pending future (push_worker.py:457-481): wait for that
        callback, for rid gone from the writer's maps, and no WRITE."""
        want = len(self.parked) + 2  # vLLM's done_callback, then one _on_handshake a match
        nw, eid = self.nw, self.engine_id

        def parked() -> bool:
            fut = nw._handshake_futures.get(eid)
            # Future keeps its callbacks in _done_callbacks until it completes: the only
            # place to see that _do_start_push_kv attached this match's _on_handshake.
            return (
                fut is not None
                and not fut.done()
                and len(fut._done_callbacks) >= want
                and rid not in nw._pending_d_registrations
                and rid not in nw._push_finished_blocks
            )

        self.waits.until(parked, f"the writer to park {rid} on its handshake with D")
        self.parked.append(rid)

    def complete(self) -> None:
        """The held exchange completes; each `_on_handshake` queues its request on the
        held inbox (push_worker.py:465-478): wait until all are queued."""
        self.held.release()
        parked, self.parked = self.parked, []
        self.inbox.await_queued(parked, f"the handshake callbacks to queue {parked}")
        self.deferred += parked

    def drain(self, rid: str) -> bool:
        """The writer takes rid from the inbox and re-drives it (push_worker.py:247-252):
        True once it posted the WRITE, False once the proposed fix
        (patches.push-lease-check) dropped it."""
        nw = self.nw
        vars(nw).get("kvspec_dropped", set()).discard(rid)  # the fix's record, earlier trace
        self.deferred.remove(rid)
        self.inbox.release(rid)

        def settled() -> bool:
            return bool(write_handles(nw, rid)) or rid in vars(nw).get("kvspec_dropped", ())

        self.waits.until(settled, f"the writer to re-drive {rid} after its handshake")
        return bool(write_handles(nw, rid))

    def close(self) -> None:
        """A pending exchange fails (no parked WRITE reaches the pooled cluster's next
        trace) and the writer gets its own inbox back."""
        self.held.abandon()
        self.inbox.restore()
