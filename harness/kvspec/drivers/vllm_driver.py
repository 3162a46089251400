"""The conformance driver over the REAL vLLM classes (the installed wheel, as shipped).

`VllmDriver(row)` replays spec actions (spec/KVCompletion.tla) on an in-process mini-cluster
(vllm_cluster.py): the real v1 Scheduler, W real worker-side connectors (NIXL, or vLLM's
MultiConnector over NIXL + an offload child: the delaying one of offload_delaying.py, or
vLLM's OffloadingConnector for multi-nixl-offload-upstream) with their own NIXL agents and
CPU KV caches, the real KVOutputAggregator, and one real decode-side NixlConnector per TP
rank doing NIXL READs from the producer rank of its tp rank. TP > 1 and PCP > 1 are
supported; PP > 1 raises DriverUnavailable (vllm_cluster.PP_UNAVAILABLE says why).
Only the model forward is replaced: each rank's `ModelRunnerOutput` is synthetic (one
sampled token per scheduled request); its `kv_connector_output` is what the real connector
returned.

Mapping: spec request r (1..NReq) is vLLM request id f"req-{r}" (a prompt of one block,
max_tokens = 1, kv_transfer_params do_remote_decode = True, added before the run in id
order); spec rank w is worker index w with pcp = w % PCP, tp = (w // PCP) % TP,
pp = w // (PCP * TP).

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

import contextlib
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.base import Driver, MissingAction
from kvspec.drivers.patches import get_patch
from kvspec.drivers.vllm_cluster import (
    WAIT_TIMEOUT_S,
    Cluster,
    ClusterError,
    ClusterKey,
    acquire,
    discard,
    release,
)
from kvspec.drivers.vllm_env import BLOCK_SIZE, DriverUnavailable
from kvspec.matrix import ModelRow
from kvspec.model import ACTIONS, VARIABLES, Action
from kvspec.tlcvalue import Record, Value, make_fn

__all__ = ["VllmDriver", "DriverUnavailable", "TransferCorrupted", "req_id", "spec_r"]


class TransferCorrupted(AssertionError):
    """The bytes the consumer READ differ from the producer's block."""


def req_id(r: int) -> str:
    return f"req-{r}"


def spec_r(rid: str) -> int:
    return int(rid.split("-", 1)[1])


@dataclass
class _Step:
    so: Any  # the real SchedulerOutput
    batch: frozenset[int]
    to_send: frozenset[int]
    not_proc: frozenset[int]
    ran: bool = False
    outputs: list[Any] = field(default_factory=list)  # per-rank ModelRunnerOutput
    out: tuple[frozenset[int], ...] = ()


@dataclass
class _Read:
    state: str  # "inflight" | "done"
    local_block: int
    remote_block: int


class VllmDriver(Driver):
    def __init__(self, row: ModelRow, device: str = "cpu", impl_patch: str | None = None) -> None:
        super().__init__(row)
        self.device = device
        self.W = row.topology.world_size
        self.N = row.requests
        self._undo_patch: Any = None
        self._cluster: Cluster | None = None
        if impl_patch is not None:
            patch = get_patch(impl_patch)
        key = ClusterKey(
            composition=row.composition,
            tp=row.topology.tp,
            pp=row.topology.pp,
            pcp=row.topology.pcp,
            nreq=row.requests,
            capacity=row.capacity,
            async_scheduling=row.async_scheduling,
            device=device,
        )
        self._cluster = acquire(key)
        c = self._cluster
        try:
            if impl_patch is not None:
                self._undo_patch = patch.apply()
            api = c.api
            sched_cls = api.AsyncScheduler if row.async_scheduling else api.Scheduler
            self.sched = sched_cls(
                vllm_config=c.cfg,
                kv_cache_config=c.kv_cache_config,
                structured_output_manager=api.StructuredOutputManager(c.cfg),
                block_size=BLOCK_SIZE,
            )
            self.agg = api.KVOutputAggregator.from_connector(
                self.sched.connector, world_size=self.W
            )
            # What the upstream offloading child's scheduler side answered at each
            # request_finished (r -> delay_free); the spec says it never delays.
            self.offload_delays: dict[int, bool] = {}
            if row.composition == "multi-nixl-offload-upstream":
                self._record_offload_request_finished(self.sched.connector._connectors[1])
            # EngineCore hashes every request's blocks when a KV connector is configured.
            hasher = api.get_request_block_hasher(
                BLOCK_SIZE, api.get_hash_fn_by_name(c.cfg.cache_config.prefix_caching_hash_algo)
            )
            for r in range(1, self.N + 1):
                rq = api.Request(
                    request_id=req_id(r),
                    prompt_token_ids=[(r * 31 + i) % 500 + 3 for i in range(BLOCK_SIZE)],
                    sampling_params=api.SamplingParams(max_tokens=1),
                    pooling_params=None,
                    block_hasher=hasher,
                )
                rq.kv_transfer_params = {"do_remote_decode": True}
                self.sched.add_request(rq)
        except BaseException:
            self.close()
            raise
        self.steps: deque[_Step] = deque()
        self.max_steps = 2 if row.async_scheduling else 1
        self.late_finish = False
        self.late_error: str | None = None
        self.emits = [0] * (self.N + 1)
        self.hb: set[int] = set()
        self.params: dict[int, dict[str, Any]] = {}  # kv_transfer_params from request_finished
        self.reads: dict[tuple[int, int], _Read] = {}
        # (consumer, req id): finished_recving (failed_recving) not yet acted on.
        self.recv_done: set[tuple[int, str]] = set()
        self.recv_failed: set[tuple[int, str]] = set()

    # ------------------------------------------------------------------ plumbing
    def _record_offload_request_finished(self, child: Any) -> None:
        """Record the real OffloadingConnector's request_finished answers (this instance
        only; the call itself runs unchanged)."""
        for name in ("request_finished", "request_finished_all_groups"):
            real = getattr(child, name)

            def wrapped(request: Any, block_ids: Any, _real: Any = real) -> Any:
                delay, params = _real(request, block_ids)
                self.offload_delays[spec_r(request.request_id)] = bool(delay)
                return delay, params

            setattr(child, name, wrapped)

    @property
    def c(self) -> Cluster:
        if self._cluster is None:
            raise RuntimeError("driver is closed")
        return self._cluster

    def close(self) -> None:
        if self._undo_patch is not None:
            undo, self._undo_patch = self._undo_patch, None
            undo()
        if self._cluster is not None:
            cl, self._cluster = self._cluster, None
            with contextlib.suppress(Exception):
                if getattr(self, "sched", None) is not None:
                    self.sched.shutdown()
            try:
                release(cl)
            except Exception:
                discard(cl)

    def _nixl_sched(self) -> Any:
        conn = self.sched.connector
        if self.row.composition != "nixl":
            conn = conn._connectors[0]
        return conn.connector_scheduler

    @staticmethod
    def _nixl_meta(meta: Any, composition: str) -> Any:
        return meta if composition == "nixl" else meta.metadata[0]

    def _reqs(self, ids: Any) -> frozenset[int]:
        return frozenset(spec_r(x) for x in ids)

    def _guard_engine(self, what: str) -> None:
        if self.late_finish:
            raise MissingAction(
                f"{what}: the engine crashed on a late finished_sending ({self.late_error})"
            )

    def _read_sources(self) -> set[int]:
        """Ranks whose handshake the consumer holds: (pp, tp) -> the publishing rank."""
        held = {
            pp_tp
            for cons in self.c.consumers
            for pp_tp in cons.connector_worker._remote_agents.get(self.c.engine_id, {})
        }
        topo = self.row.topology
        return {
            w
            for w in range(self.W)
            if tuple(topo.rank_coords(w))[:2] in held and self._published(w)
        }

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

    # ------------------------------------------------------------------ actions
    def schedule(self) -> None:
        self._guard_engine("schedule")
        if len(self.steps) >= self.max_steps or not self._has_requests():
            raise MissingAction("schedule: no step slot or no requests")
        so = self.sched.schedule()
        meta = self._nixl_meta(so.kv_connector_metadata, self.row.composition)
        self.steps.append(
            _Step(
                so=so,
                batch=self._reqs(nr.req_id for nr in so.scheduled_new_reqs),
                to_send=self._reqs(meta.reqs_to_send),
                not_proc=self._reqs(meta.reqs_not_processed),
            )
        )

    def _run_rank(self, w: int, so: Any) -> Any:
        api = self.c.api
        conn = self.c.workers[w]
        # gpu_model_runner.execute_model: handle_preemptions (the offloading child flushes
        # stores of blocks this step reuses), then kv_connector_model_runner_mixin: bind ->
        # start_load_kv -> forward -> wait_for_save -> get_transfer_results ->
        # build_connector_worker_meta -> clear.
        conn.handle_preemptions(so.kv_connector_metadata)
        conn.bind_connector_metadata(so.kv_connector_metadata)
        try:
            conn.start_load_kv(None)
            # (model forward replaced: nothing writes the KV caches here)
            conn.wait_for_save()
            res = conn.get_transfer_results(so.finished_req_ids)
            wmeta = conn.build_connector_worker_meta()
        finally:
            conn.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        return api.ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=api.KVConnectorOutput(
                finished_sending=set(res.finished_sending) or None,
                finished_recving=set(res.finished_recving) or None,
                failed_recving=set(res.failed_recving),
                kv_connector_worker_meta=wmeta,
            ),
        )

    def execute_model(self) -> None:
        self._guard_engine("execute_model")
        st = next((s for s in self.steps if not s.ran), None)
        if st is None:
            raise MissingAction("execute_model: no scheduled step to run")
        st.outputs = [self._run_rank(w, st.so) for w in range(self.W)]
        st.out = tuple(self._reqs(o.kv_connector_output.finished_sending or ()) for o in st.outputs)
        st.ran = True

    def update_from_output(self) -> None:
        self._guard_engine("update_from_output")
        if not self.steps or not self.steps[0].ran:
            raise MissingAction("update_from_output: the oldest step has not run")
        st = self.steps.popleft()
        out = self.agg.aggregate(st.outputs)
        for rid in out.kv_connector_output.finished_sending or ():
            r = spec_r(rid)
            self.emits[r] = min(2, self.emits[r] + 1)
        try:
            eco = self.sched.update_from_output(st.so, out)
        except AssertionError as exc:
            # Scheduler._update_from_kv_xfer_finished: `assert req_id in self.requests`.
            # Any other assertion is a crash the spec does not model: let it through.
            last = traceback.extract_tb(exc.__traceback__)[-1]
            if last.name != "_update_from_kv_xfer_finished" and "self.requests" not in (
                last.line or ""
            ):
                raise
            self.late_finish = True
            self.late_error = f"AssertionError in Scheduler.update_from_output: {exc!r}"
            return
        for outs in eco.values():
            for o in outs.outputs:
                if o.kv_transfer_params:
                    self.params[spec_r(o.request_id)] = dict(o.kv_transfer_params)

    def abort(self, r: int) -> None:
        self._guard_engine("abort")
        if self._status(r) not in ("waiting", "running"):
            raise MissingAction(f"abort({r}): request is not waiting or running")
        self.sched.finish_requests(req_id(r), self.c.api.RequestStatus.FINISHED_ABORTED)

    def _can_start_read(self, r: int, w: int) -> bool:
        return (
            self._status(r) == "sending"
            and r in self.params
            and w in self._read_sources()
            and (r, w) not in self.reads
            and req_id(r) in self.c.nixl_worker(w)._reqs_to_process
            and not self._expired(w, r)
        )

    def consumer_start_load_kv(self, r: int, w: int) -> None:
        if not self._can_start_read(r, w):
            raise MissingAction(f"consumer_start_load_kv({r}, {w}): not possible now")
        api = self.c.api
        params = self.params[r]
        remote_block = int(params["remote_block_ids"][0][0])
        local_block = r  # consumer blocks 1..N (0 is vLLM's null block)
        t = self.c.consumer_of(w)
        for cache in self.c.consumers_caches[t].values():
            cache[local_block].zero_()
        meta = api.NixlConnectorMetadata()
        meta.add_new_req_to_recv(req_id(r), ([local_block],), dict(params), awaiting_kvs=True)
        cons = self.c.consumers[t]
        cons.bind_connector_metadata(meta)
        try:
            cons.start_load_kv(None)
        finally:
            cons.clear_connector_metadata()
        if req_id(r) not in cons.connector_worker._recving_transfers:
            raise MissingAction(f"consumer_start_load_kv({r}, {w}): no READ was posted")
        self.reads[(r, w)] = _Read("inflight", local_block, remote_block)

    def consumer_get_finished(self, r: int, w: int) -> None:
        rd = self.reads.get((r, w))
        if rd is None or rd.state != "inflight":
            raise MissingAction(f"consumer_get_finished({r}, {w}): no READ in flight")
        t = self.c.consumer_of(w)
        key = (t, req_id(r))
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while key not in self.recv_done:
            # D's model runner polls get_transfer_results each step; one poll may report
            # several requests' READs, so completions are kept until their action fires.
            res = self.c.consumer_poll(t)
            self.recv_done |= {(t, x) for x in res.finished_recving}
            self.recv_failed |= {(t, x) for x in res.failed_recving}
            if key in self.recv_done:
                break
            if time.monotonic() > deadline:
                raise MissingAction(f"consumer_get_finished({r}, {w}): READ not done in time")
            time.sleep(0.0002)
        self.recv_done.discard(key)
        if key in self.recv_failed:
            raise MissingAction(f"consumer_get_finished({r}, {w}): the READ failed")
        torch = self.c.api.torch
        for name, cache in self.c.consumers_caches[t].items():
            if not torch.equal(cache[rd.local_block], self.c.caches[w][name][rd.remote_block]):
                raise TransferCorrupted(f"req {r}: layer {name} differs after the READ")
        try:
            item = self.c.inboxes[w].wait_arrived(f"{req_id(r)}:1".encode(), WAIT_TIMEOUT_S)
        except ClusterError as exc:
            raise MissingAction(f"consumer_get_finished({r}, {w}): {exc}") from exc
        self.c.inboxes[w].delivered.append(item)
        rd.state = "done"

    def _can_heartbeat(self, r: int) -> bool:
        return (
            self._status(r) == "sending"
            and r not in self.hb
            and not any(rr == r for rr, _ in self.reads)
        )

    def heartbeat(self, r: int) -> None:
        if not self._can_heartbeat(r):
            raise MissingAction(f"heartbeat({r}): not possible now")
        api = self.c.api
        # D's real path: every decode worker runs NixlPullConnectorWorker._send_heartbeats
        # -> send_notif("HB:...") to every producer agent it handshook with.
        for cons in self.c.consumers:
            meta = api.NixlConnectorMetadata()
            meta.heartbeat_by_engine = {
                self.c.engine_id: api.HeartbeatInfo(
                    req_ids={req_id(r)}, host="127.0.0.1", port=0, tp_size=self.row.topology.tp
                )
            }
            cons.connector_worker._send_heartbeats(meta)
        msg = f"HB:{req_id(r)}".encode()
        for w in sorted(self._read_sources()):
            try:
                _, m = self.c.inboxes[w].wait_arrived(msg, WAIT_TIMEOUT_S)
            except ClusterError as exc:
                raise MissingAction(f"heartbeat({r}): {exc}") from exc
            # What _get_new_notifs does with an "HB:" message, as it arrives.
            self.c.nixl_worker(w)._handle_heartbeat(m.decode()[3:])
        self.hb.add(r)

    def lease_expire(self, r: int, w: int) -> None:
        sends = self.c.nixl_worker(w)._reqs_to_send
        rd = self.reads.get((r, w))
        if req_id(r) not in sends or self._expired(w, r) or (rd and rd.state == "inflight"):
            raise MissingAction(f"lease_expire({r}, {w}): no live lease")
        sends[req_id(r)] = time.perf_counter() - 1.0  # the deadline has passed

    def store_complete(self, r: int, w: int) -> None:
        eng = self.c.store_engine
        if eng is None or req_id(r) not in eng.ranks[w].store:
            raise MissingAction(f"store_complete({r}, {w}): no store job")
        eng.complete(req_id(r), w)

    # ------------------------------------------------------------------ enabled / observe
    def enabled(self) -> list[Action]:
        acts: list[Action] = []
        if not self.late_finish:
            if len(self.steps) < self.max_steps and self._has_requests():
                acts.append(Action("schedule"))
            if any(not s.ran for s in self.steps):
                acts.append(Action("execute_model"))
            if self.steps and self.steps[0].ran:
                acts.append(Action("update_from_output"))
            for r in range(1, self.N + 1):
                if self._status(r) in ("waiting", "running"):
                    acts.append(Action("abort", r))
        for r in range(1, self.N + 1):
            for w in range(self.W):
                if self._can_start_read(r, w):
                    acts.append(Action("consumer_start_load_kv", r, w))
                rd = self.reads.get((r, w))
                if rd is not None and rd.state == "inflight":
                    acts.append(Action("consumer_get_finished", r, w))
                sends = self.c.nixl_worker(w)._reqs_to_send
                if (
                    req_id(r) in sends
                    and not self._expired(w, r)
                    and not (rd and rd.state == "inflight")
                ):
                    acts.append(Action("lease_expire", r, w))
                eng = self.c.store_engine
                if eng is not None and req_id(r) in eng.ranks[w].store:
                    acts.append(Action("store_complete", r, w))
            if self._can_heartbeat(r):
                acts.append(Action("heartbeat", r))
        assert all(a.name in ACTIONS for a in acts)
        return sorted(acts)

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
