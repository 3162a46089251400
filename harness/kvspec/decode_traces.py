"""Decode.tla's conformance traces and their replay on a driver.

Traces: TLC dumps a row's whole state graph (`-dump dot,actionlabels`, kvspec.statgraph);
every edge's action instance is recovered from the two states it joins (`action_of`: TLC
2.15 labels an edge with the operator name only); kvspec.cover picks paths from the initial
state that cover every edge. Deterministic: the graph is TLC's, the order is sorted.

Replay (`replay`): each step's action runs on the driver, then the driver's observation
(the spec's variables as vLLM holds them, `DecodeDriver.observe`) must equal the trace's
state on every variable it observes. A WaitTimeout is inconclusive, never a verdict.

Conformance rows: conformance/decode.toml (the decode-matrix schema).
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.cover import cover_edges
from kvspec.decode import DECODE
from kvspec.drivers.base import MissingAction, WaitTimeout
from kvspec.replay import retry_expired
from kvspec.statgraph import DotError, parse_dot
from kvspec.sweep import SweepRow, load_sweep_matrix
from kvspec.tlc import run_tlc
from kvspec.tlcvalue import Fn, Record, Value
from kvspec.tools import QUICK_JVM

REPO = Path(__file__).resolve().parents[2]
CONFORM = REPO / "conformance" / "decode.toml"
MAX_LEN = 40
HOP = 4
State = dict[str, Any]  # variable -> plain Python value (`plain`)
Trace = list[tuple[str, State]]  # (action, state after it); the first action is "init"


def plain(v: Value) -> Any:
    """A TLC value as dicts, frozensets and scalars: sequences (TLC prints a function on
    1..n as one) become dicts keyed 1..n, so they compare with the driver's maps."""
    if isinstance(v, tuple):
        return {i: plain(x) for i, x in enumerate(v, start=1)}
    if isinstance(v, Fn):
        return {k: plain(x) for k, x in v.pairs}
    if isinstance(v, Record):
        return {k: plain(x) for k, x in v.fields}
    if isinstance(v, frozenset):  # a tuple inside a set stays a (hashable) tuple
        return frozenset(tuple(plain(y) for y in x) if isinstance(x, tuple) else plain(x)
                         for x in v)  # fmt: skip
    return v


def _changed(a: State, b: State, var: str) -> list[tuple[Any, ...]]:
    """Index paths (up to three deep) where a[var] and b[var] differ."""
    out: list[tuple[Any, ...]] = []

    def walk(x: Any, y: Any, path: tuple[Any, ...]) -> None:
        if isinstance(x, dict) and isinstance(y, dict) and x.keys() == y.keys():
            for k in sorted(x):
                walk(x[k], y[k], (*path, k))
        elif isinstance(x, frozenset) and isinstance(y, frozenset):
            out.extend((*path, e) for e in sorted(x ^ y))
        elif x != y:
            out.append(path)

    walk(a[var], b[var], ())
    return out


def in_step_ends(a: State, b: State) -> list[str]:
    """The READs an `execute` step a -> b posted that ended before its poll (InStepEnd):
    "w.r.p.done|err" for one whose request still waits for another READ (its h shows the
    end), "w.r.all.done|err" for a request the step both read and reported (every READ
    of it by w ended; err if it is reported failed). Exact where a rank reads a request
    from one producer rank (P TP <= D TP, or MLA): the rows this is used for."""
    i = next(k for k, s in sorted(a["steps"].items()) if not s["ran"])
    step = b["steps"][i]
    out: list[str] = []
    for w, reqs in sorted(b["h"].items()):
        hfl = a.get("hfl", {}).get(w, frozenset())  # a failed handshake's: no READ posted
        for r, srcs in sorted(reqs.items()):
            if r in step["out"][w] and r not in a["xf"][w] and r not in hfl:
                out.append(f"{w}.{r}.all.{'err' if r in step['fail'][w] else 'done'}")
                continue
            out += [f"{w}.{r}.{p}.{now}" for p, now in sorted(srcs.items())
                    if a["h"][w][r][p] == "none" and now in ("done", "err")]  # fmt: skip
    return out


def action_of(name: str, a: State, b: State) -> str:
    """The action instance `name(...)` that takes state a to b."""
    if name == "execute":
        ends = in_step_ends(a, b)
        return f"execute({', '.join(ends)})" if ends else "execute"
    if name in ("schedule", "update"):
        return name
    if name in ("abort", "complete"):
        (r,) = {p[0] for p in _changed(a, b, "st")}
        return f"{name}({r})"
    if name == "child_send_done":
        ((r,),) = _changed(a, b, "sendDone")
        return f"{name}({r})"
    if name == "xfer_end":
        ((w, r, p),) = _changed(a, b, "h")
        return f"xfer_end({w}, {r}, {p}, {'TRUE' if b['h'][w][r][p] == 'done' else 'FALSE'})"
    if name == "deliver":
        ((p, r),) = _changed(a, b, "pin")
        return f"deliver({p}, {r})"
    if name in ("handshake_start", "handshake_done", "handshake_fail"):
        ((w,),) = _changed(a, b, "hsd")
        return f"{name}({w})"
    if name == "lease_expire":
        ((p, r),) = _changed(a, b, "pst")
        return f"lease_expire({p}, {r})"
    if name in ("push_write", "push_lost"):  # push rows: named, not driven (pull driver)
        ((w, r, p),) = _changed(a, b, "h")
        return f"{name}({w}, {r}, {p})"
    if name in ("watchdog", "watchdog_fail"):  # PushWatchdog, a proposal
        var = "hbOff" if name == "watchdog" else "hfl"
        (r,) = {x[-1] for x in _changed(a, b, var)}
        return f"{name}({r})"
    raise DotError(f"Decode.tla edge labelled {name!r}: unknown action")


def trace_from_counterexample(doc: dict[str, Any]) -> Trace:
    """A Decode.tla counterexample (ITF, `kvspec decode` writes one per violation) as a
    replayable trace: each step's action instance read off its state change."""
    from kvspec.itf import trace_from_itf

    t = trace_from_itf(doc)
    states = [{k: plain(v) for k, v in st.values.items()} for st in t.states]
    out: Trace = [("init", states[0])]
    for st, a, b in zip(t.states[1:], states, states[1:], strict=False):
        out.append((action_of(st.action.split(" ")[0], a, b), b))
    return out


def conform_rows(path: Path = CONFORM) -> list[SweepRow]:
    return load_sweep_matrix(DECODE, path)


def generate(row: SweepRow, work: Path, timeout_s: float = 300) -> list[Trace]:
    """Edge-covering traces of `row`'s whole graph (TLC's)."""
    work.mkdir(parents=True, exist_ok=True)
    spec = work / DECODE.spec.name
    spec.write_text(DECODE.spec.read_text())
    cfg = work / "Decode.cfg"
    cfg.write_text(row.cfg_text([], []))
    dot = work / "graph.dot"
    # Graphs small enough to cover edge by edge are seconds of TLC: C1 alone (QUICK_JVM).
    res = run_tlc(spec, cfg, deadlock=False, dump_dot=dot, log_dir=work, timeout_s=timeout_s,
                  jvm_flags=QUICK_JVM)  # fmt: skip
    if res.verdict != "holds":
        raise DotError(f"TLC on {row.name}: {res.verdict}: {res.error}; log {res.log_path}")
    g = parse_dot(dot.read_text())
    if len(g.initial) != 1:
        raise DotError(f"{row.name}: {len(g.initial)} initial states, want 1")
    states = {fp: {k: plain(v) for k, v in s.items()} for fp, s in g.states.items()}
    out: dict[int, list[tuple[str, int]]] = {fp: [] for fp in states}
    for src, name, dst in g.edges:
        if src == dst:  # the end (Done or a crash) stutters: not a step
            continue
        out[src].append((action_of(name, states[src], states[dst]), dst))
    for fp in out:
        out[fp].sort(key=lambda at: (at[0], repr(sorted(states[at[1]].items(), key=str))))
    (init,) = g.initial
    paths = cover_edges(init, out, max_len=MAX_LEN, hop=HOP)
    return [[("init", states[init]), *((a, states[t]) for _, a, t in p)] for p in paths]


_CALL = re.compile(r"^(\w+)(?:\((.*)\))?$")


def parse_action(text: str) -> tuple[str, list[Any]]:
    m = _CALL.match(text)
    if m is None:
        raise ValueError(f"not an action: {text!r}")
    args = [a.strip() for a in (m[2] or "").split(",") if a.strip()]
    return m[1], [a == "TRUE" if a in ("TRUE", "FALSE") else int(a) if a.isdigit() else a
                  for a in args]  # fmt: skip


OBSERVED = ("st", "fRecv", "fFail", "crashed", "steps", "cleanup", "reg", "xf", "h", "rem",
            "pin", "pst", "hsd", "rdy", "hfl", "abl")  # fmt: skip


def differences(seen: dict[str, object], want: State) -> list[str]:
    """The observed variables whose values differ ("name: real != spec"); a variable the
    trace lacks (a counterexample kept before the spec had it) or the release lacks (abl:
    _aborted_kv_loads, 0.34+) is not compared."""
    return [f"{v}: {seen[v]!r} != {want[v]!r}" for v in OBSERVED
            if v in want and v in seen and seen[v] != want[v]]  # fmt: skip


@dataclass
class Replay:
    steps: int  # steps that matched
    divergence: str | None = None
    timeout: str | None = None


def replay(trace: Trace, driver: Any) -> Replay:
    """Run `trace` on `driver` step by step; stop at the first divergence."""
    diff = differences(driver.observe(), trace[0][1])
    if diff:
        return Replay(0, f"init: {'; '.join(diff)}")
    for i, (act, want) in enumerate(trace[1:], start=1):
        name, args = parse_action(act)
        try:
            getattr(driver, name)(*args)
        except WaitTimeout as exc:
            return Replay(i - 1, timeout=f"step {i} ({act}): {exc}")
        except MissingAction as exc:
            return Replay(i - 1, f"step {i} ({act}): missing action: {exc}")
        diff = differences(driver.observe(), want)
        if diff:
            return Replay(i - 1, f"step {i} ({act}): {'; '.join(diff)}")
    return Replay(len(trace) - 1)


def driver_for(
    row: SweepRow, trace: Trace, device: str = "cpu", mla: str = "mla",
    prefix_caching: bool = False,
) -> Callable[[float], Any]:  # fmt: skip
    """A fresh decode driver for `trace` of `row`, each call, its waits scaled by the
    argument (default 1): the one way to build it for a trace, so a FullHit row always
    gets the trace's full hits (drivers/full_hit.py; built without them its full-hit
    requests would READ, a false divergence). `mla`: MLA rows' fixture, `prefix_caching`
    D's (DecodeDriver)."""
    from kvspec.drivers.decode_driver import DecodeDriver
    from kvspec.drivers.full_hit import full_hits
    from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

    hits = full_hits(trace)

    def make(wait_scale: float = 1.0) -> DecodeDriver:
        return DecodeDriver(row, device, waits=DEFAULT_WAITS.scaled(wait_scale),
                            full_hits=hits, mla=mla, prefix_caching=prefix_caching)  # fmt: skip

    return make


def replay_with_retry(trace: Trace, make: Callable[[float], Any], tries: int = 2) -> Replay:
    """Replay on fresh drivers (replay.retry_expired): a wait that expired, in set-up or a
    step, is retried with longer waits; still expired: a timeout (inconclusive)."""

    def once(wait_scale: float) -> Replay:
        try:
            with make(wait_scale) as d:
                return replay(trace, d)
        except WaitTimeout as exc:
            return Replay(0, timeout=str(exc))

    return retry_expired(once, tries)[0]


@dataclass
class DecodeRun:
    """The decode suite under one vLLM (shipped or mutated): the first trace that did not
    replay, and how (a divergence, a timeout: inconclusive, or a crash of vLLM)."""

    trace: str | None = None
    step: int | None = None
    divergence: str | None = None
    timeout: str | None = None
    crash: str | None = None


_GENERATED: dict[str, list[Trace]] = {}


def _generate_once(row: SweepRow, root: Path) -> list[Trace]:
    """`generate` in a TLC work folder of this process's own under `root`: two processes
    (make test's pytest workers) may generate the same row at once. The folder is removed
    once the traces are read, and kept when TLC fails (the error names its log)."""
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{row.name}-", dir=root))
    traces = generate(row, work)
    shutil.rmtree(work, ignore_errors=True)
    return traces


def suite(
    tier: str = "fast", only: frozenset[str] = frozenset()
) -> list[tuple[str, SweepRow, Trace]]:
    """(name, row, trace) for every conformance row of `tier` (fast: the fast rows only;
    `only`: these rows, whatever their tier), generated once per process (_generate_once)."""
    out: list[tuple[str, SweepRow, Trace]] = []
    for row in conform_rows():
        if (row.name not in only) if only else (tier == "fast" and row.tier != "fast"):
            continue
        if row.name not in _GENERATED:
            _GENERATED[row.name] = _generate_once(row, REPO / "build" / "decode-traces")
        out += [(f"{row.name}/{i:03d}", row, t) for i, t in enumerate(_GENERATED[row.name])]
    return out


def run_decode_regressions(device: str = "cpu", only: frozenset[str] = frozenset()) -> DecodeRun:
    """The decode traces (the fast tier, or the rows `only` names) on `device`, up to the
    first that does not replay. Of the fast tier, only the rows of the design the installed
    release implements: another release's rows diverge on unmutated code (0.32 at `reg` on
    the 0.29 rows), so a mutant "killed" there would be no kill at all."""
    from kvspec.conform import installed_vllm
    from kvspec.decode import release_design
    mine = release_design(installed_vllm())
    for name, row, trace in suite("fast", only):
        if not only and row.consts["Bug"] != mine:
            continue

        try:
            res = replay_with_retry(trace, driver_for(row, trace, device))
        except Exception as exc:  # vLLM raised out of an action: a crash
            return DecodeRun(name, crash=f"{type(exc).__name__}: {exc}")
        if res.divergence is not None:
            return DecodeRun(name, res.steps + 1, res.divergence)
        if res.timeout is not None:
            return DecodeRun(name, timeout=res.timeout)
    return DecodeRun()
