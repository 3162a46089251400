"""Counterexamples (ITF documents) as sequence diagrams and compact step lists.

Pure functions: an ITF trace of spec/KVCompletion.tla in, text out. ``analyze`` derives,
for every state, the action (from ``#meta.action``), its parameters (request ``r`` and rank
``w``, recovered from the diff with the previous state because TLC names only the
operator) and what the step looked like between the components; ``render_svg`` draws that
as a sequence diagram and ``render_steps`` as one text line per step.

Lanes, left to right: scheduler, aggregator, one lane per producer rank (PCP innermost:
pcp = w % PCP, tp = (w // PCP) % TP, pp = w // (PCP * TP)), consumer, offload. A lasso is
marked "loop back to step k"; the end of a lasso is summarised in a "stuck" box (which
request is stuck, the aggregator's remaining count and the ranks it still waits for) and
the end of a safety counterexample in a "violated" box.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any, Literal

JSON = Any

Tone = Literal["normal", "ok", "bad", "muted", "warn"]
EventKind = Literal["arrow", "box", "mark"]
FinalKind = Literal["stuck", "violation", "end"]

SCHEDULER = "scheduler"
AGGREGATOR = "aggregator"
CONSUMER = "consumer"
OFFLOAD = "offload"


def rank_lane(w: int) -> str:
    return f"rank:{w}"


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    pcp: int

    def coords(self, w: int) -> tuple[int, int, int]:
        """(tp, pp, pcp) of rank w."""
        return (w // self.pcp) % self.tp, w // (self.pcp * self.tp), w % self.pcp

    def label(self, w: int) -> str:
        tp, pp, pcp = self.coords(w)
        return f"tp{tp} pp{pp} pcp{pcp}"


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
    final: tuple[str, ...] = field(default_factory=tuple)

    @property
    def lanes(self) -> tuple[tuple[str, str], ...]:
        """(key, label) of every lane, left to right."""
        out = [(SCHEDULER, "scheduler"), (AGGREGATOR, "aggregator")]
        for w in self.ranks:
            sub = f" ({self.topology.label(w)})" if self.topology else ""
            out.append((rank_lane(w), f"rank {w}{sub}"))
        out += [(CONSUMER, "consumer (D)"), (OFFLOAD, "offload")]
        return tuple(out)

    def rank_name(self, w: int) -> str:
        return f"rank {w} ({self.topology.label(w)})" if self.topology else f"rank {w}"


# ---------------------------------------------------------------- ITF decoding


def _int(v: JSON) -> int:
    if isinstance(v, dict) and "#bigint" in v:
        return int(v["#bigint"])
    return int(v)


def _key(v: JSON) -> Any:
    if isinstance(v, dict) and "#bigint" in v:
        return int(v["#bigint"])
    if isinstance(v, dict) and "#unserializable" in v:
        return str(v["#unserializable"])
    return v if isinstance(v, int | str | bool) else repr(v)


def _fn(v: JSON) -> dict[Any, JSON]:
    """A function value: ITF arrays are sequences over 1..n, ``#map`` lists pairs."""
    if isinstance(v, list):
        return {i + 1: x for i, x in enumerate(v)}
    if isinstance(v, dict) and "#map" in v:
        return {_key(k): x for k, x in v["#map"]}
    if isinstance(v, dict) and "#tup" in v:
        return {i + 1: x for i, x in enumerate(v["#tup"])}
    if isinstance(v, dict):
        return {k: x for k, x in v.items() if not k.startswith("#")}
    return {}


def _set(v: JSON) -> frozenset[Any]:
    if isinstance(v, dict) and "#set" in v:
        return frozenset(_key(x) for x in v["#set"])
    if isinstance(v, list):
        return frozenset(_key(x) for x in v)
    return frozenset()


def fmt_value(v: JSON) -> str:
    """A compact TLA+-like rendering of an ITF value."""
    if isinstance(v, bool):
        return "TRUE" if v else "FALSE"
    if isinstance(v, int | str):
        return str(v)
    if isinstance(v, list):
        return "<<" + ", ".join(fmt_value(x) for x in v) + ">>"
    if isinstance(v, dict):
        if "#set" in v:
            return "{" + ", ".join(fmt_value(x) for x in v["#set"]) + "}"
        if "#bigint" in v:
            return str(v["#bigint"])
        if "#unserializable" in v:
            return str(v["#unserializable"])
        if "#tup" in v:
            return "<<" + ", ".join(fmt_value(x) for x in v["#tup"]) + ">>"
        if "#map" in v:
            return "(" + ", ".join(f"{fmt_value(k)}:{fmt_value(x)}" for k, x in v["#map"]) + ")"
        return "[" + ", ".join(f"{k}: {fmt_value(x)}" for k, x in v.items()) + "]"
    return repr(v)


def _fmt_set(s: frozenset[Any] | set[Any]) -> str:
    return "{" + ", ".join(str(x) for x in sorted(s, key=str)) + "}"


def diff_values(path: str, a: JSON, b: JSON) -> list[str]:
    """What changed from a to b, one compact string per changed leaf."""
    if a == b:
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if "#set" in a and "#set" in b:
            sa, sb = _set(a), _set(b)
            parts = []
            if sb - sa:
                parts.append("+" + _fmt_set(sb - sa))
            if sa - sb:
                parts.append("-" + _fmt_set(sa - sb))
            return [f"{path} {' '.join(parts)}"]
        if "#map" in a and "#map" in b:
            fa, fb = _fn(a), _fn(b)
            if fa.keys() == fb.keys():
                out: list[str] = []
                for k in fa:
                    out += diff_values(f"{path}[{k}]", fa[k], fb[k])
                return out
        elif not any(k.startswith("#") for k in (*a, *b)) and a.keys() == b.keys():
            out = []
            for k in sorted(a):
                out += diff_values(f"{path}.{k}", a[k], b[k])
            return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) == len(b):
            out = []
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                out += diff_values(f"{path}[{i + 1}]", x, y)
            return out
        if len(b) == len(a) + 1 and b[:-1] == a:
            return [f"{path} append {_fmt_appended(b[-1])}"]
        if len(b) == len(a) - 1 and b == a[1:]:
            return [f"{path} pop head"]
    return [f"{path}: {fmt_value(a)} -> {fmt_value(b)}"]


def _fmt_appended(v: JSON) -> str:
    """A new scheduler step record without its not-yet-meaningful output fields."""
    if isinstance(v, dict) and {"batch", "toSend", "notProc"} <= v.keys():
        return f"<batch {fmt_value(v['batch'])}, toSend {fmt_value(v['toSend'])}, " + (
            f"notProc {fmt_value(v['notProc'])}>"
        )
    return fmt_value(v)


# ---------------------------------------------------------------- analysis

_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\((.*)\))?\s*$")


def _parse_action(text: str) -> tuple[str, dict[str, int]]:
    """'abort' -> ('abort', {}); 'lease_expire(1, 0)' -> ('lease_expire', {'r': 1, 'w': 0})."""
    m = _CALL.match(text)
    if not m:
        return text, {}
    name, args = m.group(1), m.group(2)
    if not args:
        return name, {}
    params: dict[str, int] = {}
    for pos, item in enumerate(a.strip() for a in args.split(",") if a.strip()):
        k, sep, val = item.partition("=")
        key, raw = (k.strip(), val.strip()) if sep else (("r", "w")[min(pos, 1)], item)
        try:
            params[key] = int(raw)
        except ValueError:
            continue
    return name, params


def _topology(doc: Mapping[str, JSON], topology: Mapping[str, int] | None) -> Topology | None:
    src = topology
    if src is None:
        meta = doc.get("#meta", {})
        cand = meta.get("topology") if isinstance(meta, dict) else None
        src = cand if isinstance(cand, dict) else None
    if not src:
        return None
    try:
        return Topology(int(src["tp"]), int(src["pp"]), int(src["pcp"]))
    except (KeyError, TypeError, ValueError):
        return None


def _ranks(states: Sequence[Mapping[str, JSON]], topo: Topology | None) -> tuple[int, ...]:
    for var in ("toProcess", "lease", "notif", "store"):
        for st in states:
            if var in st:
                keys = _fn(st[var]).keys()
                if keys:
                    return tuple(sorted(_int(k) for k in keys))
    if topo:
        return tuple(range(topo.tp * topo.pp * topo.pcp))
    return (0,)


def _rank_sets(st: Mapping[str, JSON], var: str) -> dict[int, frozenset[Any]]:
    return {_int(k): _set(v) for k, v in _fn(st.get(var, {})).items()}


def _req_map(st: Mapping[str, JSON], var: str) -> dict[int, JSON]:
    return {_int(k): v for k, v in _fn(st.get(var, [])).items()}


def _rd(st: Mapping[str, JSON]) -> dict[tuple[int, int], str]:
    out: dict[tuple[int, int], str] = {}
    for r, per in _req_map(st, "rd").items():
        for w, s in _fn(per).items():
            out[(r, _int(w))] = str(s)
    return out


def _added(prev: Mapping[str, JSON], cur: Mapping[str, JSON], var: str) -> list[tuple[int, int]]:
    """(r, w) pairs newly in the per-rank set variable var."""
    a, b = _rank_sets(prev, var), _rank_sets(cur, var)
    return sorted((r, w) for w in b for r in b[w] - a.get(w, frozenset()))


def _removed(prev: Mapping[str, JSON], cur: Mapping[str, JSON], var: str) -> list[tuple[int, int]]:
    return _added(cur, prev, var)


def _steps(st: Mapping[str, JSON]) -> list[dict[str, JSON]]:
    raw = st.get("steps", [])
    return [x for x in _fn(raw).values() if isinstance(x, dict)]


def _reports(prev: Mapping[str, JSON], cur: Mapping[str, JSON]) -> dict[int, frozenset[Any]]:
    """finished_sending per rank of the step execute_model ran between prev and cur."""
    before, after = _steps(prev), _steps(cur)
    for x, y in zip(before, after, strict=False):
        if not x.get("ran") and y.get("ran"):
            return {_int(k): _set(v) for k, v in _fn(y.get("out", {})).items()}
    return {}


def _describe(
    action: str,
    params: dict[str, int],
    prev: Mapping[str, JSON] | None,
    cur: Mapping[str, JSON],
    ranks: tuple[int, ...],
) -> tuple[int | None, int | None, list[Event]]:
    """The step's parameters and diagram events, derived from the state diff."""
    r, w = params.get("r"), params.get("w")
    ev: list[Event] = []
    if prev is None:
        pub = sorted(_set(cur.get("published", {"#set": []})))
        text = f"init: handshakes published by ranks {_fmt_set(set(pub))}" if pub else "init"
        return None, None, [Event("box", SCHEDULER, SCHEDULER, text, "muted")]
    req_a, req_b = _req_map(prev, "req"), _req_map(cur, "req")
    if action == "schedule":
        new = _steps(cur)[-1] if _steps(cur) else {}
        parts = []
        for key, name in (("batch", "admit"), ("toSend", "to_send"), ("notProc", "not_processed")):
            s = _set(new.get(key, {"#set": []}))
            if s:
                parts.append(f"{name} {_fmt_set(s)}")
        ev.append(Event("box", SCHEDULER, SCHEDULER, "schedule: " + ("; ".join(parts) or "empty")))
    elif action == "execute_model":
        out = _reports(prev, cur)
        for rank in ranks:
            got = out.get(rank, frozenset())
            tone: Tone = "ok" if got else "muted"
            ev.append(
                Event(
                    "arrow", rank_lane(rank), AGGREGATOR, f"finished_sending {_fmt_set(got)}", tone
                )
            )
    elif action == "update_from_output":
        emits_a, emits_b = _req_map(prev, "emits"), _req_map(cur, "emits")
        agg_a, agg_b = _req_map(prev, "agg"), _req_map(cur, "agg")
        late_now = bool(cur.get("lateFinish")) and not bool(prev.get("lateFinish"))
        emitted = sorted(
            q
            for q in req_b
            if _int(emits_b.get(q, 0)) > _int(emits_a.get(q, 0))
            or (req_a.get(q) == "sending" and req_b.get(q) == "freed")
        )
        finishing = sorted(q for q in req_b if req_a.get(q) == "running" and req_b[q] == "sending")
        for q in emitted:
            if req_a.get(q) == "sending" and req_b.get(q) == "freed":
                ev.append(Event("arrow", AGGREGATOR, SCHEDULER, f"free {q}", "ok"))
            else:
                ev.append(Event("arrow", AGGREGATOR, SCHEDULER, f"late! {q} (not held)", "bad"))
        if late_now and not any(e.tone == "bad" for e in ev):
            ev.append(Event("arrow", AGGREGATOR, SCHEDULER, "late! finished_sending", "bad"))
        if not ev:
            ev.append(Event("arrow", AGGREGATOR, SCHEDULER, "finished_sending {}", "muted"))
        for q in sorted(agg_b):
            a, b = _int(agg_a.get(q, 0)), _int(agg_b[q])
            if a != b and q not in emitted:
                ev.append(
                    Event(
                        "box",
                        AGGREGATOR,
                        AGGREGATOR,
                        f"req {q}: remaining {a or 'new'} -> {b or 'none'}",
                    )
                )
        for q in finishing:
            ev.append(Event("box", SCHEDULER, SCHEDULER, f"req {q} finished: free delayed"))
        started = _added(prev, cur, "store")
        for q in sorted({rq for rq, _ in started}):
            on = sorted(rw for rq, rw in started if rq == q)
            ev.append(Event("arrow", SCHEDULER, OFFLOAD, f"store {q} on ranks {_fmt_set(set(on))}"))
        touched = sorted(
            {q for q in agg_b if agg_a.get(q) != agg_b[q]} | set(emitted) | set(finishing)
        )
        r = r if r is not None else (touched[0] if len(touched) == 1 else None)
    elif action == "abort":
        if r is None:
            r = next((q for q in req_b if req_a.get(q) != req_b[q] == "freed"), None)
        ev.append(
            Event("box", SCHEDULER, SCHEDULER, f"abort {r if r is not None else '?'}", "warn")
        )
    elif action in ("consumer_start_load_kv", "consumer_get_finished"):
        want = ("none", "inflight") if action == "consumer_start_load_kv" else ("inflight", "done")
        ra, rb = _rd(prev), _rd(cur)
        hit = next((k for k in rb if (ra.get(k), rb[k]) == want), None)
        if hit and (r is None or w is None):
            r, w = hit
        dst = rank_lane(w) if w is not None else CONSUMER
        text = f"READ {r}" if action == "consumer_start_load_kv" else f"notif {r}:1"
        ev.append(Event("arrow", CONSUMER, dst, text, "normal"))
    elif action == "heartbeat":
        if r is None:
            new_hb = _set(cur.get("hb", {})) - _set(prev.get("hb", {}))
            r = min(new_hb) if new_hb else None
        dst = rank_lane(ranks[0]) if ranks else CONSUMER
        ev.append(Event("arrow", CONSUMER, dst, f"HB:{r} (all ranks)"))
    elif action == "lease_expire":
        exp = _added(prev, cur, "expired")
        if exp and (r is None or w is None):
            r, w = exp[0]
        lane = rank_lane(w) if w is not None else SCHEDULER
        ev.append(Event("mark", lane, lane, f"lease {r} expired", "warn"))
    elif action == "store_complete":
        done = _removed(prev, cur, "store")
        if done and (r is None or w is None):
            r, w = done[0]
        lane = rank_lane(w) if w is not None else OFFLOAD
        ev.append(Event("box", lane, lane, f"offload: store {r} done", "ok"))
    else:
        ev.append(Event("box", SCHEDULER, SCHEDULER, action, "muted"))
    return r, w, ev


def _final(
    states: Sequence[Mapping[str, JSON]],
    steps: Sequence[StepInfo],
    loop: int | None,
    ranks: tuple[int, ...],
    topo: Topology | None,
    prop: str | None,
    rank_name: Any,
) -> tuple[FinalKind, list[str]]:
    last = states[-1]
    req = _req_map(last, "req")
    if loop is not None:
        cycle = states[loop:]
        lines = []
        for q in sorted(req):
            status = {str(_req_map(s, "req").get(q)) for s in cycle}
            if status == {"sending"}:
                agg = _int(_req_map(last, "agg").get(q, 0))
                reported: set[int] = set()
                for i in range(1, len(states)):
                    if steps[i].action == "execute_model":
                        rep = _reports(states[i - 1], states[i])
                        reported |= {x for x, got in rep.items() if q in got}
                waiting = [rank_name(x) for x in ranks if x not in reported]
                remaining = f"agg remaining={agg}" if agg else "agg: no entry"
                lines.append(
                    f"stuck: req {q} sending, {remaining}, waiting: [{', '.join(waiting)}]"
                )
            elif status == {"waiting"}:
                holding = sorted(x for x, s in req.items() if s in ("running", "sending"))
                lines.append(f"stuck: req {q} waiting, KV full (held by {_fmt_set(set(holding))})")
        if not lines:
            lines.append(f"stuck: the loop from step {loop} repeats forever")
        return "stuck", lines
    if prop is not None and prop.startswith("Reach"):
        return "end", [f"reached: {prop} (vacuity witness)"]
    found = []
    rd = _rd(last)
    store = _rank_sets(last, "store")
    for q, s in sorted(req.items()):
        if s != "freed":
            continue
        for w in ranks:
            if rd.get((q, w)) == "inflight":
                found.append(f"req {q} freed while READ in flight on {rank_name(w)}")
            if q in store.get(w, frozenset()):
                found.append(f"req {q} freed while offload store in flight on {rank_name(w)}")
    if last.get("lateFinish") is True:
        found.append("scheduler got finished_sending for a request it no longer holds")
    for q, n in sorted(_req_map(last, "emits").items()):
        if _int(n) > 1:
            found.append(f"req {q} emitted {_int(n)} times")
    if topo is not None:
        pub = sorted(_set(last.get("published", {"#set": []})))
        seen: dict[tuple[int, int], int] = {}
        for w in pub:
            tp, pp, _ = topo.coords(int(w))
            if (tp, pp) in seen:
                found.append(f"ranks {seen[(tp, pp)]} and {w} publish handshake (tp{tp}, pp{pp})")
            seen[(tp, pp)] = int(w)
    head = f"violated: {prop}" if prop else "violated"
    return "violation", [head + (": " + "; ".join(found) if found else " in the last state")]


def analyze(
    doc: Mapping[str, JSON],
    *,
    topology: Mapping[str, int] | None = None,
    prop: str | None = None,
) -> Analysis:
    """Derive every step's action, parameters, changes and diagram events from an ITF doc."""
    states = doc.get("states")
    if not isinstance(states, list) or not states:
        raise ValueError("not an ITF trace: no 'states' list")
    topo = _topology(doc, topology)
    meta0 = doc.get("#meta")
    if prop is None and isinstance(meta0, dict) and isinstance(meta0.get("property"), str):
        prop = meta0["property"]
    ranks = _ranks(states, topo)
    infos: list[StepInfo] = []
    prev: Mapping[str, JSON] | None = None
    for i, st in enumerate(states):
        meta = st.get("#meta", {}) if isinstance(st, dict) else {}
        raw = str(meta.get("action", "")) or ("init" if i == 0 else "?")
        name, params = _parse_action(raw)
        if i == 0:
            name = "init"
        r, w, events = _describe(name, params, prev, st, ranks)
        changes: list[str] = []
        if prev is not None:
            for var in sorted(k for k in st if not k.startswith("#")):
                changes += diff_values(var, prev.get(var), st[var])
        infos.append(StepInfo(i, name, r, w, tuple(changes), tuple(events)))
        prev = st
    loop_raw = doc.get("loop")
    loop = int(loop_raw) if isinstance(loop_raw, int) and 0 <= loop_raw < len(states) else None
    meta = doc.get("#meta", {})
    stuttering = bool(meta.get("stuttering")) if isinstance(meta, dict) else False
    a = Analysis(ranks, topo, tuple(infos), loop, stuttering, "end")
    kind, lines = _final(states, infos, loop, ranks, topo, prop, a.rank_name)
    return Analysis(ranks, topo, tuple(infos), loop, stuttering, kind, tuple(lines))


# ---------------------------------------------------------------- text


def render_steps(
    itf_doc: Mapping[str, JSON],
    *,
    topology: Mapping[str, int] | None = None,
    prop: str | None = None,
) -> list[str]:
    """One line per step (index, action, request, rank, what changed), then loop/final lines.

    Plain ASCII, no colour: usable in a console, Markdown code block or log.
    """
    a = analyze(itf_doc, topology=topology, prop=prop)
    lines = []
    for st in a.steps:
        r = "-" if st.r is None else str(st.r)
        w = "-" if st.w is None else str(st.w)
        what = "; ".join(st.changes) if st.changes else (st.events[0].text if st.events else "")
        mark = "*" if a.loop is not None and st.index == a.loop else " "
        lines.append(f"{mark}{st.index:>3} {st.action:<23} r={r:<2} w={w:<2} {what}")
    if a.loop is not None:
        if a.stuttering and a.loop == len(a.steps) - 1:
            lines.append(f"     (stutters forever at step {a.loop})")
        else:
            lines.append(f"     (loop back to step {a.loop})")
    lines += [f"     {x}" for x in a.final]
    return lines


# ---------------------------------------------------------------- SVG

_FONT = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace"
_CHAR_W = 6.6  # px per character at font-size 11
_LANE_W = 170
_LEFT = 210  # step labels and the loop bracket
_TOP = 56
_LINE_H = 20
_PAD = 8
_COLORS: dict[Tone, tuple[str, str, str]] = {  # stroke, fill, text
    "normal": ("#1f4e8c", "#e8f0fb", "#123"),
    "ok": ("#2e7d32", "#e8f5e9", "#1b4d1e"),
    "bad": ("#c62828", "#fdecea", "#8e1b1b"),
    "muted": ("#8a8f98", "#f3f4f6", "#555"),
    "warn": ("#b26a00", "#fff4e0", "#6b4000"),
}


def _text_w(text: str) -> float:
    return len(text) * _CHAR_W + 12


def _t(
    x: float,
    y: float,
    text: str,
    *,
    anchor: str = "middle",
    color: str = "#123",
    size: int = 11,
    weight: str = "normal",
    cls: str = "",
) -> str:
    c = f' class="{cls}"' if cls else ""
    return (
        f'<text{c} x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
        f'font-weight="{weight}" fill="{color}" style="{_FONT}">{escape(text)}</text>'
    )


def render_svg(
    itf_doc: Mapping[str, JSON],
    *,
    topology: Mapping[str, int] | None = None,
    prop: str | None = None,
    title: str | None = None,
    standalone: bool = True,
) -> str:
    """The counterexample as an SVG sequence diagram.

    Structure (stable, tests rely on it): one ``<g class="lane" data-lane=KEY>`` per lane,
    one ``<g class="step" data-step=i data-action=NAME>`` per state (the initial state
    included), ``<g class="loop-marker" data-loop=k>`` for lassos and
    ``<g class="final-marker stuck-marker|violation-marker">`` at the end.
    ``standalone=False`` omits the XML namespace (for inline SVG in HTML).
    """
    a = analyze(itf_doc, topology=topology, prop=prop)
    top_y = _TOP if title else 12
    lanes = a.lanes
    lane_x = {key: _LEFT + _LANE_W * (i + 0.5) for i, (key, _) in enumerate(lanes)}
    width = _LEFT + _LANE_W * len(lanes) + 20
    final_w = max([_LANE_W * len(lanes) - 20] + [_text_w(x) + 20 for x in a.final])
    width = max(width, int(_LEFT + 30 + final_w))
    body: list[str] = []
    y = top_y + 34
    row_spans: dict[int, tuple[float, float]] = {}
    for st in a.steps:
        n = max(1, len(st.events))
        h = n * _LINE_H + 2 * _PAD
        row_spans[st.index] = (y, y + h)
        shade = "#fafbfc" if st.index % 2 else "#ffffff"
        tip = escape(f"{st.index} {st.label}: " + ("; ".join(st.changes) or "no change"))
        parts = [
            f'<g class="step" data-step="{st.index}" data-action="{escape(st.action)}">',
            f"<title>{tip}</title>",
            f'<rect class="row-bg" x="0" y="{y:.1f}" width="{width}" height="{h}" fill="{shade}"/>',
            _t(8, y + _PAD + 14, f"{st.index:>2}", anchor="start", color="#888"),
            _t(30, y + _PAD + 14, st.label, anchor="start", weight="bold", color="#333"),
        ]
        for j, e in enumerate(st.events):
            cy = y + _PAD + j * _LINE_H + _LINE_H / 2 + 2
            stroke, fill, color = _COLORS[e.tone]
            x1, x2 = lane_x.get(e.src, lane_x[SCHEDULER]), lane_x.get(e.dst, lane_x[SCHEDULER])
            if e.kind == "arrow" and x1 != x2:
                d = 1 if x2 > x1 else -1
                tip_x = x2 - d * 3
                parts.append(
                    f'<line class="arrow" x1="{x1:.1f}" y1="{cy + 4:.1f}" x2="{tip_x:.1f}" '
                    f'y2="{cy + 4:.1f}" stroke="{stroke}" stroke-width="1.6"/>'
                )
                parts.append(
                    f'<polygon points="{x2 - d * 10:.1f},{cy:.1f} {x2:.1f},{cy + 4:.1f} '
                    f'{x2 - d * 10:.1f},{cy + 8:.1f}" fill="{stroke}"/>'
                )
                if e.src == CONSUMER and e.text.startswith("HB:"):
                    for w in a.ranks:
                        parts.append(
                            f'<circle cx="{lane_x[rank_lane(w)]:.1f}" cy="{cy + 4:.1f}" r="3" '
                            f'fill="{stroke}"/>'
                        )
                parts.append(_t((x1 + x2) / 2, cy, e.text, color=color))
            elif e.kind == "mark":
                x = x1
                parts.append(
                    f'<polygon class="mark" points="{x:.1f},{cy - 4:.1f} {x + 7:.1f},{cy + 3:.1f} '
                    f'{x:.1f},{cy + 10:.1f} {x - 7:.1f},{cy + 3:.1f}" fill="{stroke}"/>'
                )
                parts.append(_t(x + 12, cy + 7, e.text, anchor="start", color=color))
            else:
                bw = _text_w(e.text)
                bx = x1 - bw / 2 if e.src != SCHEDULER else max(x1 - bw / 2, _LEFT - 2)
                parts.append(
                    f'<rect class="box" x="{bx:.1f}" y="{cy - 7:.1f}" width="{bw:.1f}" '
                    f'height="17" rx="3" fill="{fill}" stroke="{stroke}"/>'
                )
                parts.append(_t(bx + bw / 2, cy + 5, e.text, color=color))
        parts.append("</g>")
        body.append("".join(parts))
        y += h
    bottom = y
    if a.loop is not None:
        ly0, _ = row_spans[a.loop]
        lx = _LEFT - 14
        stutter = a.stuttering and a.loop == len(a.steps) - 1
        label = f"stutters forever at step {a.loop}" if stutter else f"loop back to step {a.loop}"
        body.append(
            f'<g class="loop-marker" data-loop="{a.loop}">'
            f'<rect x="0" y="{ly0:.1f}" width="{width}" height="{bottom - ly0:.1f}" '
            f'fill="#7b1fa2" fill-opacity="0.05"/>'
            f'<path d="M {lx + 10} {bottom - 4:.1f} H {lx} V {ly0 + 6:.1f} H {lx + 6}" '
            f'fill="none" stroke="#7b1fa2" stroke-width="2"/>'
            f'<polygon points="{lx + 4},{ly0 + 1:.1f} {lx + 13},{ly0 + 6:.1f} '
            f'{lx + 4},{ly0 + 11:.1f}" fill="#7b1fa2"/>'
            + _t(lx - 4, bottom - 6, label, anchor="end", color="#7b1fa2", weight="bold")
            + "</g>"
        )
    fy = bottom + 10
    if a.final:
        kind_cls = {"stuck": "stuck-marker", "violation": "violation-marker", "end": "end-marker"}
        tone: Tone = "muted" if a.final_kind == "end" else "bad"
        stroke, fill, color = _COLORS[tone]
        fh = len(a.final) * _LINE_H + 10
        fw = final_w
        parts = [
            f'<g class="final-marker {kind_cls[a.final_kind]}">',
            f'<rect x="{_LEFT + 10}" y="{fy:.1f}" width="{fw:.1f}" height="{fh}" rx="4" '
            f'fill="{fill}" stroke="{stroke}" stroke-width="2"/>',
        ]
        for j, line in enumerate(a.final):
            parts.append(
                _t(
                    _LEFT + 22,
                    fy + 20 + j * _LINE_H,
                    line,
                    anchor="start",
                    color=color,
                    weight="bold",
                    size=12,
                )
            )
        parts.append("</g>")
        body.append("".join(parts))
        fy += fh
    height = int(fy + 16)
    head: list[str] = []
    for key, label in lanes:
        x = lane_x[key]
        bw = min(_LANE_W - 10, _text_w(label))
        head.append(
            f'<g class="lane" data-lane="{escape(key)}">'
            f'<line x1="{x:.1f}" y1="{top_y + 26}" x2="{x:.1f}" y2="{bottom:.1f}" '
            f'stroke="#b0b6bf" stroke-dasharray="4 3"/>'
            f'<rect x="{x - bw / 2:.1f}" y="{top_y}" width="{bw:.1f}" height="24" rx="4" '
            f'fill="#263238"/>' + _t(x, top_y + 16, label, color="#fff", size=10) + "</g>"
        )
    top = _t(8, 22, title, anchor="start", size=14, weight="bold", color="#222") if title else ""
    ns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    return (
        f'<svg{ns} class="seqdiag" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
        f'<rect width="{width}" height="{height}" fill="#fff"/>'
        + top
        + "".join(body)
        + "".join(head)
        + "</svg>"
    )
