"""Decode.tla (spec/Decode.tla) on the real classes: a decode engine's `Scheduler` with the
real NixlConnector scheduler side (kv_consumer, vLLM's default kv_load_failure_policy or
the row's), its real decode workers posting real NIXL READs from a real producer, vLLM's
`KVOutputAggregator`, and the producer ranks' real notification counting and reaper.

Set-up (the spec's Init: the producer holds every request's blocks, D has not scheduled
any): the vLLM driver's producer (`VllmDriver`, 0.32 as installed) prefills the requests,
finishes them (kv_transfer_params) and installs their leases; D gets one request per spec
request with those params (`do_remote_prefill`) and the same prompt.

- `schedule`: D's `Scheduler.schedule()` (its connector builds reqs_to_recv);
- `execute`: each D worker: bind -> `start_load_kv` -> `get_transfer_results` ->
  `get_block_ids_with_load_errors` -> clear (kv_connector_model_runner_mixin.py:66-107);
- `update`: `KVOutputAggregator.aggregate` over D's workers, D's `update_from_output`;
- `abort(r)`, `complete(r)`: D's `finish_requests` with FINISHED_ABORTED,
  FINISHED_LENGTH_CAPPED (the `_free_request` path a stop takes);
- `xfer_end(w, r, p, ok)`: the READ's handle is released to vLLM in NIXL's real state
  (DONE), or as `ERR` (ok = FALSE; its notification, which NIXL delivered anyway, is dropped
  at P's agent: a failed READ sends none);
- `deliver(p, r)`: the "r:n" that arrived at P rank p's agent goes to its `_get_new_notifs`;
- `lease_expire(p, r)`: P rank p's deadline moves into the past; its
  `_reap_expired_send_leases`.

Only the model forward is replaced (a synthetic ModelRunnerOutput). A READ is held "in
progress" by a seam on D's `check_xfer_state` (NIXL cannot hold a finished transfer), the
one way to order READ completions as the spec does. P TP and D TP may differ: each D rank
handshakes and READs the producer ranks vLLM's read plan gives it (nixl/tp_mapping.py; the
fixture model has 2 KV heads, at least P TP as Decode.tla assumes); a READ's producer rank
is read off its remote side handle. Release differences go through vllm_adapters.

A READ the spec ends inside the step that posted it (InStepEnd) is ended by the driver
between that worker's start_load_kv and its get_transfer_results (`execute("w.r.p.done",
...)`), where a real forward's time would let it complete.

MLA rows run a DeepSeek-V2-shaped fixture (vllm_env.MODELS["mla"], CPU_MLA's cache layout;
"mla-amx", AMX_MLA's): with P TP > D TP, D reads one producer rank and sends the others
notify-only "r:n" in the same start_load_kv (pull_worker.py:369-391), seen through the
HeldReads seam.

FullHit rows run the deployment where 0.32 can take a full local prefix hit (full_hit.py:
an MTP drafter with its block drop off, prefix caching on D), with D's prefix cache seeded
with the prompts the trace admits as full hits; vLLM's own lookup decides. D's first
contact with P runs through the HeldHandshake seam (Handshake rows). Not driven: the
LMCache child (it needs its server) and the re-introduced bugs (mutants are applied to the
real code instead).

What the driver observes (the spec's variables read off these objects): decode_view.py.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

from kvspec.decode import DESIGNS as RELEASE_DESIGNS
from kvspec.drivers import full_hit
from kvspec.drivers.base import MissingAction
from kvspec.drivers.decode_seams import HeldHandshake, HeldReads
from kvspec.drivers.decode_view import DecodeView, DStep, dreq
from kvspec.drivers.vllm_adapters import (
    has_load_cap,
    load_failed,
    reap_expired,
    recv_blocks,
    transfer_results,
    with_known_fields,
    worker_copy,
)
from kvspec.drivers.vllm_caches import AMX_FIXTURES, kv_cache_config
from kvspec.drivers.vllm_cluster import DECODE_COMPOSITIONS as DECODE
from kvspec.drivers.vllm_consumers import nixl_of
from kvspec.drivers.vllm_driver import VllmDriver
from kvspec.drivers.vllm_env import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    DriverUnavailable,
    runner_output,
    vllm_config,
)
from kvspec.drivers.vllm_inbox import DEFAULT_WAITS, Waits
from kvspec.drivers.vllm_view import req_id
from kvspec.matrix import ModelRow, Topology
from kvspec.sweep import SweepRow

# What the model runner passes start_load_kv, with no forward (no attention metadata).
NO_FORWARD = SimpleNamespace(attn_metadata=None, no_compile_layers={})


class DecodeDriver(DecodeView):
    def __init__(
        self, row: SweepRow, device: str = "cpu", waits: Waits = DEFAULT_WAITS,
        full_hits: frozenset[int] = frozenset(), mla: str = "mla", prefix_caching: bool = False,
    ) -> None:  # fmt: skip
        """`full_hits`: the requests the trace admits as full hits (full_hit.full_hits);
        FullHit rows run full_hit.py's deployment and seed D's prefix cache with them.
        `mla`: MLA rows' fixture ("mla-amx": AMX_MLA, an AMX host's, vllm_caches).
        `prefix_caching`: D runs vLLM's default, prefix caching on (FullHit rows always do),
        except where vLLM's CPU platform turns it off: MLA on CPU without AMX_MLA
        (platforms/cpu.py:516-530; vllm_caches.AMX_FIXTURES keep it)."""
        c = row.consts
        if c["Composition"] not in DECODE or (c["FullHit"] and c["MLA"]):
            # A row this driver cannot build is unavailable here, not a divergence.
            raise DriverUnavailable(f"{row.name}: composition in {DECODE}; full hits "
                                    "without MLA (no prefix caching for MLA on CPU)")  # fmt: skip
        if c.get("InStepEnd") and int(c["PTP"]) > int(c["DTP"]) and not c["MLA"]:
            # decode_traces.in_step_ends names a request's in-step ends per rank, exact
            # only with one read source per rank.
            raise DriverUnavailable(f"{row.name}: in-step READ ends with several read "
                                    "sources per decode rank are not driven")  # fmt: skip
        if c["Bug"] not in RELEASE_DESIGNS:  # a release's design replays on any release
            raise DriverUnavailable(f"{row.name}: bugs are mutants of the real code here")
        if c.get("LoadCap") and not has_load_cap():  # said before any engine is built
            raise DriverUnavailable(f"{row.name}: this vLLM has no "
                                    "--max-num-inflight-kv-loads (0.34+)")  # fmt: skip
        self.row, self.waits, self.N = row, waits, row.requests
        self.T, self.PT = int(c["DTP"]), int(c["PTP"])  # D's ranks, P's ranks
        prow = ModelRow(
            name="decode-producer", variant="v0.30-shipped", composition="nixl",
            topology=Topology(self.PT, 1, 1), requests=self.N, capacity=self.N,
            async_scheduling=False,
        )  # fmt: skip
        self.comp = str(c["Composition"])
        # MLA rows run the DeepSeek-shaped fixture on both engines (vllm_env.MODELS), FullHit
        # rows the GLM-shaped one whose D has an MTP drafter (full_hit.py).
        model = mla if c["MLA"] else full_hit.MODEL if c["FullHit"] else DEFAULT_MODEL
        self.full_hits = full_hits if c["FullHit"] else frozenset()
        cpu_mla = c["MLA"] and device == "cpu" and mla not in AMX_FIXTURES
        self.caching = prefix_caching and not cpu_mla
        self.p = VllmDriver(prow, device=device, waits=waits, decode_composition=self.comp,
                            decode_tp=self.T, model=model)  # fmt: skip
        self.held: list[HeldReads] = []
        self.hs: list[HeldHandshake] = []  # first contact (Handshake rows)
        try:
            self._prefill_on_producer()
            self._build_decode(device, str(c["Policy"]), bool(c["AsyncScheduling"]))
            if c.get("Handshake"):
                cws = [self.p.c.consumer_nixl(t).connector_worker for t in range(self.T)]
                self.hs = [HeldHandshake(cw, self.p.c.engine_id, waits) for cw in cws]
        except BaseException:
            self.close()
            raise
        self.steps: deque[DStep] = deque()
        self.depth = 2 if c["AsyncScheduling"] else 1  # max_concurrent_batches
        self.crashed = False
        self.pst: dict[tuple[int, int], str] = {}  # (p, r) -> notified | expired
        self.handles: dict[int, dict[int, tuple[int, int]]] = {t: {} for t in range(self.T)}
        self.results: dict[int, tuple[int, bool]] = {}  # handle -> (w, ok) once ended
        self.delivered: dict[tuple[int, int], int] = {}  # (p, r) -> notifications delivered

    # ------------------------------------------------------------------ set-up
    def _prefill_on_producer(self) -> None:
        """P prefills, finishes (params) and installs every lease (two engine steps)."""
        for _ in range(2):
            self.p.schedule()
            self.p.execute_model()
            self.p.update_from_output()
        for w in range(self.PT):
            missing = [r for r in range(1, self.N + 1)
                       if req_id(r) not in self.p.c.nixl_worker(w)._reqs_to_send]  # fmt: skip
            if missing:
                raise MissingAction(f"producer rank {w} holds no lease for {missing}")

    def _build_decode(self, device: str, policy: str, async_scheduling: bool) -> None:
        c = self.p.c
        api = c.api
        d_engine = c.consumer_nixl(0).connector_worker.engine_id
        # D's own block accounting: room for every request's prompt block plus the blocks
        # its decode tokens take; READs land only in the first ones (checked in execute).
        full = bool(self.row.consts["FullHit"])  # + room for the seeds' cached blocks
        dcfg = vllm_config(
            api, "kv_consumer", d_engine, self.comp, Topology(self.T, 1, 1),
            (6 if full else 4) * self.N + 1,
            async_scheduling, device,
            disable_hma=bool(c.cfg.scheduler_config.disable_hybrid_kv_cache_manager),
            model=c.model, speculative=full_hit.mtp_drafter if full else None,
            prefix_caching=self.caching,
        )  # fmt: skip
        dcfg.kv_transfer_config.kv_load_failure_policy = policy
        cap = int(self.row.consts.get("LoadCap") or 0)  # Decode.tla LoadCap (vLLM 0.34+)
        if cap:
            dcfg.scheduler_config.max_num_inflight_kv_loads = cap
        dkc = kv_cache_config(api, dcfg)
        sched_cls = api.AsyncScheduler if async_scheduling else api.Scheduler
        self.d = sched_cls(
            vllm_config=dcfg, kv_cache_config=dkc,
            structured_output_manager=api.StructuredOutputManager(dcfg), block_size=BLOCK_SIZE,
        )  # fmt: skip
        self.agg = api.KVOutputAggregator.from_connector(self.d.connector, world_size=self.T)
        hasher = api.get_request_block_hasher(
            BLOCK_SIZE, api.get_hash_fn_by_name(dcfg.cache_config.prefix_caching_hash_algo)
        )
        prompts = {r: [(r * 31 + i) % 500 + 3 for i in range(BLOCK_SIZE)]  # P's (vllm_driver)
                   for r in range(1, self.N + 1)}  # fmt: skip
        if full:
            full_hit.require_backoff(nixl_of(self.d.connector, self.comp).connector_scheduler)
            prompts = {r: full_hit.decode_prompt(pr) for r, pr in prompts.items()}
            full_hit.seed(api, self.d, hasher, {r: prompts[r] for r in self.full_hits})
        for r, prompt in prompts.items():
            rq = api.Request(
                request_id=dreq(r), prompt_token_ids=prompt,
                sampling_params=api.SamplingParams(max_tokens=64), pooling_params=None,
                block_hasher=hasher,
            )  # fmt: skip
            rq.kv_transfer_params = dict(self.p.params[r])
            self.d.add_request(rq)
        self.held = [HeldReads(c.consumer_nixl(t).connector_worker.nixl_wrapper)
                     for t in range(self.T)]  # fmt: skip

    def close(self) -> None:
        # The seams go first: the pooled cluster's reset then drains the READs a trace
        # left in progress with NIXL's real states.
        for hs in self.hs:
            hs.restore()
        for h in self.held:
            h.restore()
        if getattr(self, "d", None) is not None:
            with contextlib.suppress(Exception):
                self.d.shutdown()
        self.p.close()

    def __enter__(self) -> DecodeDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ actions
    def schedule(self) -> None:
        """Decode.tla `schedule`: D's Scheduler.schedule (scheduler.py:899-1395)."""
        if len(self.steps) >= self.depth:
            raise MissingAction("schedule: the step pipeline is full")
        self.steps.append(DStep(self.d.schedule()))

    def _run_worker(
        self, t: int, so: Any, ends: dict[tuple[int, int], bool]
    ) -> tuple[Any, set[str]]:
        """D rank t's step and its failed receives; `ends`: the READs (r, p) it posts that
        end before its poll (Decode.tla InStepEnd), ok or not, as the forward's time would
        let them."""
        api = self.p.c.api
        cons = self.p.c.consumers[t]
        cw = self.p.c.consumer_nixl(t).connector_worker
        before = {h for hs in cw._recving_transfers.values() for h in hs}
        # Each worker process unpickles its own copy of the scheduler output (the executor's
        # broadcast); NIXL's worker rewrites ReqMeta.remote.block_ids into kernel blocks in
        # place (pull_worker.py:262-266), so ranks sharing one object would convert twice.
        cons.bind_connector_metadata(worker_copy(so.kv_connector_metadata))
        try:
            # No forward: ExampleConnector returns at once on attn_metadata None.
            cons.start_load_kv(NO_FORWARD)
            for rid, hs in cw._recving_transfers.items():
                for hd in hs:
                    if hd not in before:
                        self.handles[t][hd] = (int(rid.split("-")[1]), self._source(t, hd))
            for (r, pr), ok in sorted(ends.items()):  # pr -1: every READ of r posted now
                fresh = {pp for hd, (rr, pp) in self.handles[t].items()
                         if rr == r and hd not in before}  # fmt: skip
                for pp in sorted(fresh if pr == -1 else {pr}):
                    self.xfer_end(t, r, pp, ok)
            blocks = recv_blocks(cw)
            res = transfer_results(cons, so.finished_req_ids)
            invalid = cons.get_block_ids_with_load_errors()
        finally:
            cons.clear_connector_metadata()
        return runner_output(
            api,
            so,
            with_known_fields(
                api.KVConnectorOutput,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=set(invalid),
            ),
        ), load_failed(res, blocks, set(invalid))

    def _source(self, t: int, hd: int) -> int:
        """The producer rank D rank t's READ `hd` reads (its remote side handle)."""
        cw = self.p.c.consumer_nixl(t).connector_worker
        by_rank = cw.dst_xfer_side_handles[self.p.c.engine_id]
        side = self.held[t].remote_side[hd]
        return next(int(rank) for rank, h in by_rank.items() if h is side or h == side)

    def _arrived(self, p: int, r: int) -> tuple[str, bytes]:
        """A READ's "r:n" at P rank p's agent, once it arrived (n is vLLM's own count of
        the D ranks reading p, local_consumers: utils.py:589-606; P checks it)."""
        prefix = f"{req_id(r)}:".encode()
        return self.p.c.inboxes[p].wait_arrived_where(
            lambda m: m.startswith(prefix), f"a notification of {req_id(r)}", self.waits
        )

    def execute(self, *ends: str) -> None:
        """Decode.tla `execute`: every D worker's step on the scheduled metadata. `ends`
        ("w.r.p.done" / "w.r.p.err"): READs posted in this step that end before its poll."""
        st = next((s for s in self.steps if not s.ran), None)
        if st is None:
            raise MissingAction("execute: no scheduled step")
        by_rank: dict[int, dict[tuple[int, int], bool]] = {t: {} for t in range(self.T)}
        for e in ends:
            w, r, p, how = e.split(".")
            by_rank[int(w)][(int(r), -1 if p == "all" else int(p))] = how == "done"
        if self.hs:  # entries a worker not yet handshaken hands to the pending handshake
            meta = VllmDriver._nixl_meta(st.so.kv_connector_metadata, self.comp)
            for hs in self.hs:
                if hs.state() != "done":
                    hs.deferred += len(meta.reqs_to_recv)
        runs = [self._run_worker(t, st.so, by_rank[t]) for t in range(self.T)]
        st.outputs, st.failed = [o for o, _ in runs], [f for _, f in runs]
        st.ran = True

    def update(self) -> None:
        """Decode.tla `update`: aggregate, then D's update_from_output (an assertion in
        _update_from_kv_xfer_finished is the spec's crash)."""
        if not self.steps or not self.steps[0].ran:
            raise MissingAction("update: no executed step")
        st = self.steps.popleft()
        out = self.agg.aggregate(st.outputs)
        try:
            self.d.update_from_output(st.so, out)
        except AssertionError:
            self.crashed = True

    def abort(self, r: int) -> None:
        self.d.finish_requests(dreq(r), self.p.c.api.RequestStatus.FINISHED_ABORTED)

    def complete(self, r: int) -> None:
        self.d.finish_requests(dreq(r), self.p.c.api.RequestStatus.FINISHED_LENGTH_CAPPED)

    def handshake_start(self, w: int) -> None:
        """Decode.tla `handshake_start(w)`: D's proactive handshake with P (heartbeats')."""
        self.hs[w].start(self.p.params[1])

    def handshake_done(self, w: int) -> None:
        """Decode.tla `handshake_done(w)`: the exchange completes; vLLM's callbacks run."""
        self.hs[w].release()

    def handshake_fail(self, w: int) -> None:
        """Decode.tla `handshake_fail(w)`: the exchange raises (the seam's `_nixl_handshake`,
        the network part only); vLLM's callbacks log it and fail each deferred entry."""
        if not self.hs or self.hs[w].state() != "pending":
            raise MissingAction(f"handshake_fail({w}): no handshake pending")
        self.hs[w].fail()

    def xfer_end(self, w: int, r: int, p: int, ok: bool) -> None:
        """The READ of r by D rank w from P rank p ends (NIXL's own completion first)."""
        hd = next((h for h, (rr, pp) in self.handles[w].items() if (rr, pp) == (r, p)
                   and h not in self.results), None)  # fmt: skip
        if hd is None:
            raise MissingAction(f"xfer_end({w}, {r}, {p}): no READ in progress")
        held = self.held[w]
        self.waits.until(lambda: held.real_state(hd) == "DONE", f"the READ of {dreq(r)}")
        held.end(hd, ok)
        self.results[hd] = (w, ok)
        if not ok:  # NIXL delivered its notification anyway: a failed READ sends none
            self._arrived(p, r)

    def deliver(self, p: int, r: int) -> None:
        inbox = self.p.c.inboxes[p]
        inbox.deliver(self._arrived(p, r))
        self.delivered[(p, r)] = self.delivered.get((p, r), 0) + 1
        done = self.p.c.nixl_worker(p)._get_new_notifs()
        if req_id(r) in done:
            self.pst[(p, r)] = "notified"

    def lease_expire(self, p: int, r: int) -> None:
        nw = self.p.c.nixl_worker(p)
        if req_id(r) not in nw._reqs_to_send:
            raise MissingAction(f"lease_expire({p}, {r}): no lease")
        nw._reqs_to_send[req_id(r)] = time.perf_counter() - 1.0
        if req_id(r) in reap_expired(self.p.c.nixl(p), nw):
            self.pst[(p, r)] = "expired"
