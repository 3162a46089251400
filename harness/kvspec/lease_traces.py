"""Edge-covering LeaseClock traces, replayed on vLLM's real lease code (issue #13).

`kvspec lease` decides the verdicts of spec/LeaseClock.tla; its counterexamples are kept
in conformance/lease/ and replayed (kvspec.lease_replay). This module does for the lease
clock what `kvspec traces` does for KVCompletion: TLC dumps a row's whole state graph
(`-dump dot,actionlabels`; LeaseClock has no Python reference model, so the graph is
TLC's own), the paths of `kvspec.cover.cover_edges` cover every edge of it, and each path
is an ITF document in the form of a TLC counterexample, so `lease_replay.replay_lease`
drives it on the real classes (real NIXL READs and notifications, real `_send_heartbeats`
/ `_handle_heartbeat`, the real reaper against a controlled `perf_counter`).

`kvspec lease --conform [--tier fast|full] [--only ROW]`: per row, edges, traces and
conforming / diverging / inconclusive counts; exit 1 on a divergence. Traces are generated
at run time (deterministic: TLC's graph, BFS order), never committed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvspec.cover import cover_edges
from kvspec.drivers.base import WaitTimeout
from kvspec.drivers.prefix_layout import ONE_BLOCK, Layout
from kvspec.itf import JSON, value_to_itf
from kvspec.lease_replay import LeaseReplay, replay_lease
from kvspec.replay import retry_expired
from kvspec.statgraph import DotError, StateGraph, parse_dot
from kvspec.sweep import Sweep, SweepRow
from kvspec.tlc import run_tlc
from kvspec.tools import QUICK_JVM

# Longest path and the BFS hop of cover_edges: lease rows are small (<= a few hundred
# states), so every edge is reachable well within this.
MAX_LEN = 200
TRACES = "traces.json"  # conform_row leaves the replayed traces here, under work/<row>/
HOP = 8


def lease_graph(sweep: Sweep, row: SweepRow, work: Path, timeout_s: float = 600) -> StateGraph:
    """TLC's state graph of one row (no properties, deadlock off: runs end)."""
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / f"{row.name}-graph.cfg"
    cfg.write_text(row.cfg_text([], []))
    dot = work / f"{row.name}.dot"
    res = run_tlc(
        sweep.spec, cfg, deadlock=False, dump_dot=dot, log_dir=work / "tlc",
        timeout_s=timeout_s, jvm_flags=QUICK_JVM,
    )  # fmt: skip
    if res.verdict != "holds":
        raise DotError(f"TLC on {row.name}: {res.verdict}: {res.error}; log {res.log_path}")
    return parse_dot(dot.read_text())


EdgePath = list[tuple[int, str, int]]


INIT = "init"  # the edge from the virtual root to an initial state (several of them)


def edge_paths(g: StateGraph) -> list[EdgePath]:
    """Paths from an initial state that together cover every edge of `g` (BFS order).
    With several initial states (e.g. every priority assignment) the cover starts from a
    virtual root with an INIT edge to each, so every initial state is some path's first;
    such a path begins with that edge (edge_traces drops it)."""
    if not g.initial:
        raise DotError("no initial state in the graph")
    out: dict[int, list[tuple[str, int]]] = {}
    for src, action, dst in _edges(g):
        out.setdefault(src, []).append((action, dst))
    if len(g.initial) == 1:
        return cover_edges(next(iter(g.initial)), out, max_len=MAX_LEN, hop=HOP)
    root = min(g.states) - 1  # no state's fingerprint
    out[root] = [(INIT, i) for i in sorted(g.initial)]
    return cover_edges(root, out, max_len=MAX_LEN + 1, hop=HOP)


def _start(g: StateGraph, path: EdgePath) -> tuple[int, EdgePath]:
    """(the path's initial state, its action edges)."""
    if path and path[0][1] == INIT and path[0][0] not in g.states:
        return path[0][2], path[1:]
    return next(iter(g.initial)), path


def edge_traces(
    g: StateGraph,
    row: SweepRow,
    pick: Callable[[int], bool] = lambda _n: True,
    paths: list[EdgePath] | None = None,
) -> list[dict[str, JSON]]:
    """ITF documents (TLC counterexample form: each state's #meta names the action that
    led to it) whose paths cover every edge of `g`; only the paths `pick` takes (by their
    index) are written out, so a sample of a big graph costs only the sample."""
    docs: list[dict[str, JSON]] = []
    for n, full in enumerate(edge_paths(g) if paths is None else paths):
        if not pick(n):
            continue
        init, path = _start(g, full)
        states: list[JSON] = [_state(g, init, 0, "init")]
        states += [_state(g, dst, i, action) for i, (_, action, dst) in enumerate(path, 1)]
        meta: dict[str, JSON] = {"row": row.name, "trace": n, "source": "kvspec lease --conform"}
        docs.append({"#meta": meta, "states": states})
    return docs


def _edges(g: StateGraph) -> list[tuple[int, str, int]]:
    r"""The graph's action edges: without the end-of-run stutter (`Finished /\ UNCHANGED
    vars`, a self-loop TLC labels with the name of `Next`)."""
    return sorted({(s, a, t) for s, a, t in g.edges if not (s == t and a == "Next")})


def _state(g: StateGraph, fp: int, index: int, action: str) -> dict[str, JSON]:
    doc: dict[str, JSON] = {"#meta": {"index": index, "action": action}}
    doc.update({k: value_to_itf(v) for k, v in sorted(g.states[fp].items())})
    return doc


@dataclass
class LeaseConformance:
    row: str
    edges: int
    traces: int
    conforming: int = 0
    inconclusive: list[str] = field(default_factory=list)
    divergences: list[str] = field(default_factory=list)
    not_driven: list[str] = field(default_factory=list)  # needs what the driver cannot do
    of: int = 0  # the row's edge-covering traces, when `traces` replayed a sample of them

    def record(self, name: str, divergence: str | None, timeout: str | None = None) -> None:
        """Count one trace: an expired wait is inconclusive, never a verdict."""
        if timeout:
            self.inconclusive.append(f"{name}: {timeout}")
        elif divergence is None:
            self.conforming += 1
        else:
            self.divergences.append(f"{name}: {divergence}")

    def summary(self) -> str:
        sample = f" (an even sample of {self.of})" if self.of > self.traces else ""
        return (
            f"{self.edges} edges, {self.traces} traces{sample}: {self.conforming} conform, "
            f"{len(self.divergences)} diverge, {len(self.inconclusive)} inconclusive"
            + (f", {len(self.not_driven)} not driven" if self.not_driven else "")
        )

    def to_json(self) -> dict[str, JSON]:
        return dict(asdict(self))


# (requests, wait scale, NotifFirst) -> a fresh lease driver whose waits are scaled (and
# which injects a notification overtaking its READ where the row allows one).
DriverFactory = Callable[[int, float, bool], Any]


def _replay_retrying(
    doc: dict[str, JSON], row: SweepRow, make_driver: DriverFactory, attempts: int
) -> LeaseReplay:
    """The replay on fresh drivers (replay.retry_expired); a wait that expired, in set-up
    or a step, is retried with longer waits; still expired: a timeout (inconclusive)."""
    notif_first = row.consts.get("NotifFirst") is True

    def once(wait_scale: float) -> LeaseReplay:
        try:
            with make_driver(row.requests, wait_scale, notif_first) as driver:
                return replay_lease(doc, driver)
        except WaitTimeout as exc:
            return LeaseReplay(0, None, str(exc))

    return retry_expired(once, attempts)[0]


def _vllm_lease_driver(
    requests: int, wait_scale: float = 1.0, notif_first: bool = False, layout: Layout = ONE_BLOCK
) -> Any:
    from kvspec.drivers.lease_driver import LeaseDriver
    from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

    waits = DEFAULT_WAITS.scaled(wait_scale)
    return LeaseDriver(requests, waits=waits, notif_first=notif_first, layout=layout)


def lease_driver_factory(layout: Layout = ONE_BLOCK) -> DriverFactory:
    """The real lease driver with P's prompts and prefix caching laid out as `layout`
    (drivers/prefix_layout.py)."""

    def make(requests: int, wait_scale: float = 1.0, notif_first: bool = False) -> Any:
        return _vllm_lease_driver(requests, wait_scale, notif_first, layout)

    return make


def conform_row(
    sweep: Sweep,
    row: SweepRow,
    work: Path,
    make_driver: DriverFactory = _vllm_lease_driver,
    attempts: int = 2,
    limit: int | None = None,
) -> LeaseConformance:
    """Replay every edge-covering trace of `row` (the first `limit`, shortest first, when
    given: make test's sample); a trace whose wait expired is retried (`attempts` in all),
    then counted inconclusive: never a divergence."""
    g = lease_graph(sweep, row, work / row.name)
    docs = edge_traces(g, row)[:limit]
    (work / row.name / TRACES).write_text(json.dumps(docs) + "\n")
    return replay_docs(row, len(_edges(g)), docs, make_driver, attempts)


def replay_docs(
    row: SweepRow,
    edges: int,
    docs: list[dict[str, JSON]],
    make_driver: DriverFactory = _vllm_lease_driver,
    attempts: int = 2,
) -> LeaseConformance:
    """Replay these traces of `row` (conform_row's second half)."""
    res = LeaseConformance(row.name, edges, len(docs))
    for doc in docs:
        name = f"{row.name}/{doc['#meta']['trace']}"
        got = _replay_retrying(doc, row, make_driver, attempts)
        res.record(name, None if got.timeout else got.divergence, got.timeout)
    return res
