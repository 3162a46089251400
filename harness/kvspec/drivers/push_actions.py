"""The vLLM driver's push-mode actions (spec `push_write`, `push_match`, `push_deferred`,
`push_write_done`) on the real
NixlPushConnector; the cluster's push half is push_side.py."""

from __future__ import annotations

from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.prefix_layout import Layout
from kvspec.drivers.push_seams import LazyHandshake
from kvspec.drivers.push_side import PushSide, write_handles
from kvspec.drivers.vllm_caches import differing_layer, zero_blocks
from kvspec.drivers.vllm_inbox import Waits
from kvspec.drivers.vllm_view import Read, VllmView, req_id

# nixl/metadata.py:26: the prefix of D's registration notification.
PUSH_REG = b"PUSH_REG:"


class TransferCorrupted(AssertionError):
    """A completed transfer delivered different bytes than the producer's block."""


class PushActions(VllmView):
    waits: Waits
    layout: Layout  # D's blocks per request (prefix_layout.py)
    lazy: dict[int, LazyHandshake]  # rank w -> its lazy handshake with D, this trace

    def _push(self) -> PushSide:
        side = self.c.push
        assert side is not None, "push action on a pull-mode cluster"
        return side

    def _push_writable(self, r: int, w: int) -> bool:
        # KVCompletion.tla PushWritable: r is sending, w is a read source, no WRITE of r on
        # w yet, and r's lease is installed on w and live.
        return self._may_start_transfer(r, w, "push", set(self.c.nixl_worker(w)._reqs_to_send))

    def _phs_done(self, w: int) -> bool:
        # KVCompletion.tla PHsDone(w): rank w posted a WRITE in this trace, so its lazy
        # handshake with D is done (the pooled cluster's up-front one is taken back at the
        # trace's first push_match: LazyHandshake).
        return any(ww == w and rd.state != "parked" for (_, ww), rd in self.reads.items())

    def _can_push_write(self, r: int, w: int) -> bool:
        return self._push_writable(r, w) and self._phs_done(w)

    def _can_push_match(self, r: int, w: int) -> bool:
        return self._push_writable(r, w) and not self._phs_done(w)

    def _can_push_deferred(self, r: int, w: int) -> bool:
        # KVCompletion.tla push_deferred: r parked on w; guarded, its lease there is live.
        # Runs for every (r, w) at every step (enabled()): the vLLM lookups only for a parked r.
        rd = self.reads.get((r, w))
        if rd is None or rd.state != "parked" or self.row.timing != "guarded":
            return rd is not None and rd.state == "parked"
        return req_id(r) in self.c.nixl_worker(w)._reqs_to_send and not self._expired(w, r)

    def _can_push_write_done(self, r: int, w: int) -> bool:
        return self.row.transfer == "push" and self._in_flight(r, w)

    def push_write(self, r: int, w: int) -> None:
        """Spec `push_write(r, w)` (KVCompletion.tla): rank w's handshake with D is done;
        the WRITE is posted at the match (`write_now`)."""
        if not self._can_push_write(r, w):
            raise MissingAction(f"push_write({r}, {w}): not possible now")
        self.write_now(r, w)

    def write_now(self, r: int, w: int) -> None:
        """The decode worker of w's tp rank sends its PUSH_REG (NixlPushConnectorWorker.
        start_load_kv -> writer thread `_send_registration_to_p`), it is delivered to rank
        w's agent, and rank w's writer thread matches it with r's finished blocks and posts
        the WRITE (`_handle_push_reg_notif` -> `_do_start_push_kv` -> `_xfer_blocks`)."""
        rid = req_id(r)
        nw = self.deliver_registration(r, w)
        self.waits.until(lambda: bool(write_handles(nw, rid)), f"rank {w}'s WRITE of {rid}")
        self.record_write(r, w)

    def push_match(self, r: int, w: int) -> None:
        """Spec `push_match(r, w)`: D's PUSH_REG of r reaches rank w, whose writer matches
        it while its handshake with D is pending and parks r's blocks in the handshake
        future's `_on_handshake` (push_worker.py `_do_start_push_kv` -> `_ensure_handshake`,
        457-481): no WRITE. The trace's first match on w takes the pooled cluster's
        handshake back and holds the new exchange (push_seams.LazyHandshake)."""
        if not self._can_push_match(r, w):
            raise MissingAction(f"push_match({r}, {w}): not possible now")
        self.park_match(r, w)
        self.record_write(r, w, "parked")

    def park_match(self, r: int, w: int) -> None:
        """What every push_match drives (this driver's and the clock driver's): the trace's
        first match on w takes the pooled handshake back and holds the new exchange
        (LazyHandshake), D's registration of r reaches rank w and its writer parks r."""
        if w not in self.lazy:
            self.lazy[w] = LazyHandshake(self.c.nixl_worker(w), self._push().engine_id,
                                         self.waits)  # fmt: skip
        self.deliver_registration(r, w)
        self.lazy[w].park(req_id(r))

    def push_deferred(self, r: int, w: int) -> None:
        """Spec `push_deferred(r, w)`: rank w's handshake with D completes (vLLM's
        `_on_handshake` callbacks queue every parked request on `_deferred_push_inbox`),
        and the writer drains r and posts its real WRITE (247-252), whether or not the
        scheduler freed r's blocks meanwhile."""
        if not self._can_push_deferred(r, w):
            raise MissingAction(f"push_deferred({r}, {w}): r is not parked on rank {w}")
        lazy = self.lazy[w]
        if lazy.held.state() == "pending":
            lazy.complete()
        if not lazy.drain(req_id(r)):
            raise MissingAction(f"push_deferred({r}, {w}): the writer dropped the WRITE")
        self.record_write(r, w)

    def record_write(self, r: int, w: int, state: str = "inflight") -> None:
        """The WRITE of r from rank w is posted (the spec's rd[r][w] = "inflight"), or
        parked on rank w's handshake with D ("parked")."""
        remote = self.layout.moved_of(self.params[r])
        self.reads[(r, w)] = Read(state, self.layout.local_blocks(r), remote)

    def deliver_registration(self, r: int, w: int) -> Any:
        """D's worker for rank w sends r's PUSH_REG (start_load_kv -> the writer thread's
        `_send_registration_to_p`); it is delivered to rank w's agent and rank w's writer
        thread is woken to handle it. Returns rank w's NIXL worker."""
        api = self.c.api
        rid = req_id(r)
        params = self.params[r]
        local = self.layout.local_blocks(r)
        t = self.c.consumer_of(w)
        zero_blocks(self.c.consumers_caches[t], local)
        reg = self._push().registration(
            rid,
            local,
            str(params["remote_engine_id"]),
            int(params["remote_port"]),
            self.row.topology.tp,
        )
        meta = api.NixlConnectorMetadata()
        meta.push_registrations = {rid: reg}
        cons = self.c.consumers[t]
        cons.bind_connector_metadata(meta)
        try:
            cons.start_load_kv(None)
        finally:
            cons.clear_connector_metadata()
        inbox = self.c.inboxes[w]
        item = inbox.wait_arrived_where(
            lambda m: m.startswith(PUSH_REG) and rid.encode() in m,
            f"the PUSH_REG of {rid} at rank {w}",
            self.waits,
        )
        inbox.deliver(item)
        nw = self.c.nixl_worker(w)
        nw._push_writer_wake.set()
        return nw

    def push_write_done(self, r: int, w: int) -> None:
        """Spec `push_write_done(r, w)`: every WRITE handle of r on rank w is DONE; the
        engine sees it at w's next get_transfer_results (`_pop_done_transfers`). The
        bytes are checked in D's block first."""
        if not self._can_push_write_done(r, w):
            raise MissingAction(f"push_write_done({r}, {w}): no WRITE in flight")
        rid = req_id(r)
        rd = self.reads[(r, w)]
        held = self._push().held[w]
        handles = write_handles(self.c.nixl_worker(w), rid)

        def done() -> bool:
            states = [held.real_state(h) for h in handles]
            if any(s not in ("DONE", "PROC") for s in states):
                raise MissingAction(f"push_write_done({r}, {w}): the WRITE failed: {states}")
            return all(s == "DONE" for s in states)

        self.waits.until(done, f"rank {w}'s WRITE of {rid} to complete")
        torch = self.c.api.torch
        t = self.c.consumer_of(w)
        bad = differing_layer(
            torch, self.c.consumers_caches[t], rd.local, self.c.caches[w], rd.remote
        )
        if bad is not None:
            raise TransferCorrupted(f"req {r}: layer {bad} differs after the WRITE")
        held.release(handles)
        rd.state = "done"

    def _push_done_unread(self, w: int) -> frozenset[int]:
        """Spec `notif[w]` in push mode: r's WRITEs on w are done (released) and vLLM has
        not popped them yet (still in `_sending_transfers`)."""
        if self.row.transfer != "push":
            return frozenset()
        nw = self.c.nixl_worker(w)
        with nw._sending_transfers_lock:
            posted = set(nw._sending_transfers)
        return frozenset(
            r
            for (r, ww), rd in self.reads.items()
            if ww == w and rd.state == "done" and req_id(r) in posted
        )
