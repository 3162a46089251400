"""How the vLLM driver reads the real objects as the spec's variables (`VllmView.observe`).

Which variables are observed in vLLM and which the driver keeps (and why):
  req, needSend, notProc, toProcess, lease, expired, replQ, extra, agg, published: read from
    the real objects every time (scheduler.requests, statuses and KV blocks, the NIXL
    scheduler's _reqs_need_send/_reqs_not_processed, workers' _reqs_to_process/_reqs_to_send
    (+ deadlines vs perf_counter), _replicated_pcp_done_sending,
    MultiConnector._extra_async_saves, the aggregator's _send_remaining_count,
    get_handshake_metadata()). An aborted request whose free HF3FS delays is still in
    scheduler.requests (FINISHED_ABORTED): "aborted-held" while the KV cache manager holds
    blocks for it, "aborted-empty" when it never got any (aborted while waiting).
  finReqs: the scheduler's own finished_req_ids (scheduler.py:2736 adds to it in
    _free_request; schedule ships it and starts a new set, 1514 and 1647), so between two
    schedules it is exactly the spec's accumulation. The spec tracks it for the HF3FS
    composition only ({} otherwise), and so does the view.
  steps: the driver's queue of real SchedulerOutputs (batch = scheduled_new_reqs, toSend /
    notProc from the real NIXL metadata, fin = its finished_req_ids, HF3FS only as above)
    and the real per-rank finished_sending outputs.
  notif: notifications that reached a rank's NIXL agent and vLLM has not read yet (the
    driver's NotifInbox sits on the agent's get_new_notifs; it is the only place they exist).
  store, stored, pend: each rank's real HF3FS AsyncOperationManager (hf3fs_child.py): store =
    requests in _save_futures with a Future not done, stored = those whose Futures are all
    done (not reported yet: _check_completed_saves pops them when it reports),
    pend = _pending_finished_requests. For the other compositions they are empty, as in the
    spec. The upstream OffloadingConnector never delays the free (the driver records each of
    its request_finished answers in `offload_delays`), reports no finished_sending, and its
    get_finished_count() is None, so the aggregator expects W. Its store jobs are read by
    offload_view: unsub/store/stored per rank (deferred, submitted to the held worker,
    complete but not yet acked), jobs (pending_count per request), fence
    (_block_id_to_pending_jobs), the steps' jobs/flush (metadata) and ack (completed_jobs).
    `reused` and `clobbered` are the driver's: a freed request with a live job whose block
    the batch is allocated, and a store still in flight on a block the step writes.
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

from kvspec.defs import OFFLOAD
from kvspec.drivers import offload_view as ov
from kvspec.drivers.vllm_cluster import Cluster
from kvspec.matrix import ModelRow
from kvspec.model import HF3FS, VARIABLES
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
    fin: frozenset[int]  # the SchedulerOutput's finished_req_ids (HF3FS composition only)
    # The offloading child's metadata (offload_view): store_jobs, jobs_to_flush as requests;
    # reused = freed requests with a live job whose block the batch is allocated.
    jobs: frozenset[int] = frozenset()
    flush: frozenset[int] = frozenset()
    reused: frozenset[int] = frozenset()
    new_blocks: frozenset[int] = frozenset()  # block ids allocated to the batch
    ran: bool = False
    outputs: list[Any] = field(default_factory=list)  # per-rank ModelRunnerOutput
    out: tuple[frozenset[int], ...] = ()
    ack: tuple[frozenset[int], ...] = ()  # per rank: completed_jobs as requests


@dataclass
class Read:
    state: str  # "parked" (push: waiting on P's handshake with D) | "inflight" | "done"
    local: tuple[int, ...]  # D's blocks
    remote: tuple[int, ...]  # P's blocks, in the same order


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
    params: dict[int, dict[str, Any]]  # kv_transfer_params from request_finished
    emits: list[int]
    late_finish: bool
    jobmap: ov.JobMap  # offloading store job id -> request (offload composition)
    clobbered: bool  # a step's forward overwrote a block an in-flight store reads
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
        # spec does not model. The engine keeps stepping for held requests either way, and
        # while the connector has_pending_push_work (scheduler.py:2833): the offloading
        # child's store jobs not yet acked by every rank (offloading/scheduler.py:1902-1908).
        if len(self.sched.requests) > 0:
            return True
        return self._offload() and bool(ov.scheduler_child(self.sched)._jobs)

    def _may_start_transfer(self, r: int, w: int, transfer: str, tracked: set[str]) -> bool:
        """The guard a READ (pull) and a WRITE (push) share: the row's transfer mode, r
        sending with its kv_transfer_params, w a read source with no transfer of r yet, r
        in w's `tracked` set (pull: _reqs_to_process; push: the lease, _reqs_to_send) and,
        where the row keeps the timing guards (Timing = "guarded"), its lease not expired
        (KVCompletion.tla LiveFor)."""
        return (
            self.row.transfer == transfer
            and self._status(r) == "sending"
            and r in self.params
            and w in self._read_sources()
            and (r, w) not in self.reads
            and req_id(r) in tracked
            and (self.row.timing != "guarded" or not self._expired(w, r))
        )

    def _in_flight(self, r: int, w: int) -> bool:
        rd = self.reads.get((r, w))
        return rd is not None and rd.state == "inflight"

    def _push_done_unread(self, w: int) -> frozenset[int]:
        return frozenset()  # push mode: push_actions.PushActions

    def _published(self, w: int) -> bool:
        return self.c.workers[w].get_handshake_metadata() is not None

    def _hf3fs(self) -> bool:
        return self.row.composition == HF3FS

    def _offload(self) -> bool:
        return self.row.composition == OFFLOAD

    def _offload_child(self, w: int) -> Any:
        return self.c.workers[w]._connectors[1]

    def _status(self, r: int) -> str:
        rid = req_id(r)
        rq = self.sched.requests.get(rid)
        if rq is None:
            return "freed"
        if rq.status == self.c.api.RequestStatus.FINISHED_ABORTED:
            # Kept because a connector delayed the free (HF3FS: request_finished is True).
            held = any(self.sched.kv_cache_manager.get_block_ids(rid))
            return "aborted-held" if held else "aborted-empty"
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

    def _hf3fs_sets(self, w: int) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
        """Rank w's (store, stored, pend) from its real AsyncOperationManager."""
        m = self.c.hf3fs(w)
        done = {rid for rid in m._save_futures if m._all_saves_done(rid)}
        return (
            self._reqs(set(m._save_futures) - done),
            self._reqs(done),
            self._reqs(m._pending_finished_requests),
        )

    def _finished_req_ids(self) -> frozenset[int]:
        return self._reqs(self.sched.finished_req_ids) if self._hf3fs() else frozenset()

    def _step_values(self) -> tuple[Value, ...]:
        empty: frozenset[int] = frozenset()
        return tuple(
            Record.of(
                {
                    "batch": s.batch,
                    "toSend": s.to_send,
                    "notProc": s.not_proc,
                    "fin": s.fin,
                    "jobs": s.jobs,
                    "flush": s.flush,
                    "reused": s.reused,
                    "ran": s.ran,
                    "out": self._ranks(list(s.out) if s.ran else [empty] * self.W),
                    "ack": self._ranks(list(s.ack) if s.ran else [empty] * self.W),
                }
            )
            for s in self.steps
        )

    def observe(self) -> dict[str, Value]:
        c = self.c
        ns = self._nixl_sched()
        empty: frozenset[int] = frozenset()
        tp, ls, ex, nf, rq, xt, so, sd, pd, un = ([] for _ in range(10))
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
                    if not m.startswith((b"HB:", b"PUSH_REG:"))
                )
                | self._push_done_unread(w)
            )
            rq.append(self._reqs(getattr(nw, "_replicated_pcp_done_sending", ())))  # 0.30+
            xt.append(
                self._reqs(c.workers[w]._extra_async_saves)
                if self.row.composition != "nixl"
                else empty
            )
            st, sdone, pend = self._hf3fs_sets(w) if self._hf3fs() else (empty, empty, empty)
            unsub = empty
            if self._offload():
                unsub, st, sdone = ov.rank_sets(self._offload_child(w), self.jobmap)
            so.append(st)
            sd.append(sdone)
            pd.append(pend)
            un.append(unsub)
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
            "finReqs": self._finished_req_ids(),
            "steps": self._step_values(),
            "toProcess": self._ranks(tp),
            "lease": self._ranks(ls),
            "expired": self._ranks(ex),
            "notif": self._ranks(nf),
            "replQ": self._ranks(rq),
            "extra": self._ranks(xt),
            "store": self._ranks(so),
            "stored": self._ranks(sd),
            "pend": self._ranks(pd),
            "unsub": self._ranks(un),
            "jobs": ov.pending_counts(ov.scheduler_child(self.sched), self.N)
            if self._offload()
            else (0,) * self.N,
            "fence": ov.fenced(ov.scheduler_child(self.sched), self.jobmap)
            if self._offload()
            else empty,
            "clobbered": self.clobbered,
            "rd": rd,
            "hb": frozenset(self.hb),
            "agg": tuple(self.agg._send_remaining_count.get(req_id(r), 0) for r in rng),
            "emits": tuple(self.emits[r] for r in rng),
            "lateFinish": self.late_finish,
            "published": frozenset(w for w in range(self.W) if self._published(w)),
        }
        return {k: values[k] for k in VARIABLES}
