"""The conformance driver over the REAL vLLM classes (the installed wheel, as shipped).

`VllmDriver(row)` replays spec actions (spec/KVCompletion.tla) on an in-process mini-cluster
(vllm_cluster.py): the real v1 Scheduler, W real worker-side connectors (NIXL, or vLLM's
MultiConnector over NIXL + a second child: vLLM's HF3FSKVConnector, which delays the free,
for multi-nixl-hf3fs (hf3fs_child.py), or vLLM's OffloadingConnector for
multi-nixl-offload-upstream) with their own NIXL agents and
KV caches on the chosen device, the real KVOutputAggregator, and one real decode-side
NixlConnector per TP rank doing NIXL READs from the producer rank of its tp rank (in push
mode, Transfer = "push": NixlPushConnector on both sides, the producer WRITEs;
push_actions.py). TP > 1
and PCP > 1 are supported; PP > 1 raises DriverUnavailable (vllm_env.PP_UNAVAILABLE says
why).
Only the model forward is replaced: each rank's `ModelRunnerOutput` is synthetic (one
sampled token per scheduled request); its `kv_connector_output` is what the real connector
returned.

Mapping: spec request r (1..NReq) is vLLM request id f"req-{r}" (a prompt of one block, or
of a block every request shares and one of its own: prefix_layout.py;
max_tokens = 1, kv_transfer_params do_remote_decode = True, added before the run in id
order); spec rank w is worker index w, numbered as vLLM numbers global ranks (TP
innermost): tp = w % TP, pcp = (w // TP) % PCP, pp = w // (TP * PCP), i.e.
w = ((pp * PCP) + pcp) * TP + tp (matrix.Topology.rank_coords, used for every rank here).

How the driver reads vLLM's objects as the spec's variables: vllm_view.py.

Waits: a READ's completion and a notification's arrival happen on UCX's threads, so the
driver waits for them within `waits` (vllm_inbox.Waits, injected). A wait that expires
raises WaitTimeout, never MissingAction: "vLLM cannot take this step" is decided from its
state (the guards below), not from a clock.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import traceback
from collections import deque
from typing import Any

from kvspec.drivers import offload_view as ov
from kvspec.drivers.base import Driver, MissingAction
from kvspec.drivers.cluster_pool import acquire, discard, release
from kvspec.drivers.patches import get_patch
from kvspec.drivers.prefix_layout import ONE_BLOCK, Layout, unsupported
from kvspec.drivers.push_actions import PushActions, TransferCorrupted
from kvspec.drivers.vllm_adapters import (
    add_recv,
    transfer_results,
    with_known_fields,
    worker_copy,
)
from kvspec.drivers.vllm_caches import differing_layer, zero_blocks
from kvspec.drivers.vllm_cluster import Cluster
from kvspec.drivers.vllm_env import BLOCK_SIZE, DEFAULT_MODEL, DriverUnavailable, runner_output
from kvspec.drivers.vllm_inbox import DEFAULT_WAITS, Waits
from kvspec.drivers.vllm_view import Read, Step, req_id, spec_r
from kvspec.matrix import ModelRow
from kvspec.model import ACTIONS, Action, pipeline_depth

__all__ = ["VllmDriver", "TransferCorrupted"]


class VllmDriver(PushActions, Driver):
    def __init__(
        self,
        row: ModelRow,
        device: str = "cpu",
        impl_patch: str | None = None,
        waits: Waits = DEFAULT_WAITS,
        decode_composition: str = "nixl",
        decode_tp: int = 0,
        model: str = DEFAULT_MODEL,
        layout: Layout = ONE_BLOCK,
    ) -> None:
        """`layout`: the prompts, pools and prefix caching (prefix_layout.py)."""
        super().__init__(row)
        why = unsupported(layout, row)
        if why is not None:
            raise DriverUnavailable(why)
        self.layout = layout
        self.waits = waits
        self.W = row.topology.world_size
        self.N = row.requests
        self._undo_patch: Any = None
        self._cluster: Cluster | None = None
        self.lazy = {}  # before the cluster: close() runs if building it fails
        if impl_patch is not None:
            patch = get_patch(impl_patch)  # an unknown patch fails before a cluster is built
        self._cluster = acquire(row, device, waits, decode_composition, decode_tp, model, layout)
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
                    prompt_token_ids=layout.prompt(r, BLOCK_SIZE),
                    sampling_params=api.SamplingParams(max_tokens=1),
                    pooling_params=None,
                    block_hasher=hasher,
                )
                rq.kv_transfer_params = {"do_remote_decode": True}
                self.sched.add_request(rq)
        except BaseException:
            self.close()
            raise
        self.steps: deque[Step] = deque()
        self.max_steps = pipeline_depth(row)  # the spec's PipelineDepth (max_concurrent_batches)
        self.late_finish = False
        self.late_error: str | None = None
        self.emits = [0] * (self.N + 1)
        self.hb: set[int] = set()
        self.params: dict[int, dict[str, Any]] = {}  # kv_transfer_params from request_finished
        self.reads: dict[tuple[int, int], Read] = {}
        self.jobmap = ov.JobMap()
        self.clobbered = False
        self.blocks: dict[int, frozenset[int]] = {}  # r -> block ids it was allocated
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

    def close(self) -> None:
        for lazy in self.lazy.values():
            with contextlib.suppress(Exception):  # closing: the cluster is released below
                lazy.close()
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

    @staticmethod
    def _nixl_meta(meta: Any, composition: str) -> Any:
        return meta if composition == "nixl" else meta.metadata[0]

    # ------------------------------------------------------------------ guards
    # One guard per spec action: the action raises MissingAction when its guard is false,
    # and enabled() lists exactly the actions whose guard holds.
    def _missing(self, action: str, why: str) -> MissingAction:
        if self.late_finish:
            why = f"the engine crashed on a late finished_sending ({self.late_error})"
        return MissingAction(f"{action}: {why}")

    def _can_schedule(self) -> bool:
        return not self.late_finish and len(self.steps) < self.max_steps and self._has_requests()

    def _can_execute_model(self) -> bool:
        return not self.late_finish and any(not s.ran for s in self.steps)

    def _can_update_from_output(self) -> bool:
        return not self.late_finish and bool(self.steps) and self.steps[0].ran

    def _can_abort(self, r: int) -> bool:
        return not self.late_finish and self._status(r) in ("waiting", "running")

    def _can_consumer_start_load_kv(self, r: int, w: int) -> bool:
        return self._may_start_transfer(r, w, "pull", self.c.nixl_worker(w)._reqs_to_process)

    def _can_consumer_get_finished(self, r: int, w: int) -> bool:
        return self.row.transfer == "pull" and self._in_flight(r, w)

    def _can_heartbeat(self, r: int) -> bool:
        return (
            self._status(r) == "sending"
            and r not in self.hb
            and not any(rr == r for rr, _ in self.reads)
        )

    def _can_lease_expire(self, r: int, w: int) -> bool:
        return (
            req_id(r) in self.c.nixl_worker(w)._reqs_to_send
            and not self._expired(w, r)
            # guarded: no READ (push: WRITE) in flight; untimed, the deadline may pass
            # under one (KVCompletion.tla lease_expire)
            and (self.row.timing != "guarded" or not self._in_flight(r, w))
        )

    def _can_store_complete(self, r: int, w: int) -> bool:
        # HF3FS: a save of r submitted on rank w whose Future is not done (held in the
        # queue). Offloading: a store job of r submitted to rank w's worker, not complete.
        if self._offload():
            return ov.store_job_of(self._offload_child(w), self.jobmap, r) is not None
        return self._hf3fs() and req_id(r) in self.c.hf3fs(w).held_saves()

    # ------------------------------------------------------------------ actions
    def schedule(self) -> None:
        """Spec `schedule`: Scheduler.schedule() (its connector builds the NIXL metadata)."""
        if not self._can_schedule():
            raise self._missing("schedule", "no step slot or no requests")
        live = ov.pending_counts(ov.scheduler_child(self.sched), self.N) if self._offload() else ()
        so = self.sched.schedule()
        meta = self._nixl_meta(so.kv_connector_metadata, self.row.composition)
        new_blocks: set[int] = set()
        for nr in so.scheduled_new_reqs:
            ids = frozenset(int(b) for group in nr.block_ids for b in group)
            self.blocks[spec_r(nr.req_id)] = ids
            new_blocks |= ids
        st = Step(
            so=so,
            batch=self._reqs(nr.req_id for nr in so.scheduled_new_reqs),
            to_send=self._reqs(meta.reqs_to_send),
            not_proc=self._reqs(meta.reqs_not_processed),
            # scheduler.py:1514: the set finished since the last schedule, shipped to
            # the workers' get_finished (HF3FS reads it; the spec keeps it for HF3FS).
            fin=self._reqs(so.finished_req_ids) if self._hf3fs() else frozenset(),
            new_blocks=frozenset(new_blocks),
        )
        if self._offload():
            # Recorded now: handle_preemptions pops the flushed jobs out of store_jobs.
            st.jobs, st.flush = self.jobmap.record(ov.child_meta(so))
            st.reused = frozenset(
                r
                for r, n in enumerate(live, start=1)
                if n > 0 and self._status(r) == "freed" and self.blocks.get(r, set()) & new_blocks
            )
        self.steps.append(st)

    def _rank_copy(self, meta: Any) -> Any:
        """The metadata as rank w's worker gets it: with one rank the in-process executor
        hands over the scheduler's object; with more, each worker process unpickles its
        own copy (MultiprocExecutor.collective_rpc -> shm_broadcast MessageQueue.enqueue
        pickles), so no rank sees what another rank's connector changed in it."""
        return meta if self.W == 1 else worker_copy(meta)

    def _run_rank(self, w: int, st: Step) -> Any:
        api = self.c.api
        conn = self.c.workers[w]
        so = st.so
        # gpu_model_runner.execute_model: handle_preemptions (the offloading child flushes
        # stores of blocks this step reuses), then kv_connector_model_runner_mixin: bind ->
        # start_load_kv -> forward -> wait_for_save -> get_transfer_results ->
        # build_connector_worker_meta -> clear.
        meta = self._rank_copy(so.kv_connector_metadata)
        conn.handle_preemptions(meta)
        if self._offload() and ov.clobbers(self._offload_child(w), st.new_blocks):
            # The forward (replaced here) would write a block a store still reads.
            self.clobbered = True
        conn.bind_connector_metadata(meta)
        try:
            conn.start_load_kv(None)
            # (model forward replaced: nothing writes the KV caches here)
            conn.wait_for_save()
            res = transfer_results(conn, so.finished_req_ids)
            wmeta = conn.build_connector_worker_meta()
        finally:
            conn.clear_connector_metadata()
        return runner_output(
            api,
            so,
            with_known_fields(
                api.KVConnectorOutput,
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                kv_connector_worker_meta=wmeta,
            ),
        )

    def execute_model(self) -> None:
        """Spec `execute_model`: every rank's model-runner connector calls (`_run_rank`) on
        the oldest scheduled step."""
        if not self._can_execute_model():
            raise self._missing("execute_model", "no scheduled step to run")
        st = next(s for s in self.steps if not s.ran)
        st.outputs = [self._run_rank(w, st) for w in range(self.W)]
        st.out = tuple(self._reqs(o.kv_connector_output.finished_sending or ()) for o in st.outputs)
        empty: frozenset[int] = frozenset()
        st.ack = tuple(ov.acks(o, self.jobmap) if self._offload() else empty for o in st.outputs)
        st.ran = True

    def update_from_output(self) -> None:
        """Spec `update_from_output`: KVOutputAggregator.aggregate over the ranks' outputs,
        then Scheduler.update_from_output."""
        if not self._can_update_from_output():
            raise self._missing("update_from_output", "the oldest step has not run")
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
        """Spec `abort(r)`: Scheduler.finish_requests(req, FINISHED_ABORTED)."""
        if not self._can_abort(r):
            raise self._missing(f"abort({r})", "request is not waiting or running")
        self.sched.finish_requests(req_id(r), self.c.api.RequestStatus.FINISHED_ABORTED)

    def consumer_start_load_kv(self, r: int, w: int) -> None:
        """Spec `consumer_start_load_kv(r, w)`: the decode worker of w's tp rank runs
        NixlConnector.start_load_kv on metadata asking for r's block (a real NIXL READ)."""
        if not self._can_consumer_start_load_kv(r, w):
            raise MissingAction(f"consumer_start_load_kv({r}, {w}): not possible now")
        self.post_read(r, w)

    def post_read(self, r: int, w: int) -> None:
        """The decode worker of w's tp rank posts a real NIXL READ of r's blocks (no spec
        guard: the lease clock driver also reads blocks the producer already freed)."""
        api = self.c.api
        params = self.params[r]
        remote, local = self.layout.moved_of(params), self.layout.local_blocks(r)
        t = self.c.consumer_of(w)
        zero_blocks(self.c.consumers_caches[t], local)
        meta = api.NixlConnectorMetadata()
        add_recv(meta, req_id(r), (list(local),), dict(params))
        cons = self.c.consumers[t]
        cons.bind_connector_metadata(meta)
        try:
            cons.start_load_kv(None)
        finally:
            cons.clear_connector_metadata()
        if req_id(r) not in cons.connector_worker._recving_transfers:
            raise MissingAction(f"consumer_start_load_kv({r}, {w}): no READ was posted")
        self.reads[(r, w)] = Read("inflight", local, remote)

    def consumer_get_finished(self, r: int, w: int) -> None:
        """Spec `consumer_get_finished(r, w)`: the decode worker's get_transfer_results
        reports the READ done, and its notification is delivered to rank w's agent."""
        if not self._can_consumer_get_finished(r, w):
            raise MissingAction(f"consumer_get_finished({r}, {w}): no READ in flight")
        self.await_read(r, w)
        self.deliver_notif(r, w)

    def await_read(self, r: int, w: int) -> None:
        """The decode worker's get_transfer_results reports r's READ from w done; its
        bytes equal the producer's block."""
        rd = self.reads[(r, w)]
        t = self.c.consumer_of(w)
        key = (t, req_id(r))

        def reported() -> bool:
            # D's model runner polls get_transfer_results each step; one poll may report
            # several requests' READs, so completions are kept until their action fires.
            if key not in self.recv_done:
                res = self.c.consumer_poll(t)
                self.recv_done |= {(t, x) for x in res.finished_recving}
                self.recv_failed |= {(t, x) for x in res.failed_recving}
            return key in self.recv_done

        self.waits.until(reported, f"the READ of {req_id(r)} from rank {w} to complete")
        self.recv_done.discard(key)
        if key in self.recv_failed:
            raise MissingAction(f"consumer_get_finished({r}, {w}): the READ failed")
        bad = differing_layer(
            self.c.api.torch, self.c.consumers_caches[t], rd.local, self.c.caches[w], rd.remote
        )
        if bad is not None:
            raise TransferCorrupted(f"req {r}: layer {bad} differs after the READ")

    def deliver_notif(self, r: int, w: int) -> None:
        """The READ's "r:1" notification, once arrived at rank w's agent, is delivered
        (vLLM's _get_new_notifs reads it at w's next get_transfer_results)."""
        item = self.c.inboxes[w].wait_arrived(f"{req_id(r)}:1".encode(), self.waits)
        self.c.inboxes[w].deliver(item)
        self.reads[(r, w)].state = "done"

    def heartbeat(self, r: int) -> None:
        """Spec `heartbeat(r)`: every decode worker's NixlPullConnectorWorker._send_heartbeats
        sends "HB:<req>" to the producer agents it handshook with; each one's
        _handle_heartbeat runs as _get_new_notifs would on its arrival."""
        if not self._can_heartbeat(r):
            raise MissingAction(f"heartbeat({r}): not possible now")
        api = self.c.api
        for cons in self.c.consumers:
            meta = api.NixlConnectorMetadata()
            meta.heartbeat_by_engine = {
                self.c.engine_id: api.HeartbeatInfo(
                    req_ids={req_id(r)},
                    host="127.0.0.1",
                    port=0,
                    tp_size=self.c.transfer_tp,
                    **({"dcp_size": self.c.dcp} if self.c.dcp > 1 else {}),
                )
            }
            cons.connector_worker._send_heartbeats(meta)
        msg = f"HB:{req_id(r)}".encode()
        for w in sorted(self._read_sources()):
            _, m = self.c.inboxes[w].wait_arrived(msg, self.waits)
            self.c.nixl_worker(w)._handle_heartbeat(m.decode()[3:])
        self.hb.add(r)

    def lease_expire(self, r: int, w: int) -> None:
        """Spec `lease_expire(r, w)`: rank w's lease deadline in the NIXL worker's
        _reqs_to_send is moved into the past (its _reap_expired_send_leases then fires)."""
        if not self._can_lease_expire(r, w):
            raise MissingAction(f"lease_expire({r}, {w}): no live lease")
        self.c.nixl_worker(w)._reqs_to_send[req_id(r)] = time.perf_counter() - 1.0

    def store_complete(self, r: int, w: int) -> None:
        """Spec `store_complete(r, w)`: rank w's HF3FS save of r finishes (vLLM's
        AsyncOperationManager._succeed_task sets its Future, hf3fs_child.complete_save), or
        its OffloadingWorker's store job of r does (offload_view.complete_store)."""
        if not self._can_store_complete(r, w):
            raise MissingAction(f"store_complete({r}, {w}): no store of r in flight on w")
        if self._offload():
            # The OffloadingWorker's transfer finishes: get_finished reports it next step.
            child = self._offload_child(w)
            jid = ov.store_job_of(child, self.jobmap, r)
            assert jid is not None
            ov.complete_store(child, jid)
            return
        self.c.hf3fs(w).complete_save(req_id(r))

    # ------------------------------------------------------------------ enabled / observe
    def enabled(self) -> list[Action]:
        domain = {"r": range(1, self.N + 1), "w": range(self.W)}
        acts = []
        for name, params in ACTIONS.items():
            guard = getattr(self, f"_can_{name}", None)
            if guard is None:
                # An action this driver does not drive (push mode: Driver.push_write
                # raises MissingAction) is never enabled.
                continue
            acts += [
                Action(name, *args)
                for args in itertools.product(*(domain[p] for p in params))
                if guard(*args)
            ]
        return sorted(acts)
