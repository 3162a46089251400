------------------------------ MODULE KVTrace ------------------------------
(***************************************************************************)
(* Trace validation (as CCF's and etcd's): is a run recorded from real     *)
(* engines (kvspec record) a behaviour of KVCompletion for one design?     *)
(* Log is the recording mapped to spec terms by kvspec.validate; each     *)
(* event is explained by exactly one spec action with the observed        *)
(* parameters and outcomes, or is an observation that changes nothing.     *)
(* What the recording cannot see happens silently, as often as needed:    *)
(* READ completion and its notification, a push WRITE's completion,       *)
(* heartbeats, lease expiry, store completion.  The run is a behaviour iff *)
(* a state with logIdx = Len(Log) is reachable: TraceUnfinished is then    *)
(* violated, and its counterexample is the behaviour.  Otherwise the       *)
(* largest logIdx reached names the first event no spec step explains.     *)
(*                                                                         *)
(* Log records: [a, r, w, batch, out, freed, fin]; a is one of            *)
(*  "arrive"   Scheduler.add_request(r)                                   *)
(*  "schedule" Scheduler.schedule: newly scheduled requests = batch        *)
(*  "execute"  every rank's get_transfer_results for the oldest step not  *)
(*             run: rank w reported finished_sending = out[w + 1]          *)
(*  "update"   Scheduler.update_from_output: aggregated finished_sending  *)
(*             = freed; requests request_finished as done = fin            *)
(*  "abort"    Scheduler.finish_requests(r, FINISHED_ABORTED)             *)
(*  "read"     the decode worker posts a READ of r from producer rank w   *)
(*  "coread"   another D rank posts its READ of r from producer rank w    *)
(*             (D TP > P TP: each D rank READs its KV heads; see Match)    *)
(*  "recv"     the decode worker reports r in finished_recving (READ      *)
(*             posted: see Match)                                          *)
(*  "write"    push: producer rank w's writer thread posts r's WRITE       *)
(*             (push_worker.py _xfer_blocks): push_write, or push_deferred *)
(*             after a silent push_match; silent where no write is        *)
(*             recorded                                                    *)
(***************************************************************************)
EXTENDS KVCompletion

CONSTANT Log

\* Named logIdx, not i: TLC resolves the bound i of KVCompletion's StepToRun to a
\* state variable of that name.
VARIABLES logIdx, arrived

tvars == <<vars, logIdx, arrived>>

\* Overrides KVCompletion's Arrived (the cfg says Arrived <- TraceArrived).
TraceArrived(r) == r \in arrived

\* What update_from_output's aggregation emits this step (KVCompletion's LET, named).
Emitted == LET m == steps[1]
               cnt(r) == Cardinality({w \in Ranks : r \in m.out[w]})
           IN {r \in Reqs : cnt(r) > 0 /\ cnt(r) >= Remaining(r)}

Finishing == {r \in steps[1].batch : req[r] = "running"}

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
            /\ \A w \in Ranks : steps'[StepToRun].out[w] = e.out[w + 1]
            /\ UNCHANGED arrived
      [] e.a = "update" ->
            /\ Len(steps) > 0 /\ steps[1].ran
            /\ Emitted = e.freed
            /\ Finishing = e.fin
            /\ update_from_output
            /\ UNCHANGED arrived
      [] e.a = "abort" ->
            \* finish_requests on a request already finished is a no-op (#25067)
            /\ \/ abort(e.r)
               \/ req[e.r] \notin {"waiting", "running"} /\ UNCHANGED vars
            /\ UNCHANGED arrived
      [] e.a = "read" ->
            /\ consumer_start_load_kv(e.r, e.w)
            /\ UNCHANGED arrived
      [] e.a = "coread" ->
            \* D TP > P TP: every D rank READs its heads of r from rank w, and w frees r
            \* at the last of their "r:n" (pull_worker.py _get_new_notifs).  KVCompletion
            \* has one READ per (r, w) whose notification stands for the last, so a
            \* sibling READ must be posted while that READ is in flight: one posted after
            \* it (P may have freed r: #56033's count) is explained by no step.
            /\ rd[e.r][e.w] = "inflight"
            /\ UNCHANGED <<vars, arrived>>
      [] e.a = "write" ->
            \* posted at the match (P's handshake with D done) or, the first on a rank,
            \* once the lazy handshake ended (push_deferred; the match is silent)
            /\ push_write(e.r, e.w) \/ push_deferred(e.r, e.w)
            /\ UNCHANGED arrived
      [] e.a = "recv" ->
            \* KVCompletion's consumer_get_finished is the READ's completion and its
            \* notification reaching the producer rank, fused.  A real decode worker
            \* reports the READ done before the producer's agent has the notification
            \* (recorded: 1.1 s apart in conformance/recorded/pd-basic), so this
            \* observation only says the READ was posted.
            \* (push: a WRITE parked on P's handshake with D is not posted yet)
            /\ \E w \in Ranks : rd[e.r][w] \in {"inflight", "done"}
            /\ UNCHANGED <<vars, arrived>>

\* The recording has the producer's WRITEs (push, recorded since 2026-12-05): a WRITE is
\* posted only where the log says.
WritesSeen == \E k \in 1 .. Len(Log) : Log[k].a = "write"

\* Actions the recording does not see.
Silent ==
    \/ \E r \in Reqs, w \in Ranks : consumer_get_finished(r, w)
    \/ ~WritesSeen /\ \E r \in Reqs, w \in Ranks : push_write(r, w) \/ push_deferred(r, w)
    \/ \E r \in Reqs, w \in Ranks : push_match(r, w)
    \/ \E r \in Reqs, w \in Ranks : push_write_done(r, w)
    \/ \E r \in Reqs : heartbeat(r)
    \/ \E r \in Reqs, w \in Ranks : lease_expire(r, w)
    \/ \E r \in Reqs, w \in Ranks : store_complete(r, w)

TraceInit == Init /\ logIdx = 0 /\ arrived = {}

TraceNext ==
    \/ /\ logIdx < Len(Log)
       /\ Match(Log[logIdx + 1])
       /\ logIdx' = logIdx + 1
    \/ /\ Silent
       /\ UNCHANGED <<logIdx, arrived>>

TraceSpec == TraceInit /\ [][TraceNext]_tvars

\* Violated iff the whole log is explained (kvspec.validate reads it that way round).
TraceUnfinished == logIdx < Len(Log)

=============================================================================
