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
from dataclasses import dataclass, field, replace

from kvspec.matrix import ModelRow

# name -> parameter names, in the order the TLA+ operator takes them. A parameter is a
# request id `r` (1..NReq) or a vLLM global rank `w` (0..W-1, see matrix.Topology).
ACTIONS: dict[str, tuple[str, ...]] = {
    "schedule": (),
    "execute_model": (),
    "update_from_output": (),
    "abort": ("r",),
    "consumer_start_load_kv": ("r", "w"),
    "consumer_get_finished": ("r", "w"),
    "heartbeat": ("r",),
    "lease_expire": ("r", "w"),
    "store_complete": ("r", "w"),
}

# The spec's VARIABLES, in declaration order.
VARIABLES = (
    "req", "needSend", "notProc", "steps", "toProcess", "lease", "expired", "notif",
    "replQ", "extra", "store", "stored", "rd", "hb", "agg", "emits", "lateFinish",
    "published",
)  # fmt: skip


@dataclass(frozen=True, order=True)
class Action:
    """One action instance: the operator name and its parameter values."""

    name: str
    r: int | None = None
    w: int | None = None

    @property
    def args(self) -> tuple[int, ...]:
        return tuple(v for v in (self.r, self.w) if v is not None)

    def params(self) -> dict[str, int]:
        return dict(zip(ACTIONS[self.name], self.args, strict=True))

    def __str__(self) -> str:
        args = ", ".join(map(str, self.args))
        return f"{self.name}({args})" if args else self.name

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of __str__: 'lease_expire(1, 0)' -> Action('lease_expire', 1, 0)."""
        name, _, rest = text.strip().partition("(")
        name = name.strip()
        if name not in ACTIONS:
            raise ValueError(f"unknown action {name!r}; known: {', '.join(ACTIONS)}")
        vals = [int(x) for x in rest.rstrip(") ").split(",") if x.strip()]
        names = ACTIONS[name]
        if len(vals) != len(names):
            raise ValueError(f"{name} takes {len(names)} parameters, got {len(vals)}")
        kw = dict(zip(names, vals, strict=True))
        return Action(name, kw.get("r"), kw.get("w"))


Reqs = frozenset[int]
PerRank = tuple[Reqs, ...]  # index w in 0..W-1
EMPTY: Reqs = frozenset()


@dataclass(frozen=True)
class Step:
    """One element of `steps`: a scheduled step's connector metadata and its outputs."""

    batch: Reqs
    toSend: Reqs
    notProc: Reqs
    ran: bool
    out: PerRank


@dataclass(frozen=True)
class State:
    """The spec's 18 variables. Functions over Reqs are tuples indexed by r - 1."""

    req: tuple[str, ...]
    needSend: Reqs
    notProc: Reqs
    steps: tuple[Step, ...]
    toProcess: PerRank
    lease: PerRank
    expired: PerRank
    notif: PerRank
    replQ: PerRank
    extra: PerRank
    store: PerRank
    stored: PerRank
    rd: tuple[tuple[str, ...], ...]  # rd[r - 1][w]
    hb: Reqs
    agg: tuple[int, ...]
    emits: tuple[int, ...]
    lateFinish: bool
    published: frozenset[int]


@dataclass(frozen=True)
class RankResult:
    """RankStep(w, m)'s record: one rank's new per-rank state and its report."""

    toProcess: Reqs
    lease: Reqs
    expired: Reqs
    replQ: Reqs
    extra: Reqs
    out: Reqs


RankStepFn = Callable[["Defs", State, int, Step], RankResult]


def rank_mode(row: ModelRow, w: int) -> str:
    """RankMode(w): what rank w's NIXL worker does with reqs_to_send."""
    pcp = row.topology.rank_coords(w).pcp
    if pcp == 0 or row.variant == "naive-replicas":
        return "serve"
    if row.variant == "v0.29":
        return "silent"
    if row.variant == "v0.30-shipped":
        return "queue-cleared"
    return "queue"


def expected_count(row: ModelRow) -> int:
    """Expected: nixl get_finished_count is TP x PP in 0.29, None (0) since; a
    MultiConnector's is None; the aggregator then waits for world_size reports."""
    t = row.topology
    nixl = t.tp * t.pp if row.variant == "v0.29" else 0
    finished = nixl if row.composition == "nixl" else 0
    return t.world_size if finished == 0 else finished


def pipeline_depth(row: ModelRow) -> int:
    """PipelineDepth: config/vllm.py max_concurrent_batches (PP; async: PP + 1 on the V2
    runner, 2 on V1 at PP = 1)."""
    pp = row.topology.pp
    if not row.async_scheduling:
        return pp
    if row.runner == "v2":
        return pp + 1
    return 2 if pp <= 1 else pp


def read_sources(row: ModelRow) -> frozenset[int]:
    """ReadSources: PCP rank 0, or the last publisher of a (tp, pp) key (naive replicas)."""
    t = row.topology
    want = t.pcp - 1 if row.variant == "naive-replicas" else 0
    return frozenset(w for w in range(t.world_size) if t.rank_coords(w).pcp == want)


@dataclass(frozen=True)
class Defs:
    """The spec's definitions derived from a row's constants (W, Expected, RankMode, ...),
    computed once per row. `rank_step` and `expected` are the two hooks negative controls
    bend (kvspec.drivers.broken)."""

    row: ModelRow
    w: int
    reqs: range
    multi: bool
    delaying: bool
    expected: int
    depth: int
    modes: tuple[str, ...]
    read_sources: frozenset[int]
    rank_step: RankStepFn = field(compare=False)

    @staticmethod
    def of(row: ModelRow, rank_step_fn: RankStepFn | None = None) -> Defs:
        w = row.topology.world_size
        return Defs(
            row=row,
            w=w,
            reqs=range(1, row.requests + 1),
            multi=row.composition != "nixl",
            delaying=row.composition == "multi-nixl-offload-delaying",
            expected=expected_count(row),
            depth=pipeline_depth(row),
            modes=tuple(rank_mode(row, x) for x in range(w)),
            read_sources=read_sources(row),
            rank_step=rank_step_fn or rank_step,
        )

    @property
    def ranks(self) -> range:
        return range(self.w)


# ---------------------------------------------------------------- helpers


def _set_at(t: PerRank, w: int, v: Reqs) -> PerRank:
    return t[:w] + (v,) + t[w + 1 :]


def _set_rd(s: State, r: int, w: int, v: str) -> tuple[tuple[str, ...], ...]:
    row = s.rd[r - 1]
    return s.rd[: r - 1] + (row[:w] + (v,) + row[w + 1 :],) + s.rd[r:]


def _holding(s: State) -> int:
    return sum(1 for x in s.req if x in ("running", "sending"))


def initial_state(row: ModelRow) -> State:
    """Init."""
    d = Defs.of(row)
    none: PerRank = (EMPTY,) * d.w
    return State(
        req=("waiting",) * row.requests, needSend=EMPTY, notProc=EMPTY, steps=(),
        toProcess=none, lease=none, expired=none, notif=none, replQ=none, extra=none,
        store=none, stored=none, rd=(("none",) * d.w,) * row.requests, hb=EMPTY,
        agg=(0,) * row.requests, emits=(0,) * row.requests, lateFinish=False,
        published=frozenset(w for w in d.ranks if d.modes[w] == "serve"),
    )  # fmt: skip


# ---------------------------------------------------------------- actions


def schedule(d: Defs, s: State) -> State | None:
    """schedule: Scheduler.schedule + build_connector_meta."""
    if s.lateFinish or len(s.steps) >= d.depth:
        return None
    if all(x == "freed" for x in s.req):
        return None
    free = d.row.capacity - _holding(s)
    waiting = [r for r in d.reqs if s.req[r - 1] == "waiting"]  # ascending id: FCFS
    admit = frozenset(waiting[: max(free, 0)])
    req = tuple("running" if r in admit else s.req[r - 1] for r in d.reqs)
    step = Step(admit, s.needSend, s.notProc, False, (EMPTY,) * d.w)
    return replace(s, req=req, steps=(*s.steps, step), needSend=EMPTY, notProc=EMPTY)


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
    reaped = s.expired[w] & ls2
    if mode == "serve":
        nixl_done = known | reaped
    elif mode == "queue":
        nixl_done = rq1
    else:
        nixl_done = EMPTY
    off_done = s.stored[w] if d.delaying else EMPTY
    both = nixl_done & off_done
    one = (nixl_done | off_done) - both
    return RankResult(
        toProcess=tp2 - reaped,
        lease=ls2 - reaped,
        expired=s.expired[w] & (ls2 - reaped),
        replQ=EMPTY if queues else rq1,
        extra=ex0 - (nixl_done | off_done),
        out=both | (one - ex0) if d.multi else nixl_done,
    )


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
    ran = replace(m, ran=True, out=tuple(n.out for n in new))
    none: PerRank = (EMPTY,) * d.w
    return replace(
        s,
        toProcess=tuple(n.toProcess for n in new),
        lease=tuple(n.lease for n in new),
        expired=tuple(n.expired for n in new),
        replQ=tuple(n.replQ for n in new),
        extra=tuple(n.extra for n in new),
        steps=s.steps[:i] + (ran,) + s.steps[i + 1 :],
        notif=none,
        stored=none,
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
    return replace(
        s,
        agg=tuple(after_reports(exp, s.agg[r - 1], cnt[r]) for r in d.reqs),
        emits=tuple(
            e + 1 if r in emitted and e < 2 else e for r, e in zip(d.reqs, s.emits, strict=True)
        ),
        req=tuple(
            "freed" if r in emitted and req1[r - 1] == "sending" else req1[r - 1] for r in d.reqs
        ),
        lateFinish=any(req1[r - 1] != "sending" for r in emitted),
        needSend=s.needSend | finishing,
        store=tuple(x | finishing for x in s.store) if d.delaying else s.store,
        steps=s.steps[1:],
    )


def abort(d: Defs, s: State, r: int) -> State | None:
    """abort(r): Scheduler.finish_requests(FINISHED_ABORTED) of a waiting/running request."""
    if s.lateFinish or s.req[r - 1] not in ("waiting", "running"):
        return None
    req = s.req[: r - 1] + ("freed",) + s.req[r:]
    return replace(s, req=req, notProc=s.notProc | {r})


def consumer_start_load_kv(d: Defs, s: State, r: int, w: int) -> State | None:
    """consumer_start_load_kv(r, w): the decode side's READ of r from producer rank w."""
    if (
        s.req[r - 1] != "sending"
        or w not in d.read_sources
        or s.rd[r - 1][w] != "none"
        or r not in s.toProcess[w]
        or r in s.expired[w]
    ):
        return None
    return replace(s, rd=_set_rd(s, r, w, "inflight"))


def consumer_get_finished(d: Defs, s: State, r: int, w: int) -> State | None:
    """consumer_get_finished(r, w): the READ completed; "r:1" is delivered to rank w."""
    if s.rd[r - 1][w] != "inflight":
        return None
    return replace(s, rd=_set_rd(s, r, w, "done"), notif=_set_at(s.notif, w, s.notif[w] | {r}))


def heartbeat(d: Defs, s: State, r: int) -> State | None:
    """heartbeat(r): the decode side's "HB:r" extends r's lease on every rank."""
    if s.req[r - 1] != "sending" or r in s.hb or any(x != "none" for x in s.rd[r - 1]):
        return None
    return replace(s, hb=s.hb | {r}, expired=tuple(x - {r} for x in s.expired))


def lease_expire(d: Defs, s: State, r: int, w: int) -> State | None:
    """lease_expire(r, w): kv_lease_duration passes for r on rank w (no READ in flight)."""
    if r not in s.lease[w] or r in s.expired[w] or s.rd[r - 1][w] == "inflight":
        return None
    return replace(s, expired=_set_at(s.expired, w, s.expired[w] | {r}))


def store_complete(d: Defs, s: State, r: int, w: int) -> State | None:
    """store_complete(r, w): the delaying offload child's store of r on rank w completes."""
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
