"""How the vLLM driver reads the real objects as the spec's variables (`VllmView.observe`).

Which variables are observed in vLLM and which the driver keeps (and why):
  req, needSend, notProc, toProcess, lease, expired, replQ, extra, agg, published: read from
    the real objects every time (scheduler.requests and statuses, the NIXL scheduler's
    _reqs_need_send/_reqs_not_processed, workers' _reqs_to_process/_reqs_to_send (+ deadlines
    vs perf_counter), _replicated_pcp_done_sending, MultiConnector._extra_async_saves, the
    aggregator's _send_remaining_count, get_handshake_metadata()).
  steps: the driver's queue of real SchedulerOutputs (batch = scheduled_new_reqs, toSend /
    notProc from the real NIXL metadata) and the real per-rank finished_sending outputs.
  notif: notifications that reached a rank's NIXL agent and vLLM has not read yet (the
    driver's NotifInbox sits on the agent's get_new_notifs; it is the only place they exist).
  store, stored: the delaying offload child's StoreEngine job tables. For the upstream
    OffloadingConnector they are empty, as in the spec: it never delays the free (the driver
    records each of its request_finished answers in `offload_delays`), reports no
    finished_sending, and its get_finished_count() is None, so the aggregator expects W.
    Its real store jobs run on every rank and are held (offload_upstream.HeldStoreWorker)
    until vLLM's own flush fence completes them.
  rd: "inflight" = the consumer worker of w's tp rank holds the READ handle
    (its _recving_transfers);
    "done" = the consumer reported it finished_recving (kept by the driver: vLLM forgets it).
  hb, emits, lateFinish: history variables of the spec; vLLM keeps no record of them, so the
    driver records what it did (heartbeats sent), what the aggregator emitted, and whether
    the scheduler's `assert req_id in self.requests` fired.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.vllm_cluster import Cluster
from kvspec.matrix import ModelRow
from kvspec.model import VARIABLES
from kvspec.tlcvalue import Record, Value, make_fn


def req_id(r: int) -> str:
    return f"req-{r}"


def spec_r(rid: str) -> int:
    return int(rid.split("-", 1)[1])


@dataclass
class Step:
    so: Any  # the real SchedulerOutput
    batch: frozenset[int]
    to_send: frozenset[int]
    not_proc: frozenset[int]
    ran: bool = False
    outputs: list[Any] = field(default_factory=list)  # per-rank ModelRunnerOutput
    out: tuple[frozenset[int], ...] = ()


@dataclass
class Read:
    state: str  # "inflight" | "done"
    local_block: int
    remote_block: int


class VllmView:
    """The read side of VllmDriver: what it observes, and the predicates its guards share."""

    row: ModelRow
    W: int
    N: int
    sched: Any  # vLLM's Scheduler (or AsyncScheduler)
    agg: Any  # vLLM's KVOutputAggregator
    steps: deque[Step]
    reads: dict[tuple[int, int], Read]
    hb: set[int]
    emits: list[int]
    late_finish: bool
    _cluster: Cluster | None

    @property
    def c(self) -> Cluster:
        if self._cluster is None:
            raise RuntimeError("driver is closed")
        return self._cluster

    def _nixl_sched(self) -> Any:
        conn = self.sched.connector
        if self.row.composition != "nixl":
            conn = conn._connectors[0]
        return conn.connector_scheduler

    def _reqs(self, ids: Any) -> frozenset[int]:
        return frozenset(spec_r(x) for x in ids)

    def _read_sources(self) -> set[int]:
        """Ranks whose handshake the consumer holds: (pp, tp) -> the publishing rank."""
        held = {
            pp_tp
            for cons in self.c.consumers
            for pp_tp in cons.connector_worker._remote_agents.get(self.c.engine_id, {})
        }
        coords = [self.row.topology.rank_coords(w) for w in range(self.W)]
        return {w for w, c in enumerate(coords) if (c.pp, c.tp) in held and self._published(w)}

    def _has_requests(self) -> bool:
        # Scheduler.has_requests() is also true for one more step after the last request
        # left (finished_req_ids still to be flushed to the workers): an empty step the
        # spec does not model. The engine keeps stepping for held requests either way.
        return len(self.sched.requests) > 0

    def _published(self, w: int) -> bool:
        return self.c.workers[w].get_handshake_metadata() is not None

    def _status(self, r: int) -> str:
        rq = self.sched.requests.get(req_id(r))
        if rq is None:
            return "freed"
        if rq.is_finished():
            return "sending"
        if rq.status == self.c.api.RequestStatus.RUNNING:
            return "running"
        return "waiting"

    def _expired(self, w: int, r: int) -> bool:
        dl = self.c.nixl_worker(w)._reqs_to_send.get(req_id(r))
        return dl is not None and time.perf_counter() >= dl

    def _ranks(self, per_rank: list[frozenset[int]]) -> Value:
        return make_fn((w, per_rank[w]) for w in range(self.W))

    def observe(self) -> dict[str, Value]:
        c = self.c
        ns = self._nixl_sched()
        empty: frozenset[int] = frozenset()
        steps = tuple(
            Record.of(
                {
                    "batch": s.batch,
                    "toSend": s.to_send,
                    "notProc": s.not_proc,
                    "ran": s.ran,
                    "out": self._ranks(list(s.out) if s.ran else [empty] * self.W),
                }
            )
            for s in self.steps
        )
        tp, ls, ex, nf, rq, xt, so, sd = ([] for _ in range(8))
        for w in range(self.W):
            nw = c.nixl_worker(w)
            tp.append(self._reqs(nw._reqs_to_process))
            ls.append(self._reqs(nw._reqs_to_send))
            now = time.perf_counter()
            ex.append(self._reqs(k for k, dl in nw._reqs_to_send.items() if now >= dl))
            nf.append(
                self._reqs(
                    m.decode().rsplit(":", 1)[0]
                    for _, m in c.inboxes[w].delivered
                    if not m.startswith(b"HB:")
                )
            )
            rq.append(self._reqs(nw._replicated_pcp_done_sending))
            xt.append(
                self._reqs(c.workers[w]._extra_async_saves)
                if self.row.composition != "nixl"
                else empty
            )
            if c.store_engine is not None:
                so.append(self._reqs(c.store_engine.ranks[w].store))
                sd.append(self._reqs(c.store_engine.ranks[w].stored))
            else:
                so.append(empty)
                sd.append(empty)
        rng = range(1, self.N + 1)
        rd = tuple(
            make_fn(
                (w, self.reads[(r, w)].state if (r, w) in self.reads else "none")
                for w in range(self.W)
            )
            for r in rng
        )
        values: dict[str, Value] = {
            "req": tuple(self._status(r) for r in rng),
            "needSend": self._reqs(ns._reqs_need_send),
            "notProc": self._reqs(ns._reqs_not_processed),
            "steps": steps,
            "toProcess": self._ranks(tp),
            "lease": self._ranks(ls),
            "expired": self._ranks(ex),
            "notif": self._ranks(nf),
            "replQ": self._ranks(rq),
            "extra": self._ranks(xt),
            "store": self._ranks(so),
            "stored": self._ranks(sd),
            "rd": rd,
            "hb": frozenset(self.hb),
            "agg": tuple(self.agg._send_remaining_count.get(req_id(r), 0) for r in rng),
            "emits": tuple(self.emits[r] for r in rng),
            "lateFinish": self.late_finish,
            "published": frozenset(w for w in range(self.W) if self._published(w)),
        }
        return {k: values[k] for k in VARIABLES}
