"""A counterexample of spec/KVCompletion.tla (an ITF document) read step by step: what each
step did between the components, and what is wrong at its end. `kvspec.diagram` draws it.

Pure functions. ``analyze`` reads the trace through ``kvspec.itf`` and takes each step's
action instance from ``#meta.action``: `kvspec check` writes it as "lease_expire(1, 0)"
(``Model.label_path`` recovers the parameters TLC does not print); a bare operator name
(raw ``kvspec tlc --itf`` output) stands without parameters. From the action and the diff
with the previous state it derives the step's events between the lanes: scheduler,
aggregator, one lane per producer rank, consumer, offload. A rank is named with its
coordinates as vLLM numbers ranks, TP innermost (tp = w % TP, pcp = (w // TP) % PCP,
pp = w // (TP * PCP); ``matrix.Topology.rank_coords``). The end of a lasso is summarised
as "stuck" (which request is stuck, the aggregator's remaining count and the ranks it
still waits for), the end of a safety counterexample as "violated".
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvspec.itf import JSON, trace_from_itf
from kvspec.matrix import Topology
from kvspec.model import DELAYED, Action
from kvspec.tlcvalue import Fn, ModelValue, Record, Value, sort_key

Tone = Literal["normal", "ok", "bad", "muted", "warn"]
EventKind = Literal["arrow", "box", "mark"]
FinalKind = Literal["stuck", "violation", "end"]
State = Mapping[str, Value]

SCHEDULER = "scheduler"
AGGREGATOR = "aggregator"
CONSUMER = "consumer"
OFFLOAD = "offload"


def rank_lane(w: int) -> str:
    return f"rank:{w}"


def rank_name(topo: Topology | None, w: int) -> str:
    """'rank 5 (tp1 pp0 pcp1)': the global rank and its coordinates, when known."""
    if topo is None:
        return f"rank {w}"
    c = topo.rank_coords(w)
    return f"rank {w} (tp{c.tp} pp{c.pp} pcp{c.pcp})"


@dataclass(frozen=True)
class Event:
    """One arrow (src -> dst), box or mark (src == dst) in a step's row."""

    kind: EventKind
    src: str
    dst: str
    text: str
    tone: Tone = "normal"


@dataclass(frozen=True)
class StepInfo:
    index: int
    action: str
    r: int | None
    w: int | None
    changes: tuple[str, ...]
    events: tuple[Event, ...]

    @property
    def label(self) -> str:
        args = [f"{k}={v}" for k, v in (("r", self.r), ("w", self.w)) if v is not None]
        return f"{self.action}({', '.join(args)})" if args else self.action


@dataclass(frozen=True)
class Analysis:
    ranks: tuple[int, ...]
    topology: Topology | None
    steps: tuple[StepInfo, ...]
    loop: int | None
    stuttering: bool
    final_kind: FinalKind
    final: tuple[str, ...]

    @property
    def loop_label(self) -> str | None:
        """How the behaviour goes on after its last step; None for a finite trace."""
        if self.loop is None:
            return None
        if self.stuttering and self.loop == len(self.steps) - 1:
            return f"stutters forever at step {self.loop}"
        return f"loop back to step {self.loop}"

    @property
    def lanes(self) -> tuple[tuple[str, str], ...]:
        """(key, label) of every lane, left to right."""
        ranks = [(rank_lane(w), rank_name(self.topology, w)) for w in self.ranks]
        return ((SCHEDULER, "scheduler"), (AGGREGATOR, "aggregator"), *ranks,
                (CONSUMER, "consumer (D)"), (OFFLOAD, "offload (HF3FS)"))  # fmt: skip


# ---------------------------------------------------------------- reading states


def _by_int(v: Value | None) -> dict[int, Value]:
    """A function over request ids (a sequence: 1..n) or ranks (0..W-1) as a dict."""
    if isinstance(v, tuple):
        return dict(enumerate(v, 1))
    if isinstance(v, Fn):
        return {k: x for k, x in v.pairs if isinstance(k, int)}
    return {}


def _ints(v: Value | None) -> frozenset[int]:
    """A set of request ids or ranks."""
    if not isinstance(v, frozenset):
        return frozenset()
    return frozenset(x for x in v if isinstance(x, int))


def _int(v: Value | None) -> int:
    return v if isinstance(v, int) else 0


def _rank_sets(st: State, var: str) -> dict[int, frozenset[int]]:
    return {w: _ints(v) for w, v in _by_int(st.get(var)).items()}


def _rd(st: State) -> dict[tuple[int, int], str]:
    return {(r, w): str(s) for r, per in _by_int(st.get("rd")).items()
            for w, s in _by_int(per).items()}  # fmt: skip


def _added(prev: State, cur: State, var: str) -> list[tuple[int, int]]:
    """(r, w) pairs newly in the per-rank set variable var."""
    a, b = _rank_sets(prev, var), _rank_sets(cur, var)
    return sorted((r, w) for w in b for r in b[w] - a.get(w, frozenset()))


def _steps(st: State) -> list[dict[str, Value]]:
    return [x.as_dict() for x in _by_int(st.get("steps")).values() if isinstance(x, Record)]


def _reports(prev: State, cur: State) -> dict[int, frozenset[int]]:
    """finished_sending per rank of the step execute_model ran between prev and cur."""
    for x, y in zip(_steps(prev), _steps(cur), strict=False):
        if not x.get("ran") and y.get("ran"):
            return _rank_sets(y, "out")
    return {}


# ---------------------------------------------------------------- text of values


def _fmt_set(s: Iterable[Value]) -> str:
    return "{" + ", ".join(fmt_value(x) for x in sorted(s, key=sort_key)) + "}"


def fmt_value(v: Value | None) -> str:
    """A compact TLA+-like rendering of a value."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int | str):
        return str(v)
    if isinstance(v, ModelValue):
        return v.name
    if isinstance(v, tuple):
        return "<<" + ", ".join(fmt_value(x) for x in v) + ">>"
    if isinstance(v, frozenset):
        return _fmt_set(v)
    if isinstance(v, Record):
        return "[" + ", ".join(f"{k}: {fmt_value(x)}" for k, x in v.fields) + "]"
    if isinstance(v, Fn):
        return "(" + ", ".join(f"{fmt_value(k)}:{fmt_value(x)}" for k, x in v.pairs) + ")"
    return repr(v)


def diff_values(path: str, a: Value | None, b: Value | None) -> list[str]:
    """What changed from a to b, one compact string per changed leaf."""
    if a == b:
        return []
    if isinstance(a, frozenset) and isinstance(b, frozenset):
        parts = [sign + _fmt_set(d) for sign, d in (("+", b - a), ("-", a - b)) if d]
        return [f"{path} {' '.join(parts)}"]
    if isinstance(a, Fn) and isinstance(b, Fn) and a.as_dict().keys() == b.as_dict().keys():
        fb = b.as_dict()
        return [x for k, v in a.pairs for x in diff_values(f"{path}[{fmt_value(k)}]", v, fb[k])]
    if isinstance(a, Record) and isinstance(b, Record) and a.as_dict().keys() == b.as_dict().keys():
        rb = b.as_dict()
        return [x for k, v in a.fields for x in diff_values(f"{path}.{k}", v, rb[k])]
    if isinstance(a, tuple) and isinstance(b, tuple):
        if len(a) == len(b):
            return [x for i, (u, v) in enumerate(zip(a, b, strict=True), 1)
                    for x in diff_values(f"{path}[{i}]", u, v)]  # fmt: skip
        if len(b) == len(a) + 1 and b[:-1] == a:
            return [f"{path} append {_fmt_appended(b[-1])}"]
        if len(b) == len(a) - 1 and b == a[1:]:
            return [f"{path} pop head"]
    return [f"{path}: {fmt_value(a)} -> {fmt_value(b)}"]


def _fmt_appended(v: Value) -> str:
    """A new scheduler step record without its not-yet-meaningful output fields."""
    f = v.as_dict() if isinstance(v, Record) else {}
    if {"batch", "toSend", "notProc"} <= f.keys():
        return (f"<batch {fmt_value(f['batch'])}, toSend {fmt_value(f['toSend'])}, "
                f"notProc {fmt_value(f['notProc'])}>")  # fmt: skip
    return fmt_value(v)


# ---------------------------------------------------------------- analysis


def _action(text: str) -> tuple[str, int | None, int | None]:
    """An annotated action instance ("lease_expire(1, 0)") and its parameters; a bare
    operator name (TLC's own output, which has none) as itself."""
    try:
        a = Action.parse(text)
    except ValueError:
        return text.partition("(")[0].strip() or "?", None, None
    return a.name, a.r, a.w


def _topology(src: JSON) -> Topology | None:
    try:
        return Topology(int(src["tp"]), int(src["pp"]), int(src["pcp"]))
    except (KeyError, TypeError, ValueError):
        return None


def _ranks(states: Sequence[State], topo: Topology | None) -> tuple[int, ...]:
    for var in ("toProcess", "lease", "notif", "store"):
        for st in states:
            keys = _by_int(st.get(var))
            if keys:
                return tuple(sorted(keys))
    return tuple(range(topo.world_size)) if topo else (0,)


def _n(x: int | None) -> str:
    return "?" if x is None else str(x)


def _update_events(prev: State, cur: State) -> list[Event]:
    """update_from_output: what the aggregator emitted and the scheduler did with it."""
    req_a, req_b = _by_int(prev.get("req")), _by_int(cur.get("req"))
    emits_a, emits_b = _by_int(prev.get("emits")), _by_int(cur.get("emits"))
    agg_a, agg_b = _by_int(prev.get("agg")), _by_int(cur.get("agg"))
    freed = {q for q in req_b if req_a.get(q) in DELAYED and req_b[q] == "freed"}
    emitted = sorted(q for q in req_b if _int(emits_b.get(q)) > _int(emits_a.get(q)) or q in freed)
    ev = [
        Event("arrow", AGGREGATOR, SCHEDULER, f"free {q}", "ok") if q in freed
        else Event("arrow", AGGREGATOR, SCHEDULER, f"late! {q} (not held)", "bad")
        for q in emitted
    ]  # fmt: skip
    late_now = bool(cur.get("lateFinish")) and not bool(prev.get("lateFinish"))
    if late_now and not any(e.tone == "bad" for e in ev):
        ev.append(Event("arrow", AGGREGATOR, SCHEDULER, "late! finished_sending", "bad"))
    if not ev:
        ev.append(Event("arrow", AGGREGATOR, SCHEDULER, "finished_sending {}", "muted"))
    for q in sorted(agg_b):
        a, b = _int(agg_a.get(q)), _int(agg_b[q])
        if a != b and q not in emitted:
            text = f"req {q}: remaining {a or 'new'} -> {b or 'none'}"
            ev.append(Event("box", AGGREGATOR, AGGREGATOR, text))
    for q in sorted(q for q in req_b if (req_a.get(q), req_b[q]) == ("running", "sending")):
        ev.append(Event("box", SCHEDULER, SCHEDULER, f"req {q} finished: free delayed"))
    return ev


def _save_events(prev: State, cur: State) -> list[Event]:
    """execute_model: the HF3FS saves the step submitted (wait_for_save), per request."""
    started = _added(prev, cur, "store")
    return [
        Event("arrow", SCHEDULER, OFFLOAD,
              f"save {q} on ranks {_fmt_set([rw for rq, rw in started if rq == q])}")
        for q in sorted({rq for rq, _ in started})
    ]  # fmt: skip


def _describe(
    name: str, r: int | None, w: int | None, prev: State | None, cur: State, ranks: Sequence[int]
) -> list[Event]:
    """The diagram events of one step: action `name` with parameters r, w from prev to cur."""
    if prev is None:
        pub = _ints(cur.get("published"))
        text = f"init: handshakes published by ranks {_fmt_set(pub)}" if pub else "init"
        return [Event("box", SCHEDULER, SCHEDULER, text, "muted")]
    if name == "schedule":
        new = (_steps(cur) or [{}])[-1]
        parts = [f"{label} {_fmt_set(s)}"
                 for key, label in (("batch", "admit"), ("toSend", "to_send"),
                                    ("notProc", "not_processed"))
                 if (s := _ints(new.get(key)))]  # fmt: skip
        return [Event("box", SCHEDULER, SCHEDULER, "schedule: " + ("; ".join(parts) or "empty"))]
    if name == "execute_model":
        out = _reports(prev, cur)
        reports = [Event("arrow", rank_lane(x), AGGREGATOR, f"finished_sending {_fmt_set(got)}",
                         "ok" if got else "muted")
                   for x in ranks for got in [out.get(x, frozenset())]]  # fmt: skip
        return reports + _save_events(prev, cur)
    if name == "update_from_output":
        return _update_events(prev, cur)
    if name == "abort":
        return [Event("box", SCHEDULER, SCHEDULER, f"abort {_n(r)}", "warn")]
    if name in ("consumer_start_load_kv", "consumer_get_finished"):
        dst = rank_lane(w) if w is not None else CONSUMER
        text = f"READ {_n(r)}" if name == "consumer_start_load_kv" else f"notif {_n(r)}:1"
        return [Event("arrow", CONSUMER, dst, text)]
    if name in ("push_write", "push_write_done"):
        src = rank_lane(w) if w is not None else SCHEDULER
        text = f"WRITE {_n(r)}" if name == "push_write" else f"WRITE {_n(r)} done"
        return [Event("arrow", src, CONSUMER, text)]
    if name == "heartbeat":
        return [Event("arrow", CONSUMER, rank_lane(ranks[0]), f"HB:{_n(r)} (all ranks)")]
    if name == "lease_expire":
        lane = rank_lane(w) if w is not None else SCHEDULER
        return [Event("mark", lane, lane, f"lease {_n(r)} expired", "warn")]
    if name == "store_complete":
        lane = rank_lane(w) if w is not None else OFFLOAD
        return [Event("box", lane, lane, f"HF3FS: save {_n(r)} done", "ok")]
    return [Event("box", SCHEDULER, SCHEDULER, name, "muted")]


def _stuck(
    states: Sequence[State], steps: Sequence[StepInfo], loop: int, ranks: Sequence[int],
    topo: Topology | None,
) -> list[str]:  # fmt: skip
    """The end of a lasso: which requests never leave their status in the cycle, and why."""
    req = _by_int(states[-1].get("req"))
    lines = []
    for q in sorted(req):
        status = {str(_by_int(s.get("req")).get(q)) for s in states[loop:]}
        if status == {"sending"}:
            agg = _int(_by_int(states[-1].get("agg")).get(q))
            reported = {x for i in range(1, len(states)) if steps[i].action == "execute_model"
                        for x, got in _reports(states[i - 1], states[i]).items()
                        if q in got}  # fmt: skip
            waiting = ", ".join(rank_name(topo, x) for x in ranks if x not in reported)
            remaining = f"agg remaining={agg}" if agg else "agg: no entry"
            lines.append(f"stuck: req {q} sending, {remaining}, waiting: [{waiting}]")
        elif status == {"waiting"}:
            holding = [x for x, s in req.items() if s in ("running", "sending")]
            lines.append(f"stuck: req {q} waiting, KV full (held by {_fmt_set(holding)})")
    return lines or [f"stuck: the loop from step {loop} repeats forever"]


def _violation(last: State, ranks: Sequence[int], topo: Topology | None) -> list[str]:
    """What is wrong in the last state of a safety counterexample."""
    found = []
    rd, store = _rd(last), _rank_sets(last, "store")
    for q, s in sorted(_by_int(last.get("req")).items()):
        if s != "freed":
            continue
        for w in ranks:
            if rd.get((q, w)) == "inflight":
                found.append(f"req {q} freed while READ in flight on {rank_name(topo, w)}")
            if q in store.get(w, frozenset()):
                found.append(
                    f"req {q} freed while its HF3FS save is in flight on {rank_name(topo, w)}"
                )
    if last.get("lateFinish") is True:
        found.append("scheduler got finished_sending for a request it no longer holds")
    for q, n in sorted(_by_int(last.get("emits")).items()):
        if _int(n) > 1:
            found.append(f"req {q} emitted {_int(n)} times")
    if topo is not None:
        seen: dict[tuple[int, int], int] = {}
        for w in sorted(_ints(last.get("published"))):
            c = topo.rank_coords(w)
            if (c.tp, c.pp) in seen:
                found.append(f"ranks {seen[(c.tp, c.pp)]} and {w} publish handshake "
                             f"(tp{c.tp}, pp{c.pp})")  # fmt: skip
            seen[(c.tp, c.pp)] = w
    return found


def analyze(
    doc: Mapping[str, JSON],
    *,
    topology: Mapping[str, int] | None = None,
    prop: str | None = None,
) -> Analysis:
    """Every step's action, parameters, changes and diagram events from an ITF doc.

    `topology` and `prop` default to the doc's ``#meta`` (`kvspec check` writes both)."""
    trace = trace_from_itf(doc)
    if not trace.states:
        raise ValueError("not an ITF trace: no 'states' list")
    meta = doc.get("#meta")
    meta = meta if isinstance(meta, Mapping) else {}
    topo = _topology(topology if topology is not None else meta.get("topology"))
    if prop is None and isinstance(meta.get("property"), str):
        prop = meta["property"]
    states = [st.values for st in trace.states]
    ranks = _ranks(states, topo)
    infos: list[StepInfo] = []
    for i, st in enumerate(trace.states):
        name, r, w = _action(st.action) if i else ("init", None, None)
        prev = states[i - 1] if i else None
        changes = [c for var in sorted(st.values) if prev is not None
                   for c in diff_values(var, prev.get(var), st.values[var])]  # fmt: skip
        events = _describe(name, r, w, prev, st.values, ranks)
        infos.append(StepInfo(i, name, r, w, tuple(changes), tuple(events)))
    n = len(states)
    loop = n - 1 if trace.loop_index is None and trace.stuttering else trace.loop_index
    loop = loop if loop is not None and 0 <= loop < n else None
    kind: FinalKind
    if loop is not None:
        kind, lines = "stuck", _stuck(states, infos, loop, ranks, topo)
    elif prop is not None and prop.startswith("Reach"):
        kind, lines = "end", [f"reached: {prop} (vacuity witness)"]
    else:
        found = _violation(states[-1], ranks, topo)
        head = f"violated: {prop}" if prop else "violated"
        kind = "violation"
        lines = [head + (": " + "; ".join(found) if found else " in the last state")]
    return Analysis(ranks, topo, tuple(infos), loop, trace.stuttering, kind, tuple(lines))
