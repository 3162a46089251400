"""KVClock (spec/KVClock.tla) on the real classes: the vLLM driver's producer engine (real
Scheduler, NIXL workers, KVOutputAggregator, decode workers doing real READs) with vLLM's
`time.perf_counter` replaced, in the NIXL modules that stamp, rebase and compare deadlines
and in the driver's own view of them, by a clock the driver advances (lease_driver's).
P's prompts and prefix caching are laid out as `layout` (prefix_layout.py; `kvspec clock
--conform --layout`).

| spec | real |
|---|---|
| producer steps, `consumer_start_load_kv(r, w)` | as `VllmDriver` |
| `consumer_read_done(r, w)` | D's `get_transfer_results` reports the READ; bytes checked |
| `consumer_get_finished(r, w)` | the READ's "r:1", arrived at rank w's agent, is delivered |
| `push_write(r, w)` | D's PUSH_REG reaches rank w; its writer thread posts the real WRITE |
| `push_match(r, w)` | PHsMax > 0: the PUSH_REG reaches rank w; its writer parks r's blocks |
| | on its handshake with D, held at the seam (no WRITE) |
| `push_handshake_done(w)` | the held handshake completes; vLLM's callbacks queue the parked |
| | requests on the writer's `_deferred_push_inbox`, held at the seam (push_seams) |
| `push_deferred(r, w)` | the seam lets the writer take r: it posts r's real WRITE (or the fix |
| | drops it) |
| `push_write_done(r, w)` | the WRITE's handles are done, D's block checked: landed, reported |
| `consumer_add_request(r)` | nothing real: D tracks r from now (its on_new_request) |
| `consumer_update(r)` | nothing real: D stops tracking r (finished_recving seen) |
| `heartbeat` | every D rank's `_send_heartbeats` (the requests D tracks); the message, once |
| | it reached each producer rank's agent, is handed to that rank's next `_get_new_notifs` |
| | (P's next step runs vLLM's `_handle_heartbeat`), unless the spec lost it there; |
| | push: it waits at the agent (held by the driver) until the rank's writer thread |
| | reads it: at P's next step (after the step drained the queue) or at `writer_poll` |
| `writer_poll(w)` | push: rank w's self-polling writer forwards what waits at its agent |
| `heartbeat` (handshake not done) | vLLM's `_send_heartbeats` starts, or waits for, the |
| | proactive handshake, held at the seam; nothing is sent |
| `handshake_done` | the held handshake's exchange completes; vLLM's callbacks run |
| `abandon(r)` | nothing real: D stops tracking r |
| `consumer_finish(r)` | nothing real: D's request_finished stops tracking r; READs go on |
| `consumer_fail(r)` | nothing real: D processed r's failed receive, stops tracking r |
| `consumer_read_fails(r, w)` | the READ's "r:1" is never delivered and D counts it |
| | failed: what P sees of a failed READ (no transport error is injected into D's NIXL; |
| | the bytes D read are not checked) |
| `tick` | the clock advances kv_lease_duration / 6 |

Observed: KVCompletion's variables as `VllmDriver.observe` reads them (`expired`: deadline
passed on the controlled clock), `ttl` of every installed lease (whole ticks to its
deadline; 0 elsewhere, where the spec's TTL is not yet or no longer a worker's) and `land`
(READs D reported) and `hbq` (the requests named by heartbeats handed to a rank and not
yet read by its worker; push: by its writer thread) and `hbf` (push: forwarded to the
engine's queue, not yet drained by a step). The first heartbeat's handshake (`hs`) is
driven at the handshake seam (`heartbeat_swallowed`, `handshake_done`). Not driven: a
notification overtaking its READ (lease_driver.EarlyNotifs does it for LeaseClock).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.decode_seams import HeldHandshake
from kvspec.drivers.lease_driver import (
    CLOCKED,
    TICK_S,
    _Clock,
    controlled_clock,
    mark_consumers_active,
)
from kvspec.drivers.prefix_layout import ONE_BLOCK, Layout
from kvspec.drivers.vllm_driver import VllmDriver
from kvspec.drivers.vllm_inbox import DEFAULT_WAITS, Waits
from kvspec.drivers.vllm_view import req_id
from kvspec.matrix import ModelRow
from kvspec.tlcvalue import Value, make_fn

# The driver's view (vllm_view.observe's `expired`) reads the deadlines on this clock too.
VIEW = (*CLOCKED, "kvspec.drivers.vllm_view")


@dataclass
class ClockDriver:
    row: ModelRow
    impl_patch: str | None = None
    waits: Waits = DEFAULT_WAITS
    layout: Layout = ONE_BLOCK  # P's prompts and prefix caching (prefix_layout.py)
    clock: _Clock = field(default_factory=_Clock)
    land: set[tuple[int, int]] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    added: set[int] = field(default_factory=set)  # D's add_request ran (spec atD)
    seen: set[int] = field(default_factory=set)  # D's scheduler saw finished_recving
    finished: set[int] = field(default_factory=set)  # D finished r early (consumer_finish)
    failed: set[tuple[int, int]] = field(default_factory=set)  # READs that failed
    held: list[HeldHandshake] = field(default_factory=list)  # a pending handshake per D rank
    # push: heartbeat messages at rank w's agent that its writer thread has not read (the
    # spec's hbq), held here so that the writer forwards them only where the spec does
    at_agent: dict[int, list[tuple[str, bytes]]] = field(default_factory=dict)
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __post_init__(self) -> None:
        self._stack.enter_context(controlled_clock(self.clock, VIEW))
        try:
            self.vd = self._stack.enter_context(
                VllmDriver(
                    self.row, impl_patch=self.impl_patch, waits=self.waits, layout=self.layout
                )
            )
        except BaseException:
            self._stack.close()
            raise
        mark_consumers_active(self.vd, self.clock.now)

    def close(self) -> None:
        # never leave an executor waiting on a seam (P's lazy handshakes with D: VllmDriver
        # closes them, so no parked WRITE reaches the pooled cluster's next trace)
        for h in self.held:
            h.restore()
        self._stack.close()

    def __enter__(self) -> ClockDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ producer steps
    def schedule(self) -> None:
        self.vd.schedule()

    def execute_model(self) -> None:
        """KVClock `execute_model`: vLLM's step. Push: its get_transfer_results wakes the
        writer thread and drains the engine's queue at once (what the writer forwarded
        before: the spec's hbf); the woken writer then forwards what had reached the
        agent (hbq -> hbf), here after the step, as the spec has it."""
        self.vd.execute_model()
        if self.row.transfer == "push":
            for w in sorted(self.at_agent):
                self._forward(w)

    def update_from_output(self) -> None:
        self.vd.update_from_output()

    def abort(self, r: int) -> None:
        self.vd.abort(r)

    def store_complete(self, r: int, w: int) -> None:
        self.vd.store_complete(r, w)

    # ------------------------------------------------------------------ decode side
    def consumer_start_load_kv(self, r: int, w: int) -> None:
        """KVClock `consumer_start_load_kv(r, w)` (KVCompletion's, unguarded): D posts a
        real NIXL READ of r's block from rank w."""
        self._may_transfer(f"consumer_start_load_kv({r}, {w})", r)
        self.vd.consumer_start_load_kv(r, w)

    def _may_transfer(self, action: str, r: int) -> None:
        """KVClock's guard a READ (pull) and a WRITE (push) share on D's side: D holds r
        (tracks it; a request D finished early is still read by a rank whose step had it
        to read, and one whose registration went out is still written) and no handshake with the
        producer is pending."""
        if r not in self.added or r in self.seen or (r in self.gone and r not in self.finished):
            raise MissingAction(f"{action}: D does not hold r")
        if self.held:
            raise MissingAction(f"{action}: the handshake is pending")

    def consumer_read_done(self, r: int, w: int) -> None:
        """KVClock `consumer_read_done(r, w)`: D's get_transfer_results reports the READ
        of r from w; its bytes equal the producer's block."""
        if (r, w) not in self.vd.reads or (r, w) in self.land | self.failed:
            raise MissingAction(f"consumer_read_done({r}, {w}): no READ in progress")
        self.vd.await_read(r, w)
        self.land.add((r, w))

    def consumer_get_finished(self, r: int, w: int) -> None:
        """KVClock `consumer_get_finished(r, w)`: the READ's "r:1" reaches rank w's agent
        (after the READ landed: NIXL sends it with the transfer)."""
        rd = self.vd.reads.get((r, w))
        if rd is None or rd.state != "inflight" or (r, w) not in self.land:
            raise MissingAction(f"consumer_get_finished({r}, {w}): no landed READ to notify")
        self.vd.deliver_notif(r, w)

    def push_write(self, r: int, w: int) -> None:
        """KVClock `push_write(r, w)`: D tracks r and its handshake with P is done; D's
        PUSH_REG reaches rank w, whose writer thread posts the real WRITE (the vLLM
        driver's `push_write`; on a lease whose deadline passed too: the writer does not
        look at it, push_worker.py `_do_start_push_kv`)."""
        self._may_transfer(f"push_write({r}, {w})", r)
        if not self.vd._push_writable(r, w):  # KVClock's K!PushWritable (its phs is its own)
            raise MissingAction(f"push_write({r}, {w}): not possible now")
        self.vd.write_now(r, w)

    def push_match(self, r: int, w: int) -> None:
        """KVClock `push_match(r, w)` (PHsMax > 0): D's PUSH_REG of r reaches rank w, whose
        writer thread matches it with r's finished blocks and, its handshake with D not
        done, parks them in the handshake future's callback (push_worker.py
        `_do_start_push_kv` -> `_ensure_handshake`, 457-481): no WRITE. Rank w's first
        match starts the handshake, held at the seam decode_seams.HeldHandshake uses (D's
        engine taken out of rank w's `_remote_agents`; the exchange waits for
        `push_handshake_done`)."""
        self._may_transfer(f"push_match({r}, {w})", r)
        vd = self.vd
        if not vd._push_writable(r, w):
            raise MissingAction(f"push_match({r}, {w}): not possible now")
        nw, d_engine, lazy = vd.c.nixl_worker(w), vd._push().engine_id, vd.lazy.get(w)
        if lazy is None and d_engine not in nw._remote_agents:
            raise MissingAction(f"push_match({r}, {w}): rank {w} never handshook D")
        if lazy is not None and lazy.held.state() == "done":
            raise MissingAction(f"push_match({r}, {w}): rank {w}'s handshake with D is done")
        # The pooled cluster's real handshake may have stamped D's engine on another clock;
        # on this one it was active now (else _ensure_handshake's stale-engine eviction
        # drops it, base_worker.py:3540-3569).
        nw._engine_last_active[d_engine] = self.clock.now
        vd.park_match(r, w)  # the spec's claim is KVClock's own: vd.reads stays as it was

    def push_handshake_done(self, w: int) -> None:
        """KVClock `push_handshake_done(w)`: rank w's held handshake with D completes; each
        `_on_handshake` queues its request on `_deferred_push_inbox` (push_worker.py:
        465-478), where the seam holds it from the writer: no WRITE yet."""
        lazy = self.vd.lazy.get(w)
        if lazy is None or lazy.held.state() != "pending":
            raise MissingAction(f"push_handshake_done({w}): no handshake with D pending")
        lazy.complete()

    def push_deferred(self, r: int, w: int) -> None:
        """KVClock `push_deferred(r, w)`: rank w's writer takes r from its inbox and
        re-drives it (push_worker.py:247-252 -> `_do_start_push_kv`): vLLM posts the real
        WRITE, lease reaped or not; the proposed fix (patches.push-lease-check) drops it."""
        lazy = self.vd.lazy.get(w)
        if lazy is None or req_id(r) not in lazy.deferred:
            raise MissingAction(f"push_deferred({r}, {w}): r is not on rank {w}'s inbox")
        if lazy.drain(req_id(r)):
            self.vd.record_write(r, w)  # else dropped: the spec's rd says which it wanted

    def push_write_done(self, r: int, w: int) -> None:
        """KVClock `push_write_done(r, w)`: every WRITE handle of r on rank w is done and
        D's block holds the producer's bytes (the vLLM driver's `push_write_done`): the
        data landed, and rank w reports r at its next get_transfer_results."""
        self.vd.push_write_done(r, w)
        self.land.add((r, w))

    def consumer_read_fails(self, r: int, w: int) -> None:
        """KVClock `consumer_read_fails(r, w)`: the READ of r from w fails while P lives.
        What P sees of it is that its "r:1" never comes: the driver holds it for good."""
        rd = self.vd.reads.get((r, w))
        if rd is None or rd.state != "inflight" or (r, w) in self.land | self.failed:
            raise MissingAction(f"consumer_read_fails({r}, {w}): no READ in progress")
        self.failed.add((r, w))

    def consumer_fail(self, r: int) -> None:
        """KVClock `consumer_fail(r)`: D's scheduler processes r's failed receive
        (update_connector_output) and stops heartbeating it; D is done with r."""
        posted = [w for rr, w in self.vd.reads if rr == r]
        ended = all((r, w) in self.land | self.failed for w in posted)
        failed = any((r, w) in self.failed for w in posted) or r in self.gone
        if r not in self.added or r in self.seen or not posted or not ended or not failed:
            raise MissingAction(f"consumer_fail({r}): no failed receive of r to report")
        self.seen.add(r)
        self.gone.add(r)

    def consumer_finish(self, r: int) -> None:
        """KVClock `consumer_finish(r)`: D's scheduler finishes r before its receive is
        processed (request_finished -> _stop_heartbeat); its READs go on."""
        if r not in self.added or r in self.gone | self.seen:
            raise MissingAction(f"consumer_finish({r}): D does not track r")
        self.gone.add(r)
        self.finished.add(r)

    def abandon(self, r: int) -> None:
        """KVClock `abandon(r)`: D gives r up (nothing happens on the real side)."""
        if any(rr == r for rr, _ in self.vd.reads) or r in self.gone:
            raise MissingAction(f"abandon({r}): D already read it or gave it up")
        self.gone.add(r)

    def consumer_add_request(self, r: int) -> None:
        """KVClock `consumer_add_request(r)`: the router hands r to D (D's add_request ->
        on_new_request); D's heartbeats name it from now. Nothing real: this driver's
        decode workers take their metadata from the driver."""
        if r not in self.vd.params or r in self.added:
            raise MissingAction(f"consumer_add_request({r}): P has not returned r, or D has it")
        self.added.add(r)

    def consumer_update(self, r: int) -> None:
        """KVClock `consumer_update(r)`: D's scheduler processes r's finished_recving
        (update_connector_output) and stops heartbeating it."""
        if (
            r not in self.added
            or r in self.seen
            or any((r, w) not in self.land for w in self.sources())
        ):
            raise MissingAction(f"consumer_update({r}): not every READ of r has landed")
        self.seen.add(r)

    def sources(self) -> frozenset[int]:
        """The producer ranks D reads and heartbeats (KVCompletion's ReadSources)."""
        return frozenset(self.vd._read_sources())

    def tracked(self) -> set[int]:
        """Requests D heartbeats: added, not given up, finished_recving not yet seen."""
        return self.added - self.gone - self.seen

    def heartbeat(self, lost: frozenset[int]) -> None:
        """KVClock `heartbeat`: every D rank's _send_heartbeats for the requests D tracks.
        Each message waits at its producer rank's agent for that rank's next step (its
        _get_new_notifs hands it to vLLM's _handle_heartbeat), except at the ranks in
        `lost` (the send failed: the message is dropped there)."""
        tracked = self.tracked()
        if not tracked:
            raise MissingAction("heartbeat: D tracks no request")
        api, c = self.vd.c.api, self.vd.c
        ids = {req_id(r) for r in tracked}
        for cons in c.consumers:
            meta = api.NixlConnectorMetadata()
            meta.heartbeat_by_engine = {
                c.engine_id: api.HeartbeatInfo(
                    req_ids=ids, host="127.0.0.1", port=0, tp_size=self.row.topology.tp
                )
            }
            cons.connector_worker._send_heartbeats(meta)
        for w in sorted(self.sources()):
            item = c.inboxes[w].wait_arrived_where(
                lambda m: m.startswith(b"HB:"), f"a heartbeat at rank {w}", self.waits
            )
            if w not in lost and self.row.transfer == "push":
                self.at_agent.setdefault(w, []).append(item)  # the writer reads it later
            elif w not in lost:
                c.inboxes[w].deliver(item)

    def writer_poll(self, w: int) -> None:
        """KVClock `writer_poll(w)`: rank w's writer thread, self-polling while it holds
        finished blocks no registration matched (push_worker.py `_push_writer_loop`),
        reads the heartbeats at its agent and forwards them to the engine's queue."""
        if self.row.transfer != "push" or not self.at_agent.get(w):
            raise MissingAction(f"writer_poll({w}): no heartbeat waits at rank {w}'s agent")
        self._forward(w)

    def _forward(self, w: int) -> None:
        """Rank w's writer thread reads what waits at its agent and forwards it."""
        inbox = self.vd.c.inboxes[w]
        for item in self.at_agent.pop(w, []):
            inbox.deliver(item)
            self._hand_to_engine(w, item[1])

    def _hand_to_engine(self, w: int, msg: bytes) -> None:
        """Push: rank w's writer thread, woken here, reads the heartbeat at its agent
        (push_worker.py `_push_writer_loop`) and forwards it to the engine's queue
        (`_pending_completion_notifs`), which the rank's next get_transfer_results drains
        (`_get_new_notifs` -> `_handle_heartbeat`, 763-764). Waited for, so that the queue
        holds what the spec's hbf says before the driver's next step."""
        nw = self.vd.c.nixl_worker(w)
        inbox = self.vd.c.inboxes[w]
        nw._push_writer_wake.set()

        def forwarded() -> bool:
            with inbox.lock:
                drained = all(m != msg for _, m in inbox.delivered)
            return drained and msg in list(nw._pending_completion_notifs.queue)

        self.waits.until(forwarded, f"rank {w}'s writer thread to forward a heartbeat")

    def heartbeat_swallowed(self) -> None:
        """KVClock `heartbeat` while D's handshake with the producer engine is not done
        (`hs`): the heartbeat starts the proactive handshake, or finds it pending, and is
        not sent. Driven at the seam decode_seams.HeldHandshake uses: at the first one the
        engine is taken out of each D worker's `_remote_agents` (D's cluster handshook when
        it was built) and the network exchange is held (it returns the agents already
        registered when `handshake_done` releases it); vLLM's own `_send_heartbeats` ->
        `_ensure_handshake` runs. vLLM must send nothing: D's `send_notif` is watched."""
        tracked = self.tracked()
        if not tracked:
            raise MissingAction("heartbeat: D tracks no request")
        api, c = self.vd.c.api, self.vd.c
        first = not self.held
        sent: list[bytes] = []
        for i, cons in enumerate(c.consumers):
            cw = cons.connector_worker
            if first:
                self.held.append(HeldHandshake(cw, c.engine_id, self.waits))
            real_send = cw.nixl_wrapper.send_notif
            own = "send_notif" in vars(cw.nixl_wrapper)  # already an instance attribute

            def spy(agent: Any, notif_msg: bytes = b"", _real: Any = real_send) -> Any:
                sent.append(bytes(notif_msg))
                return _real(agent, notif_msg=notif_msg)

            cw.nixl_wrapper.send_notif = spy
            try:
                meta = api.NixlConnectorMetadata()
                meta.heartbeat_by_engine = {
                    c.engine_id: api.HeartbeatInfo(
                        req_ids={req_id(r) for r in tracked}, host="127.0.0.1", port=0,
                        tp_size=self.row.topology.tp,
                    )
                }  # fmt: skip
                cw._send_heartbeats(meta)
            finally:
                if own:
                    cw.nixl_wrapper.send_notif = real_send
                else:
                    del cw.nixl_wrapper.send_notif
            if self.held[i].state() != "pending" or any(m.startswith(b"HB:") for m in sent):
                raise MissingAction("heartbeat: D sent a heartbeat (no handshake pending)")

    def handshake_done(self) -> None:
        """KVClock `handshake_done`: the held exchange completes and vLLM's callbacks run
        (the producer's agents registered: heartbeats are sent from now)."""
        if not self.held:
            raise MissingAction("handshake_done: no handshake pending")
        held, self.held = self.held, []
        try:
            for h in held:
                h.release()
        finally:
            for h in held:
                h.restore()

    def tick(self) -> None:
        """KVClock `tick`: kv_lease_duration / 6 passes."""
        self.clock.now += TICK_S

    # ------------------------------------------------------------------ observe
    def observe(self) -> dict[str, Value]:
        """KVCompletion's variables, `ttl` of the installed leases, `land`, `hbq`."""
        out = self.vd.observe()
        W, N = self.vd.W, self.vd.N
        ttl = []
        for w in range(W):
            sent = self.vd.c.nixl_worker(w)._reqs_to_send
            ttl.append(
                tuple(
                    max(0, math.ceil((sent[req_id(r)] - self.clock.now) / TICK_S))
                    if req_id(r) in sent
                    else 0
                    for r in range(1, N + 1)
                )
            )
        out["ttl"] = make_fn(enumerate(ttl))
        out["land"] = frozenset(self.land)
        req: Any = out["req"]
        sending = {r for r in range(1, N + 1) if req[r - 1] == "sending"}
        out["hbq"] = make_fn((w, self._waiting_heartbeats(w) & sending) for w in range(W))
        out["hbf"] = make_fn((w, self._forwarded_heartbeats(w) & sending) for w in range(W))
        return out

    def _waiting_heartbeats(self, w: int) -> frozenset[int]:
        """The requests named by heartbeats handed to rank w's agent, not yet read (the
        spec keeps those P still holds: a heartbeat for a freed request changes nothing);
        push: those its writer thread has not read."""
        if self.row.transfer == "push":
            return self._names(m for _, m in self.at_agent.get(w, []))
        return self._names(m for _, m in self.vd.c.inboxes[w].delivered)

    def _forwarded_heartbeats(self, w: int) -> frozenset[int]:
        """Push: the requests named by heartbeats rank w's writer thread forwarded to the
        engine's queue and its step has not drained (the spec's hbf); pull: none."""
        if self.row.transfer != "push":
            return frozenset()
        return self._names(self.vd.c.nixl_worker(w)._pending_completion_notifs.queue)

    def _names(self, msgs: Any) -> frozenset[int]:
        hbs = [m for m in msgs if m.startswith(b"HB:")]
        return self.vd._reqs(x for m in hbs for x in m.decode()[3:].split(",") if x)
