------------------------------ MODULE ClockTrace ------------------------------
(***************************************************************************)
(* Trace validation against KVClock (issues #13, #16): is a run recorded   *)
(* from real engines (kvspec record) a behaviour of the producer engine    *)
(* against the lease clock, heartbeats included?  As KVTrace does for      *)
(* KVCompletion, each logged event is explained by one KVClock action with *)
(* the observed parameters; what the recording cannot see happens silently *)
(* (a READ landing, its notification reaching P, the handshake completing, *)
(* HF3FS stores).  New here: every event carries the tick it happened in   *)
(* (its monotonic time in ticks of kv_lease_duration / 6 since the first   *)
(* event), and the clock is a variable: an event is explained only while   *)
(* the number of ticks taken is within Slack of its own tick.  So a lease  *)
(* that expired (no heartbeat within the lease) must be reaped at P's next *)
(* step, and a free by the reaper before the lease ran out has no          *)
(* explanation.                                                            *)
(*                                                                         *)
(* Log records: [a, r, w, t, batch, out, freed, fin, swallow, lost,       *)
(* names]; a is                                                            *)
(*  "arrive", "schedule", "execute", "update", "abort", "read", "coread": *)
(*             as KVTrace                                                  *)
(*  "add"      D's Scheduler.add_request of r (on_new_request)             *)
(*  "recv"     D's scheduler processed r's finished_recving                *)
(*  "abandon"  D's scheduler processed r's failed receive, no READ posted  *)
(*             (a failed handshake): D stops heartbeating r                *)
(*  "finish"   D's request_finished of r before its receive was processed  *)
(*             (an abort; another D rank's failure): heartbeats stop       *)
(*  "fail"     D's scheduler processed r's failed receive of a READ it     *)
(*             posted (the READ failed, silently, while P lived; or D had  *)
(*             finished r and another D rank failed)                       *)
(*  "write"    push: producer rank w's writer thread posted r's WRITE      *)
(*             (KVClock's push_write: D's registration was there, P still    *)
(*             held r's blocks; or push_deferred: the writer re-drove r,    *)
(*             parked on rank w's handshake with D, lease reaped or not);   *)
(*             the WRITE ending is silent                                   *)
(*  "phs"      push: producer rank w's handshake with D succeeded (KVClock's *)
(*             push_handshake_done); the writer's match of D's registration *)
(*             that parked r on it (push_match) is silent                   *)
(*  "hs"       D's handshake with the producer succeeded (the first to)    *)
(*  "hb"       a heartbeat naming the requests in `names` (D's tracked     *)
(*             ones): swallowed by the pending handshake, or sent and lost  *)
(*             at the producer ranks in `lost` (no _handle_heartbeat)       *)
(* The run is a behaviour iff a state with logIdx = Len(Log) is reachable: *)
(* TraceUnfinished is then violated.                                       *)
(***************************************************************************)
EXTENDS KVClock

CONSTANTS
    Log,
    Slack,    \* ticks an event may be placed from its recorded tick (its place
              \* inside the tick, and the processes' reports, are not modelled)
    MaxNow,   \* the last recorded tick + Slack: the clock stops there
    HbSeen,   \* the recording has heartbeat events (else heartbeats are silent)
    HsSeen,   \* the recording has D's handshakes (else the handshake ends silently)
    PHsSeen,  \* push: the recording has P's handshakes with D (else they end silently)
    SubTick   \* deadlines fall inside ticks (kvspec: TRUE; FALSE only as a control)

\* Named logIdx, not i: TLC resolves the bound i of KVCompletion's StepToRun to a
\* state variable of that name.
VARIABLES logIdx, arrived, now

tvars == <<vars, logIdx, arrived, now>>

\* Replaces KVCompletion's Arrived (the cfg says Arrived <- [KVCompletion] TraceArrived).
TraceArrived(r) == r \in arrived

\* What update_from_output's aggregation emits this step (KVCompletion's LET, named).
Emitted == LET m == steps[1]
               cnt(r) == Cardinality({w \in Ranks : r \in m.out[w]})
           IN {r \in Reqs : cnt(r) > 0 /\ cnt(r) >= K!Remaining(r)}

Finishing == {r \in steps[1].batch : req[r] = "running"}

OnTime(e) == e.t <= now + Slack /\ now <= e.t + Slack

Match(e) ==
    CASE e.a = "arrive" ->
            /\ arrived' = arrived \cup {e.r}
            /\ UNCHANGED vars
      [] e.a = "schedule" ->
            /\ schedule
            /\ steps'[Len(steps')].batch = e.batch
            /\ UNCHANGED arrived
      [] e.a = "execute" ->
            /\ \E k \in 1 .. Len(steps) : ~steps[k].ran
            /\ execute_model
            /\ \A w \in Ranks : steps'[K!StepToRun].out[w] = e.out[w + 1]
            /\ UNCHANGED arrived
      [] e.a = "update" ->
            /\ Len(steps) > 0 /\ steps[1].ran
            /\ Emitted = e.freed
            /\ Finishing = e.fin
            /\ update_from_output
            /\ UNCHANGED arrived
      [] e.a = "abort" ->
            /\ \/ abort(e.r)
               \/ req[e.r] \notin {"waiting", "running"} /\ UNCHANGED vars
            /\ UNCHANGED arrived
      [] e.a = "add" ->
            /\ consumer_add_request(e.r)
            /\ UNCHANGED arrived
      [] e.a = "read" ->
            /\ consumer_start_load_kv(e.r, e.w)
            /\ UNCHANGED arrived
      [] e.a = "coread" ->
            \* another D rank's READ of r from w (D TP > P TP): as KVTrace's
            /\ rd[e.r][e.w] = "inflight"
            /\ UNCHANGED <<vars, arrived, now>>
      [] e.a = "write" ->
            \* (push_deferred posts, unless the proposed fix drops r: that is silent)
            /\ \/ push_write(e.r, e.w)
               \/ push_deferred(e.r, e.w) /\ Posts(e.r, e.w)
            /\ UNCHANGED arrived
      [] e.a = "phs" ->
            /\ push_handshake_done(e.w)
            /\ UNCHANGED arrived
      [] e.a = "recv" ->
            /\ consumer_update(e.r)
            /\ UNCHANGED arrived
      [] e.a = "abandon" ->
            /\ abandon(e.r)
            /\ UNCHANGED arrived
      [] e.a = "finish" ->
            /\ consumer_finish(e.r)
            /\ UNCHANGED arrived
      [] e.a = "fail" ->
            /\ consumer_fail(e.r)
            /\ UNCHANGED arrived
      [] e.a = "hs" ->
            /\ handshake_done
            /\ UNCHANGED arrived
      [] e.a = "hb" ->
            \* the requests it names are those D tracks: D's heartbeat_by_engine, from
            \* on_new_request to request_finished or the processed finished_recving
            \* (base_scheduler.py:199-248, 521-525; pull_scheduler.py:215-217)
            /\ e.names = Tracked
            /\ HbDue
            /\ IF e.swallow THEN HbSwallowed ELSE HbSent(e.lost)
            /\ UNCHANGED arrived

\* A tick once nothing is live: KVClock's clock stops (its state space is finite),
\* the recording's does not; nothing timed is left, so nothing changes.
IdleTick ==
    /\ \A r \in Reqs : req[r] = "freed" /\ r \notin Tracked
    /\ UNCHANGED vars

(* Deadlines inside a tick.  KVClock's deadlines are tick-aligned: every   *)
(* lease whose TTL reaches 0 at a tick is expired for the next reaper.  A  *)
(* real deadline falls anywhere inside that tick, so P's steps in it may   *)
(* reap some of those leases and not yet the others (recorded:             *)
(* pd-handshake-fail, two leases stamped 1 ms apart reaped in two P steps  *)
(* 3 ms apart).  Here a lease whose TTL reached 0 expires at some point of *)
(* the tick (deadline_passes), and by the next tick it has (the cfg says   *)
(* ExpiresAtTick <- TraceExpiresAtTick).                                   *)
TraceExpiresAtTick(w, r) == ttl[w][r] = 0
deadline_passes(w, r) ==
    /\ r \in lease[w] \ expired[w] /\ ttl[w][r] = 0
    /\ expired' = [expired EXCEPT ![w] = @ \cup {r}]
    /\ UNCHANGED <<req, needSend, notProc, finReqs, steps, toProcess, lease, notif, replQ,
                   extra, store, stored, pend, unsub, jobs, fence, rd, hb, agg, emits,
                   lateFinish, clobbered, published, cvars>>

\* Actions the recording does not see.
Silent ==
    \/ \E r \in Reqs, w \in Ranks :
          \/ consumer_read_done(r, w) \/ consumer_get_finished(r, w) \/ store_complete(r, w)
          \/ consumer_read_fails(r, w) \/ push_write_done(r, w)
    \/ \E w \in Ranks : writer_poll(w)
    \/ \E r \in Reqs, w \in Ranks :
          \/ push_match(r, w)
          \/ push_deferred(r, w) /\ ~Posts(r, w)  \* the fix dropped it: no WRITE posted
    \/ ~PHsSeen /\ \E w \in Ranks : push_handshake_done(w)
    \/ ~HsSeen /\ handshake_done
    \/ ~HbSeen /\ heartbeat
    \/ SubTick /\ \E w \in Ranks, r \in Reqs : deadline_passes(w, r)

TraceInit == Init /\ logIdx = 0 /\ arrived = {} /\ now = 0

TraceNext ==
    \/ /\ logIdx < Len(Log)
       /\ OnTime(Log[logIdx + 1])
       /\ Match(Log[logIdx + 1])
       /\ logIdx' = logIdx + 1
       /\ UNCHANGED now
    \/ /\ Silent
       /\ UNCHANGED <<logIdx, arrived, now>>
    \/ /\ now < MaxNow
       /\ tick \/ IdleTick
       /\ now' = now + 1
       /\ UNCHANGED <<logIdx, arrived>>

TraceSpec == TraceInit /\ [][TraceNext]_tvars

\* Violated iff the whole log is explained (kvspec.validate_clock reads it that way round).
TraceUnfinished == logIdx < Len(Log)

\* Violated iff some explanation of the whole log frees a request before D's READs of it
\* landed (#21570): checked once the run is admitted.
RunKeepsReadsSafe == logIdx = Len(Log) => NoFreeUnderRead

\* Push: violated iff some explanation of the whole log posts a WRITE from blocks P had
\* freed (a WRITE parked on P's handshake with D, re-driven after the free).
RunWritesNoFreed == logIdx = Len(Log) => NoWriteFromFreed
=============================================================================
