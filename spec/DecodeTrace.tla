----------------------------- MODULE DecodeTrace -----------------------------
(***************************************************************************)
(* Trace validation of the decode side (issue #16): is a run recorded from *)
(* a real decode engine (kvspec record) a behaviour of Decode.tla for one  *)
(* design (Bug)?  As KVTrace.tla does for the producer: Log is the         *)
(* recording mapped to spec terms by kvspec.validate_decode; each event is *)
(* explained by one spec action with the observed outcome, or is an        *)
(* observation that changes nothing.  What the recording cannot see        *)
(* happens silently, as often as needed: a READ's end, a notification's    *)
(* delivery, a producer's lease, the LMCache child's store, the NIXL       *)
(* handshake and its failure (observed where HsSeen, below).  The run is  *)
(* a behaviour iff a state with logIdx = Len(Log) is reachable             *)
(* (TraceUnfinished violated).                                             *)
(*                                                                         *)
(* Log records: [a, r, batch, out, fail, reads, recv, w, ok]; a is one of *)
(*  "arrive"   D's Scheduler.add_request(r)                               *)
(*  "schedule" D's Scheduler.schedule: requests it starts running = batch *)
(*  "execute"  every D worker's step: rank w posted the READs reads[w + 1] *)
(*             (<<r, producer rank>>) and its get_transfer_results         *)
(*             reported finished_recving out[w + 1], failed fail[w + 1]    *)
(*             (push, Transfer = "push": no READ; P's WRITEs are silent)   *)
(*  "update"   D's update_from_output: aggregated finished_recving = recv *)
(*  "abort"    D's finish_requests(r, FINISHED_ABORTED)                   *)
(*  "complete" D's request_finished(r) with a stop status                 *)
(*  "hs"       worker w's _nixl_handshake with the producer returned, ok   *)
(*             or raised (the recorder's `handshake`, since 2026-12-05)    *)
(***************************************************************************)
EXTENDS Decode

CONSTANT Log, TraceCap  \* TraceCap: D's pool in requests (kvspec: the recording's)
CONSTANT HsSeen  \* the recording has D's handshakes ("hs"): they end only where it says

VARIABLES logIdx, arrived,
    hsRec  \* worker w's recorded handshake outcome its done_callback has yet to apply

tvars == <<vars, logIdx, arrived, hsRec>>

\* Override Decode's hooks (the cfg says Arrived <- TraceArrived, Busy <- TraceBusy,
\* DCap <- TraceCap): a request schedules once recorded as added; D's steps are the
\* recorded ones (a real D may step for requests that are not P/D ones), so nothing stops
\* the engine; D admits as many as the recorded pool holds.
TraceArrived(r) == r \in arrived
TraceBusy == TRUE

\* What update's aggregation receives this step (Decode's LET, named).
Received == LET m == steps[1]
                cnt(r) == Cardinality({w \in DRanks : r \in m.out[w]})
            IN {r \in Reqs : cnt(r) > 0 /\ cnt(r) >= Remaining(r)}

\* The READs worker w posts in the step it runs now (some may also end in it: InStepEnd).
Posted(w) == {<<x[2], x[3]>> : x \in Fresh(w, steps[StepToRun])}

Match(e) ==
    CASE e.a = "arrive" ->
            /\ arrived' = arrived \cup {e.r}
            /\ UNCHANGED vars
      [] e.a = "schedule" ->
            /\ schedule
            /\ {r \in Reqs : st'[r] = "running" /\ st[r] # "running"} = e.batch
            /\ UNCHANGED arrived
      [] e.a = "execute" ->
            /\ execute
            /\ \A w \in DRanks : /\ steps'[StepToRun].out[w] = e.out[w + 1]
                                 /\ steps'[StepToRun].fail[w] = e.fail[w + 1]
                                 /\ Posted(w) = e.reads[w + 1]
            /\ UNCHANGED arrived
      [] e.a = "update" ->
            /\ Len(steps) > 0 /\ steps[1].ran
            /\ Received = e.recv
            /\ update
            /\ UNCHANGED arrived
      [] e.a = "abort" ->
            \* finish_requests on a request no longer active is a no-op
            /\ \/ abort(e.r)
               \/ st[e.r] \notin {"new", "wfrk", "running"} /\ UNCHANGED vars
            /\ UNCHANGED arrived
      [] e.a = "complete" ->
            /\ complete(e.r)
            /\ UNCHANGED arrived

(* The recorder stamps `handshake` as _nixl_handshake returns, on the      *)
(* handshake thread (BW:1291-1301): before the future's done_callback      *)
(* registers the agents or logs the failure and before each deferred       *)
(* entry's request_ready (BW:1304-1360), which Decode.tla's handshake_done *)
(* and handshake_fail are.  So the handshake is pending at the event, and  *)
(* its outcome is applied, silently, at or after it: not before (a READ    *)
(* posted before D's handshake returned is no behaviour) and not the other *)
(* outcome.  A D idle past engine_ttl (3600 s) re-handshakes after an      *)
(* eviction (BW:3540-3569), which Decode.tla does not model: such a second *)
(* "hs" finds the handshake done and is unexplained.                       *)
MatchHs(e) ==
    /\ HsSeen /\ hsd[e.w] = "pending" /\ hsRec[e.w] = "none"
    /\ hsRec' = [hsRec EXCEPT ![e.w] = IF e.ok THEN "ok" ELSE "err"]
    /\ UNCHANGED <<vars, arrived>>

\* The handshake's outcome, applied by its done_callback: where HsSeen, the recorded one.
HsApplied(w, out) ==
    IF HsSeen THEN /\ hsRec[w] = out /\ hsRec' = [hsRec EXCEPT ![w] = "none"]
    ELSE UNCHANGED hsRec

\* Actions the recording does not see.
Silent ==
    \/ ReadEnd /\ UNCHANGED hsRec
    \/ \E w \in DRanks : handshake_start(w) /\ UNCHANGED hsRec
    \/ \E w \in DRanks : handshake_done(w) /\ HsApplied(w, "ok")
    \/ \E w \in DRanks : handshake_fail(w) /\ HsApplied(w, "err")
    \/ \E w \in DRanks : \E e \in cbq[w] : handshake_callback(w, e) /\ UNCHANGED hsRec
    \/ (\E p \in PRanks, r \in Reqs : deliver(p, r) \/ lease_expire(p, r))
       /\ UNCHANGED hsRec
    \/ \E r \in Reqs : child_send_done(r) /\ UNCHANGED hsRec
    \* push (Transfer = "push"): P's writer matching D's registration, or its handshake
    \* with D failing; the WRITE's end is ReadEnd's xfer_end
    \/ (PushMatch \/ \E w \in DRanks, r \in Reqs, p \in PRanks : push_lost(w, r, p))
       /\ UNCHANGED hsRec

TraceInit == Init /\ logIdx = 0 /\ arrived = {} /\ hsRec = [w \in DRanks |-> "none"]

TraceNext ==
    \/ /\ logIdx < Len(Log)
       /\ IF Log[logIdx + 1].a = "hs" THEN MatchHs(Log[logIdx + 1])
          ELSE Match(Log[logIdx + 1]) /\ UNCHANGED hsRec
       /\ logIdx' = logIdx + 1
    \/ /\ Silent
       /\ UNCHANGED <<logIdx, arrived>>

TraceSpec == TraceInit /\ [][TraceNext]_tvars

\* Violated iff the whole log is explained (kvspec.validate_decode reads it that way round).
TraceUnfinished == logIdx < Len(Log)

=============================================================================
