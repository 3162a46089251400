"""A pure-Python executable copy of spec/KVCompletion.tla (the reference implementation).

Why: the conformance suite needs (a) a driver that conforms by construction, to validate
traces and the replay machinery, and (b) a successor function to recover each TLC edge's
action parameters (TLC's dot dump labels edges with the operator name only). The model
here mirrors the spec line by line: same variables, same guards, same updates, the same
per-rank `RankStep`, the aggregator's `AfterReports` arithmetic, FCFS admission and
`StepToRun` = the oldest unexecuted step. harness/tests/test_reference_graph.py checks
that its reachable graph equals the one TLC dumps, edge for edge.

States are a frozen, hashable `State` of plain Python values (fast to explore); `to_values`
projects one onto the spec's variables shaped exactly as TLC prints them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import overload

from kvspec.drivers.base import ACTIONS, VARIABLES, Action, Driver, MissingAction
from kvspec.matrix import ModelRow, Topology
from kvspec.tlcvalue import Fn, Record, Value, make_fn

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


# ---------------------------------------------------------------- constants of a row


@dataclass(frozen=True)
class Params:
    """The spec's constants and the definitions derived from them (W, Expected, ...)."""

    variant: str
    composition: str
    tp: int
    pp: int
    pcp: int
    nreq: int
    capacity: int
    async_scheduling: bool

    @staticmethod
    def of(row: ModelRow) -> Params:
        t = row.topology
        return Params(
            row.variant, row.composition, t.tp, t.pp, t.pcp,
            row.requests, row.capacity, row.async_scheduling,
        )  # fmt: skip

    @property
    def w(self) -> int:
        return self.tp * self.pp * self.pcp

    @property
    def ranks(self) -> range:
        return range(self.w)

    @property
    def reqs(self) -> range:
        return range(1, self.nreq + 1)

    @property
    def multi(self) -> bool:
        return self.composition != "nixl"

    @property
    def delaying(self) -> bool:
        return self.composition == "multi-nixl-offload-delaying"

    @property
    def expected(self) -> int:
        # nixl get_finished_count: TP x PP in 0.29, None (0) since; MultiConnector: None.
        nixl = self.tp * self.pp if self.variant == "v0.29" else 0
        finished = 0 if self.multi else nixl
        return self.w if finished == 0 else finished

    def rank_mode(self, w: int) -> str:
        if w % self.pcp == 0 or self.variant == "naive-replicas":
            return "serve"
        if self.variant == "v0.29":
            return "silent"
        if self.variant == "v0.30-shipped":
            return "queue-cleared"
        return "queue"

    def read_sources(self) -> frozenset[int]:
        pcp_rank = self.pcp - 1 if self.variant == "naive-replicas" else 0
        return frozenset(w for w in self.ranks if w % self.pcp == pcp_rank)


def row_from_params(p: Params, name: str = "reference") -> ModelRow:
    """A ModelRow for ad-hoc use (tests, traces carrying their own constants)."""
    return ModelRow(
        name, p.variant, p.composition, Topology(p.tp, p.pp, p.pcp),
        p.nreq, p.capacity, p.async_scheduling,
    )  # fmt: skip


# ---------------------------------------------------------------- helpers


def _set_at(t: PerRank, w: int, v: Reqs) -> PerRank:
    return t[:w] + (v,) + t[w + 1 :]


def _holding(s: State) -> int:
    return sum(1 for x in s.req if x in ("running", "sending"))


def initial_state(row: ModelRow) -> State:
    """Init."""
    p = Params.of(row)
    none: PerRank = (EMPTY,) * p.w
    return State(
        req=("waiting",) * p.nreq,
        needSend=EMPTY,
        notProc=EMPTY,
        steps=(),
        toProcess=none,
        lease=none,
        expired=none,
        notif=none,
        replQ=none,
        extra=none,
        store=none,
        stored=none,
        rd=(("none",) * p.w,) * p.nreq,
        hb=EMPTY,
        agg=(0,) * p.nreq,
        emits=(0,) * p.nreq,
        lateFinish=False,
        published=frozenset(w for w in p.ranks if p.rank_mode(w) == "serve"),
    )


# ---------------------------------------------------------------- actions
# Each returns the successor state, or None when the action's guard is false.


def schedule(p: Params, s: State) -> State | None:
    if s.lateFinish or len(s.steps) >= (2 if p.async_scheduling else 1):
        return None
    if all(x == "freed" for x in s.req):
        return None
    free = p.capacity - _holding(s)
    waiting = [r for r in p.reqs if s.req[r - 1] == "waiting"]  # ascending id: FCFS
    admit = frozenset(waiting[: max(free, 0)])
    req = tuple("running" if r in admit else s.req[r - 1] for r in p.reqs)
    step = Step(admit, s.needSend, s.notProc, False, (EMPTY,) * p.w)
    return replace(s, req=req, steps=(*s.steps, step), needSend=EMPTY, notProc=EMPTY)


@dataclass(frozen=True)
class RankResult:
    toProcess: Reqs
    lease: Reqs
    expired: Reqs
    replQ: Reqs
    extra: Reqs
    out: Reqs


def rank_step(p: Params, s: State, w: int, m: Step) -> RankResult:
    """RankStep(w, m): one worker connector running step metadata m."""
    mode = p.rank_mode(w)
    ex0 = s.extra[w] | m.toSend if p.delaying else s.extra[w]
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
    off_done = s.stored[w] if p.delaying else EMPTY
    both = nixl_done & off_done
    one = (nixl_done | off_done) - both
    return RankResult(
        toProcess=tp2 - reaped,
        lease=ls2 - reaped,
        expired=s.expired[w] & (ls2 - reaped),
        replQ=EMPTY if queues else rq1,
        extra=ex0 - (nixl_done | off_done),
        out=both | (one - ex0) if p.multi else nixl_done,
    )


def step_to_run(s: State) -> int | None:
    """StepToRun: the oldest step not executed yet (0-based), None if all ran."""
    for i, st in enumerate(s.steps):
        if not st.ran:
            return i
    return None


RankStepFn = Callable[[Params, State, int, Step], RankResult]


def execute_model(p: Params, s: State, rank_fn: RankStepFn = rank_step) -> State | None:
    i = step_to_run(s)
    if s.lateFinish or i is None:
        return None
    m = s.steps[i]
    new = [rank_fn(p, s, w, m) for w in p.ranks]
    ran = replace(m, ran=True, out=tuple(n.out for n in new))
    none: PerRank = (EMPTY,) * p.w
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


def update_from_output(p: Params, s: State, expected: int | None = None) -> State | None:
    if s.lateFinish or not s.steps or not s.steps[0].ran:
        return None
    exp = p.expected if expected is None else expected
    m = s.steps[0]
    cnt = {r: sum(1 for w in p.ranks if r in m.out[w]) for r in p.reqs}
    emitted = {
        r for r in p.reqs if cnt[r] > 0 and cnt[r] >= (exp if s.agg[r - 1] == 0 else s.agg[r - 1])
    }
    finishing = frozenset(r for r in m.batch if s.req[r - 1] == "running")
    req1 = tuple("sending" if r in finishing else s.req[r - 1] for r in p.reqs)
    return replace(
        s,
        agg=tuple(after_reports(exp, s.agg[r - 1], cnt[r]) for r in p.reqs),
        emits=tuple(
            e + 1 if r in emitted and e < 2 else e for r, e in zip(p.reqs, s.emits, strict=True)
        ),
        req=tuple(
            "freed" if r in emitted and req1[r - 1] == "sending" else req1[r - 1] for r in p.reqs
        ),
        lateFinish=any(req1[r - 1] != "sending" for r in emitted),
        needSend=s.needSend | finishing,
        store=tuple(x | finishing for x in s.store) if p.delaying else s.store,
        steps=s.steps[1:],
    )


def abort(p: Params, s: State, r: int) -> State | None:
    if s.lateFinish or s.req[r - 1] not in ("waiting", "running"):
        return None
    req = s.req[: r - 1] + ("freed",) + s.req[r:]
    return replace(s, req=req, notProc=s.notProc | {r})


def _set_rd(s: State, r: int, w: int, v: str) -> tuple[tuple[str, ...], ...]:
    row = s.rd[r - 1]
    return s.rd[: r - 1] + (row[:w] + (v,) + row[w + 1 :],) + s.rd[r:]


def consumer_start_load_kv(p: Params, s: State, r: int, w: int) -> State | None:
    if (
        s.req[r - 1] != "sending"
        or w not in p.read_sources()
        or s.rd[r - 1][w] != "none"
        or r not in s.toProcess[w]
        or r in s.expired[w]
    ):
        return None
    return replace(s, rd=_set_rd(s, r, w, "inflight"))


def consumer_get_finished(p: Params, s: State, r: int, w: int) -> State | None:
    if s.rd[r - 1][w] != "inflight":
        return None
    return replace(s, rd=_set_rd(s, r, w, "done"), notif=_set_at(s.notif, w, s.notif[w] | {r}))


def heartbeat(p: Params, s: State, r: int) -> State | None:
    if s.req[r - 1] != "sending" or r in s.hb or any(x != "none" for x in s.rd[r - 1]):
        return None
    return replace(s, hb=s.hb | {r}, expired=tuple(x - {r} for x in s.expired))


def lease_expire(p: Params, s: State, r: int, w: int) -> State | None:
    if r not in s.lease[w] or r in s.expired[w] or s.rd[r - 1][w] == "inflight":
        return None
    return replace(s, expired=_set_at(s.expired, w, s.expired[w] | {r}))


def store_complete(p: Params, s: State, r: int, w: int) -> State | None:
    if r not in s.store[w]:
        return None
    return replace(
        s,
        store=_set_at(s.store, w, s.store[w] - {r}),
        stored=_set_at(s.stored, w, s.stored[w] | {r}),
    )


def all_actions(row: ModelRow) -> list[Action]:
    """Every action instance of Next for this row, sorted (the order of `enabled()`)."""
    p = Params.of(row)
    out: list[Action] = []
    for name, params in ACTIONS.items():
        if params == ():
            out.append(Action(name))
        elif params == ("r",):
            out += [Action(name, r) for r in p.reqs]
        else:
            out += [Action(name, r, w) for r in p.reqs for w in p.ranks]
    return sorted(out)


class Model:
    """The transition function of one row; subclass hooks let negative controls bend it."""

    def __init__(self, row: ModelRow) -> None:
        self.row = row
        self.p = Params.of(row)
        self.actions = all_actions(row)

    def rank_step(self, p: Params, s: State, w: int, m: Step) -> RankResult:
        return rank_step(p, s, w, m)

    def expected(self) -> int:
        return self.p.expected

    def apply(self, s: State, a: Action) -> State | None:
        """The successor of s under a, or None if a's guard is false."""
        p = self.p
        n = a.name
        if n == "schedule":
            return schedule(p, s)
        if n == "execute_model":
            return execute_model(p, s, self.rank_step)
        if n == "update_from_output":
            return update_from_output(p, s, self.expected())
        assert a.r is not None, a  # every other action takes a request
        if n == "abort":
            return abort(p, s, a.r)
        if n == "heartbeat":
            return heartbeat(p, s, a.r)
        assert a.w is not None, a
        fn = {
            "consumer_start_load_kv": consumer_start_load_kv,
            "consumer_get_finished": consumer_get_finished,
            "lease_expire": lease_expire,
            "store_complete": store_complete,
        }[n]
        return fn(p, s, a.r, a.w)

    def successors(self, s: State) -> list[tuple[Action, State]]:
        out: list[tuple[Action, State]] = []
        for a in self.actions:
            t = self.apply(s, a)
            if t is not None:
                out.append((a, t))
        return out


@overload
def successors(row: ModelRow, state: State) -> list[tuple[Action, State]]: ...


@overload
def successors(
    row: ModelRow, state: Mapping[str, Value]
) -> list[tuple[Action, dict[str, Value]]]: ...


def successors(
    row: ModelRow, state: State | Mapping[str, Value]
) -> list[tuple[Action, State]] | list[tuple[Action, dict[str, Value]]]:
    """Every enabled action instance with its successor state, sorted by action.

    Takes and returns either `State`s or TLC-shaped variable maps (as `observe()` and
    parsed TLC/ITF states are), so callers holding printed states need no conversion.
    """
    model = Model(row)
    if isinstance(state, State):
        return model.successors(state)
    return [(a, to_values(row, t)) for a, t in model.successors(from_values(row, state))]


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


# ---------------------------------------------------------------- TLC-shaped values


def _ranks_fn(p: Params, per_rank: PerRank) -> Value:
    # make_fn keeps a 0..W-1 domain as an Fn: TLC prints it as (0 :> .. @@ 1 :> ..).
    return make_fn((w, per_rank[w]) for w in p.ranks)


def to_values(row: ModelRow, s: State) -> dict[str, Value]:
    """The state as tlcvalue Values, shaped exactly as TLC prints them."""
    p = Params.of(row)
    steps = tuple(
        Record.of(
            {
                "batch": st.batch,
                "toSend": st.toSend,
                "notProc": st.notProc,
                "ran": st.ran,
                "out": _ranks_fn(p, st.out),
            }
        )
        for st in s.steps
    )
    values: dict[str, Value] = {
        "req": s.req,
        "needSend": s.needSend,
        "notProc": s.notProc,
        "steps": steps,
        "hb": s.hb,
        "agg": s.agg,
        "emits": s.emits,
        "lateFinish": s.lateFinish,
        "published": s.published,
        "rd": tuple(make_fn((w, row_rd[w]) for w in p.ranks) for row_rd in s.rd),
    }
    for name in ("toProcess", "lease", "expired", "notif", "replQ", "extra", "store", "stored"):
        values[name] = _ranks_fn(p, getattr(s, name))
    return {k: values[k] for k in VARIABLES}


def _reqs(v: Value) -> Reqs:
    if not isinstance(v, frozenset) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a set of request ids, got {v!r}")
    return frozenset(x for x in v if type(x) is int)


def _per_rank(p: Params, v: Value) -> PerRank:
    d = _fn_dict(v)
    return tuple(_reqs(d[w]) for w in p.ranks)


def _fn_dict(v: Value) -> dict[Value, Value]:
    # A function over 0..W-1 is an Fn; TLC never prints it as a sequence (domain has 0).
    if isinstance(v, Fn):
        return v.as_dict()
    raise ValueError(f"expected a function over ranks, got {v!r}")


def _int(v: Value) -> int:
    if type(v) is not int:
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def from_values(row: ModelRow, values: Mapping[str, Value]) -> State:
    """Inverse of `to_values` (for TLC dumps and ITF traces); raises ValueError on shape."""
    p = Params.of(row)
    missing = set(VARIABLES) - set(values)
    if missing:
        raise ValueError(f"state lacks variables {sorted(missing)}")

    def seq(v: Value) -> tuple[Value, ...]:
        if not isinstance(v, tuple) or len(v) != p.nreq:
            raise ValueError(f"expected a {p.nreq}-element sequence, got {v!r}")
        return v

    steps: list[Step] = []
    for rec in seq_any(values["steps"]):
        if not isinstance(rec, Record):
            raise ValueError(f"steps element is not a record: {rec!r}")
        ran = rec["ran"]
        steps.append(
            Step(
                _reqs(rec["batch"]),
                _reqs(rec["toSend"]),
                _reqs(rec["notProc"]),
                bool(ran),
                _per_rank(p, rec["out"]),
            )  # fmt: skip
        )
    rd = tuple(tuple(str(_fn_dict(x)[w]) for w in p.ranks) for x in seq(values["rd"]))
    pub = values["published"]
    if not isinstance(pub, frozenset):
        raise ValueError(f"published is not a set: {pub!r}")
    return State(
        req=tuple(str(x) for x in seq(values["req"])),
        needSend=_reqs(values["needSend"]),
        notProc=_reqs(values["notProc"]),
        steps=tuple(steps),
        toProcess=_per_rank(p, values["toProcess"]),
        lease=_per_rank(p, values["lease"]),
        expired=_per_rank(p, values["expired"]),
        notif=_per_rank(p, values["notif"]),
        replQ=_per_rank(p, values["replQ"]),
        extra=_per_rank(p, values["extra"]),
        store=_per_rank(p, values["store"]),
        stored=_per_rank(p, values["stored"]),
        rd=rd,
        hb=_reqs(values["hb"]),
        agg=tuple(_int(x) for x in seq(values["agg"])),
        emits=tuple(_int(x) for x in seq(values["emits"])),
        lateFinish=bool(values["lateFinish"]),
        published=_reqs(pub),
    )


def seq_any(v: Value) -> tuple[Value, ...]:
    if not isinstance(v, tuple):
        raise ValueError(f"expected a sequence, got {v!r}")
    return v


# ---------------------------------------------------------------- the driver


class ReferenceDriver(Driver):
    """Runs the reference model; conforms to the spec by construction."""

    model_class: type[Model] = Model

    def __init__(self, row: ModelRow) -> None:
        super().__init__(row)
        self.model = self.model_class(row)
        self.state = initial_state(row)

    def enabled(self) -> list[Action]:
        return [a for a, _ in self.model.successors(self.state)]

    def observe(self) -> dict[str, Value]:
        return to_values(self.row, self.state)

    def _do(self, a: Action) -> None:
        nxt = self.model.apply(self.state, a)
        if nxt is None:
            raise MissingAction(f"{a} is not enabled in the reference model")
        self.state = nxt

    def schedule(self) -> None:
        self._do(Action("schedule"))

    def execute_model(self) -> None:
        self._do(Action("execute_model"))

    def update_from_output(self) -> None:
        self._do(Action("update_from_output"))

    def abort(self, r: int) -> None:
        self._do(Action("abort", r))

    def consumer_start_load_kv(self, r: int, w: int) -> None:
        self._do(Action("consumer_start_load_kv", r, w))

    def consumer_get_finished(self, r: int, w: int) -> None:
        self._do(Action("consumer_get_finished", r, w))

    def heartbeat(self, r: int) -> None:
        self._do(Action("heartbeat", r))

    def lease_expire(self, r: int, w: int) -> None:
        self._do(Action("lease_expire", r, w))

    def store_complete(self, r: int, w: int) -> None:
        self._do(Action("store_complete", r, w))
