"""The spec as Python: spec/KVCompletion.tla's state, its nine actions, successors and the
reachable graph (kvspec.codec converts states to TLC/ITF values and back).

Why a Python copy of the spec: trace generation, replay and counterexample labelling need a
successor function with action parameters (TLC's dot dump labels edges with the operator
name only), and a machine without Java (a GPU runner) must still generate traces. Its graph
equals TLC's edge for edge (test_reference_graph.py, `kvspec traces --tlc`).

Each action is one function named after its TLA+ operator, taking the row's definitions
(`Defs`), a `State` and the action's parameters, returning the successor or None when the
guard is false; `ACTION_FNS` is the name -> function table. States are frozen and hashable
(fast to explore).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvspec.children import ChildStep, hf3fs_step, offload_step
from kvspec.defs import (
    HF3FS,
    Defs,
    RankStepFn,
    expected_count,
    pipeline_depth,
    rank_mode,
    read_sources,
)
from kvspec.matrix import ModelRow
from kvspec.vocab import (
    ACTIONS,
    DELAYED,
    EMPTY,
    HOLDING,
    VARIABLES,
    Action,
    PerRank,
    RankResult,
    Reqs,
    State,
    Step,
)

# Re-exported: the model is where callers look for the spec's vocabulary and definitions.
__all__ = [
    "ACTIONS", "ACTION_FNS", "DELAYED", "EMPTY", "HF3FS", "HOLDING", "VARIABLES", "Action",
    "Defs", "Model", "PerRank", "RankResult", "RankStepFn", "Reqs", "State", "Step",
    "after_reports", "all_actions", "expected_count", "initial_state", "pipeline_depth",
    "rank_mode", "rank_step", "read_sources", "reachable",
]  # fmt: skip


# ---------------------------------------------------------------- helpers


def _set_at(t: PerRank, w: int, v: Reqs) -> PerRank:
    return t[:w] + (v,) + t[w + 1 :]


def _set_rd(s: State, r: int, w: int, v: str) -> tuple[tuple[str, ...], ...]:
    row = s.rd[r - 1]
    return s.rd[: r - 1] + (row[:w] + (v,) + row[w + 1 :],) + s.rd[r:]


def _holding(s: State) -> int:
    return sum(1 for x in s.req if x in HOLDING)


def initial_state(row: ModelRow) -> State:
    """Init."""
    d = Defs.of(row)
    none: PerRank = (EMPTY,) * d.w
    return State(
        req=("waiting",) * row.requests, needSend=EMPTY, notProc=EMPTY, finReqs=EMPTY,
        steps=(), toProcess=none, lease=none, expired=none, notif=none, replQ=none,
        extra=none, store=none, stored=none, pend=none, unsub=none,
        jobs=(0,) * row.requests, fence=EMPTY,
        rd=(("none",) * d.w,) * row.requests, hb=EMPTY,
        agg=(0,) * row.requests, emits=(0,) * row.requests, lateFinish=False,
        clobbered=False, published=frozenset(w for w in d.ranks if d.modes[w] == "serve"),
    )  # fmt: skip


# ---------------------------------------------------------------- actions


def schedule(d: Defs, s: State) -> State | None:
    """schedule: Scheduler.schedule + build_connector_meta."""
    if s.lateFinish or len(s.steps) >= d.depth:
        return None
    # has_requests(), or the offloading child's has_pending_push_work (jobs in flight)
    if all(x == "freed" for x in s.req) and not any(s.jobs):
        return None
    free = d.row.capacity - _holding(s)
    waiting = [r for r in d.reqs if s.req[r - 1] == "waiting"]  # ascending id: FCFS
    admit = frozenset(waiting[: max(free, 0)])
    req = tuple("running" if r in admit else s.req[r - 1] for r in d.reqs)
    jobs, reused, flush = EMPTY, EMPTY, EMPTY
    if d.offload:
        jobs = admit
        if admit:
            reused = frozenset(r for r in d.reqs if s.req[r - 1] == "freed" and s.jobs[r - 1])
        flush = reused & s.fence
    none: PerRank = (EMPTY,) * d.w
    step = Step(admit, s.needSend, s.notProc, s.finReqs, jobs, flush, reused, False, none, none)
    return replace(
        s,
        req=req,
        steps=(*s.steps, step),
        needSend=EMPTY,
        notProc=EMPTY,
        finReqs=EMPTY,
        jobs=tuple(d.w if r in jobs else s.jobs[r - 1] for r in d.reqs),
    )


def rank_step(d: Defs, s: State, w: int, m: Step) -> RankResult:
    """RankStep(w, m): one worker connector running step metadata m."""
    mode = d.modes[w]
    ex0 = s.extra[w] | m.toSend if d.delaying else s.extra[w]
    tp1 = (s.toProcess[w] | m.batch) - m.notProc if mode == "serve" else s.toProcess[w]
    ls1 = s.lease[w] | (m.toSend & tp1) if mode == "serve" else s.lease[w]
    queues = mode in ("queue", "queue-cleared")
    rq1 = s.replQ[w] | m.toSend if queues else s.replQ[w]
    known = s.notif[w] & (ls1 | tp1)
    tp2 = tp1 - known
    ls2 = ls1 - known
    reaped = _reap(d, s.expired[w], ls2)
    if mode == "serve":
        nixl_done = known | reaped
    elif mode == "queue":
        nixl_done = rq1
    else:
        nixl_done = EMPTY
    child: ChildStep = (hf3fs_step if d.delaying else offload_step)(d, s, w, m)
    off_done = child.reported
    both = nixl_done & off_done
    one = (nixl_done | off_done) - both
    return RankResult(
        toProcess=tp2 - reaped,
        lease=ls2 - reaped,
        expired=s.expired[w] & (ls2 - reaped),
        replQ=EMPTY if queues else rq1,
        extra=ex0 - (nixl_done | off_done),
        store=child.store,
        stored=child.stored,
        pend=child.pend,
        unsub=child.unsub,
        clobbered=child.clobbered,
        out=both | (one - ex0) if d.multi else nixl_done,
        ack=child.ack,
    )


def _reap(d: Defs, expired: Reqs, leases: Reqs) -> Reqs:
    """Reaped: the expired leases _reap_expired_send_leases releases. Full scan: all of
    them; early break (0.29/0.30): those before the first live lease in _reqs_to_send's
    order, which is request-id order (leases are installed as requests finish, FCFS)."""
    if not d.early_break:
        return expired & leases
    live = leases - expired
    head = min(live) if live else None
    return frozenset(r for r in expired & leases if head is None or r < head)


def step_to_run(s: State) -> int | None:
    """StepToRun: the oldest step not executed yet (0-based), None if all ran."""
    for i, st in enumerate(s.steps):
        if not st.ran:
            return i
    return None


def execute_model(d: Defs, s: State) -> State | None:
    """execute_model: every worker runs RankStep on the oldest unexecuted step."""
    i = step_to_run(s)
    if s.lateFinish or i is None:
        return None
    m = s.steps[i]
    new = [d.rank_step(d, s, w, m) for w in d.ranks]
    ran = replace(m, ran=True, out=tuple(n.out for n in new), ack=tuple(n.ack for n in new))
    none: PerRank = (EMPTY,) * d.w
    return replace(
        s,
        toProcess=tuple(n.toProcess for n in new),
        lease=tuple(n.lease for n in new),
        expired=tuple(n.expired for n in new),
        replQ=tuple(n.replQ for n in new),
        extra=tuple(n.extra for n in new),
        store=tuple(n.store for n in new),
        stored=tuple(n.stored for n in new),
        pend=tuple(n.pend for n in new),
        unsub=tuple(n.unsub for n in new),
        clobbered=s.clobbered or any(n.clobbered for n in new),
        steps=s.steps[:i] + (ran,) + s.steps[i + 1 :],
        notif=none,
    )


def after_reports(expected: int, agg: int, c: int) -> int:
    """AfterReports: the aggregator's remaining count after c reports (0 = no entry)."""
    remaining = expected if agg == 0 else agg
    if c == 0:
        return agg
    if c < remaining:
        return remaining - c
    k = (c - remaining) % expected
    return 0 if k == 0 else expected - k


def update_from_output(d: Defs, s: State) -> State | None:
    """update_from_output: KVOutputAggregator.aggregate + Scheduler.update_from_output."""
    if s.lateFinish or not s.steps or not s.steps[0].ran:
        return None
    exp = d.expected
    m = s.steps[0]
    cnt = {r: sum(1 for w in d.ranks if r in m.out[w]) for r in d.reqs}
    emitted = {
        r for r in d.reqs if cnt[r] > 0 and cnt[r] >= (exp if s.agg[r - 1] == 0 else s.agg[r - 1])
    }
    finishing = frozenset(r for r in m.batch if s.req[r - 1] == "running")
    req1 = tuple("sending" if r in finishing else s.req[r - 1] for r in d.reqs)
    # update_connector_output: each completed_jobs ack lowers the job's pending_count; a
    # job at 0 drops its fences. request_finished fences the finishing requests' jobs.
    acks = {r: sum(1 for w in d.ranks if r in m.ack[w]) for r in d.reqs}
    jobs = tuple(s.jobs[r - 1] - acks[r] for r in d.reqs)
    fence = frozenset(r for r in s.fence | finishing if jobs[r - 1] > 0) if d.offload else s.fence
    return replace(
        s,
        agg=tuple(after_reports(exp, s.agg[r - 1], cnt[r]) for r in d.reqs),
        emits=tuple(
            e + 1 if r in emitted and e < 2 else e for r, e in zip(d.reqs, s.emits, strict=True)
        ),
        req=tuple(
            "freed" if r in emitted and req1[r - 1] in DELAYED else req1[r - 1] for r in d.reqs
        ),
        lateFinish=any(req1[r - 1] not in DELAYED for r in emitted),
        needSend=s.needSend | finishing,
        finReqs=s.finReqs | finishing if d.delaying else s.finReqs,
        jobs=jobs,
        fence=fence,
        steps=s.steps[1:],
    )


def abort(d: Defs, s: State, r: int) -> State | None:
    """abort(r): Scheduler.finish_requests(FINISHED_ABORTED) of a waiting/running request;
    freed at once unless the HF3FS child delays it (request_finished returns True)."""
    if s.lateFinish or s.req[r - 1] not in ("waiting", "running"):
        return None
    if not d.delaying:
        new = "freed"
    else:
        new = "aborted-held" if s.req[r - 1] == "running" else "aborted-empty"
    req = s.req[: r - 1] + (new,) + s.req[r:]
    fin = s.finReqs | {r} if d.delaying else s.finReqs
    # The offloading child's request_finished fences r's pending store job.
    fence = s.fence | {r} if d.offload and s.jobs[r - 1] else s.fence
    return replace(s, req=req, notProc=s.notProc | {r}, finReqs=fin, fence=fence)


def consumer_start_load_kv(d: Defs, s: State, r: int, w: int) -> State | None:
    """consumer_start_load_kv(r, w): the decode side's READ of r from producer rank w."""
    if (
        d.push
        or s.req[r - 1] != "sending"
        or w not in d.read_sources
        or s.rd[r - 1][w] != "none"
        or r not in s.toProcess[w]
        or (d.guarded and r in s.expired[w])  # LiveFor(r, w)
    ):
        return None
    return replace(s, rd=_set_rd(s, r, w, "inflight"))


def consumer_get_finished(d: Defs, s: State, r: int, w: int) -> State | None:
    """consumer_get_finished(r, w): the READ completed; "r:1" is delivered to rank w."""
    if d.push or s.rd[r - 1][w] != "inflight":
        return None
    return _transfer_done(s, r, w)


def _transfer_done(s: State, r: int, w: int) -> State:
    return replace(s, rd=_set_rd(s, r, w, "done"), notif=_set_at(s.notif, w, s.notif[w] | {r}))


def _push_writable(d: Defs, s: State, r: int, w: int) -> bool:
    """PushWritable(r, w): D's registration and r's shipped blocks meet at rank w."""
    return (
        d.push
        and s.req[r - 1] == "sending"
        and w in d.read_sources
        and s.rd[r - 1][w] == "none"
        and r in s.lease[w]
        and not (d.guarded and r in s.expired[w])  # LiveFor(r, w)
    )


def _phs_done(s: State, w: int) -> bool:
    """PHsDone(w): rank w's lazy handshake with D is done once it posted a WRITE."""
    return any(rd[w] in ("inflight", "done") for rd in s.rd)


def push_write(d: Defs, s: State, r: int, w: int) -> State | None:
    """push_write(r, w): rank w's writer matches D's registration and WRITEs r at once
    (_do_start_push_kv with the handshake done)."""
    if not _push_writable(d, s, r, w) or not _phs_done(s, w):
        return None
    return replace(s, rd=_set_rd(s, r, w, "inflight"))


def push_match(d: Defs, s: State, r: int, w: int) -> State | None:
    """push_match(r, w): the writer matches r while its handshake with D is pending and
    parks the WRITE in _on_handshake (push_worker.py:457-481)."""
    if not _push_writable(d, s, r, w) or _phs_done(s, w):
        return None
    return replace(s, rd=_set_rd(s, r, w, "parked"))


def push_deferred(d: Defs, s: State, r: int, w: int) -> State | None:
    """push_deferred(r, w): the handshake is done; the writer drains r from
    _deferred_push_inbox and WRITEs it (247-252), freed or not (guarded: lease live)."""
    if s.rd[r - 1][w] != "parked" or (
        d.guarded and (r not in s.lease[w] or r in s.expired[w])
    ):
        return None
    return replace(s, rd=_set_rd(s, r, w, "inflight"))


def push_write_done(d: Defs, s: State, r: int, w: int) -> State | None:
    """push_write_done(r, w): r's WRITE handles on rank w are done (_pop_done_transfers)."""
    if not d.push or s.rd[r - 1][w] != "inflight":
        return None
    return _transfer_done(s, r, w)


def heartbeat(d: Defs, s: State, r: int) -> State | None:
    """heartbeat(r): the decode side's "HB:r" extends r's lease on every rank."""
    if s.req[r - 1] != "sending" or r in s.hb or any(x != "none" for x in s.rd[r - 1]):
        return None
    return replace(s, hb=s.hb | {r}, expired=tuple(x - {r} for x in s.expired))


def lease_expire(d: Defs, s: State, r: int, w: int) -> State | None:
    """lease_expire(r, w): kv_lease_duration passes for r on rank w (guarded: no READ or
    WRITE of r on w in flight)."""
    if r not in s.lease[w] or r in s.expired[w] or (d.guarded and s.rd[r - 1][w] == "inflight"):
        return None
    return replace(s, expired=_set_at(s.expired, w, s.expired[w] | {r}))


def store_complete(d: Defs, s: State, r: int, w: int) -> State | None:
    """store_complete(r, w): the child's store of r on rank w completes (an HF3FS save
    future, or an offloading store job submitted to the OffloadingWorker)."""
    if r not in s.store[w]:
        return None
    return replace(
        s,
        store=_set_at(s.store, w, s.store[w] - {r}),
        stored=_set_at(s.stored, w, s.stored[w] | {r}),
    )


ActionFn = Callable[..., State | None]
ACTION_FNS: dict[str, ActionFn] = {
    "schedule": schedule,
    "execute_model": execute_model,
    "update_from_output": update_from_output,
    "abort": abort,
    "consumer_start_load_kv": consumer_start_load_kv,
    "consumer_get_finished": consumer_get_finished,
    "push_write": push_write,
    "push_match": push_match,
    "push_deferred": push_deferred,
    "push_write_done": push_write_done,
    "heartbeat": heartbeat,
    "lease_expire": lease_expire,
    "store_complete": store_complete,
}
assert ACTION_FNS.keys() == ACTIONS.keys()


def all_actions(row: ModelRow) -> list[Action]:
    """Every action instance of Next for this row, sorted (the order of `enabled()`)."""
    reqs = range(1, row.requests + 1)
    out: list[Action] = []
    for name, params in ACTIONS.items():
        if params == ():
            out.append(Action(name))
        elif params == ("r",):
            out += [Action(name, r) for r in reqs]
        else:
            out += [Action(name, r, w) for r in reqs for w in range(row.topology.world_size)]
    return sorted(out)


class Model:
    """The transition function of one row: Next as a list of action instances."""

    def __init__(self, row: ModelRow, defs: Defs | None = None) -> None:
        self.row = row
        self.d = defs or Defs.of(row)
        self.actions = all_actions(row)

    def apply(self, s: State, a: Action) -> State | None:
        """The successor of s under a, or None if a's guard is false."""
        return ACTION_FNS[a.name](self.d, s, *a.args)

    def successors(self, s: State) -> list[tuple[Action, State]]:
        out: list[tuple[Action, State]] = []
        for a in self.actions:
            t = self.apply(s, a)
            if t is not None:
                out.append((a, t))
        return out

    def label_path(
        self, states: Sequence[State], names: Sequence[str | None] | None = None
    ) -> list[Action]:
        """The action instance of each step of a state path. The one source of a
        counterexample's action parameters: TLC prints only the operator name (pass it in
        `names`, one per step, None where unknown); the first instance in sorted order of
        that name leading from one state to the next is the step. Raises ValueError at a
        step no action explains."""
        out: list[Action] = []
        for i, (s, t) in enumerate(zip(states, states[1:], strict=False), 1):
            name = names[i - 1] if names is not None and i - 1 < len(names) else None
            hit = next(
                (a for a in self.actions
                 if (name is None or a.name == name) and self.apply(s, a) == t),
                None,
            )  # fmt: skip
            if hit is None:
                raise ValueError(f"step {i} ({name or '?'}) matches no spec action")
            out.append(hit)
        return out


def reachable(
    row: ModelRow, cap: int | None = None, model: Model | None = None
) -> tuple[list[State], list[tuple[State, Action, State]]] | None:
    """BFS over the reachable graph: (states in BFS order, edges); None if over `cap` states."""
    m = model or Model(row)
    init = initial_state(row)
    order = [init]
    seen = {init}
    edges: list[tuple[State, Action, State]] = []
    i = 0
    while i < len(order):
        s = order[i]
        i += 1
        for a, t in m.successors(s):
            edges.append((s, a, t))
            if t not in seen:
                seen.add(t)
                order.append(t)
                if cap is not None and len(order) > cap:
                    return None
    return order, edges
