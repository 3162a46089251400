"""`kvspec traces`: conformance traces covering every reachable edge of each default model.

Pipeline per model row (tier "default"):

1. Size guard: explore the reference model with a state cap first (cheap), so a model too
   big to replay exhaustively is skipped with a reason instead of costing a TLC run.
2. TLC's state graph (`-dump dot`): the ground truth. TLC labels edges with the operator
   name only, so each edge's parameters are recovered with the reference model's
   `successors`: the unique action instance of that name whose successor is the edge's
   target. An edge no instance explains (or two do) is an error: the reference and the
   spec disagree, and harness/tests/test_reference_graph.py should be failing too.
3. Selection, shortest first: edges are visited in BFS order of their source; an
   uncovered edge gets a trace = shortest path to its source + the edge, then the trace
   is extended greedily: take the first uncovered edge out of the current state, or walk
   (at most HOP steps, shortest) to the nearest state that has one, until none is near
   or the trace reaches MAX_LEN. Everything is ordered by BFS index and sorted actions,
   so output is deterministic.
4. Counterexamples `kvspec check` saved (build/check/<model>/*.itf.json) are added as
   `cex-<stem>.itf.json`; a lasso is unrolled once more around its loop and ends with
   `#meta.expect_quiescent`, the requests that must still be unfreed. They are written
   only when build/check has them; `--check` leaves committed ones alone otherwise.

Files are ITF (kvspec.itf.dumps): byte-identical on regeneration, no timestamps.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.itf import dumps, value_from_itf, value_to_itf
from kvspec.matrix import MatrixError, ModelRow, load_matrix
from kvspec.model import (
    Action,
    Model,
    State,
    from_values,
    initial_state,
    reachable,
    to_values,
)
from kvspec.statgraph import DotError, StateGraph, tlc_state_graph

JSON = Any
GENERATOR = "kvspec-traces/1"
STATE_CAP = 20_000
MAX_LEN = 40  # steps per trace: long enough to reach anything in small models
HOP = 4  # how far a trace may walk through covered edges to reach an uncovered one
LASSO_UNROLL = 1  # extra turns around a counterexample's loop
REPO = Path(__file__).resolve().parents[2]
CONFORMANCE_MATRIX = REPO / "conformance" / "matrix.toml"
OUT_DIR = REPO / "conformance" / "traces"
CHECK_DIR = REPO / "build" / "check"

Edge = tuple[State, Action, State]


class TraceError(RuntimeError):
    """The TLC graph and the reference model disagree, or an input is malformed."""


@dataclass
class ModelGraph:
    """A model's reachable graph with parameterised edges, in a deterministic order."""

    row: ModelRow
    init: State
    order: list[State]  # BFS order from init (sorted actions)
    index: dict[State, int]
    out: dict[State, list[tuple[Action, State]]]  # sorted by action

    @property
    def edges(self) -> list[Edge]:
        return [(s, a, t) for s in self.order for a, t in self.out[s]]


def _bfs_order(init: State, out: dict[State, list[tuple[Action, State]]]) -> list[State]:
    order = [init]
    seen = {init}
    for s in order:  # the list grows while we iterate: BFS
        for _, t in out.get(s, []):
            if t not in seen:
                seen.add(t)
                order.append(t)
    return order


def graph_from_tlc(row: ModelRow, g: StateGraph) -> ModelGraph:
    """TLC's graph with every edge's parameters recovered by the reference model."""
    model = Model(row)
    states = {fp: from_values(row, v) for fp, v in g.states.items()}
    if len(g.initial) != 1:
        raise TraceError(f"{row.name}: TLC dump has {len(g.initial)} initial states, want 1")
    (init_fp,) = g.initial
    init = states[init_fp]
    if init != initial_state(row):
        raise TraceError(f"{row.name}: TLC's initial state differs from the reference Init")
    succ_cache: dict[State, list[tuple[Action, State]]] = {}
    out: dict[State, set[tuple[Action, State]]] = {s: set() for s in states.values()}
    for src_fp, name, dst_fp in g.edges:
        src, dst = states[src_fp], states[dst_fp]
        if src not in succ_cache:
            succ_cache[src] = model.successors(src)
        hits = [a for a, t in succ_cache[src] if a.name == name and t == dst]
        if len(hits) != 1:
            raise TraceError(
                f"{row.name}: TLC edge {name} explained by {len(hits)} reference actions "
                f"({', '.join(map(str, hits)) or 'none'}); run test_reference_graph.py"
            )
        out[src].add((hits[0], dst))
    ordered = {s: sorted(v, key=lambda at: at[0]) for s, v in out.items()}
    order = _bfs_order(init, ordered)
    return ModelGraph(row, init, order, {s: i for i, s in enumerate(order)}, ordered)


def graph_from_reference(row: ModelRow) -> ModelGraph:
    """The same graph from the reference alone (tests; no TLC)."""
    got = reachable(row)
    assert got is not None
    states, edges = got
    out: dict[State, list[tuple[Action, State]]] = {s: [] for s in states}
    for s, a, t in edges:
        out[s].append((a, t))
    order = _bfs_order(states[0], out)
    return ModelGraph(row, states[0], order, {s: i for i, s in enumerate(order)}, out)


# ---------------------------------------------------------------- selection


def _bfs_paths(g: ModelGraph) -> dict[State, tuple[State, Action] | None]:
    parent: dict[State, tuple[State, Action] | None] = {g.init: None}
    q = deque([g.init])
    while q:
        s = q.popleft()
        for a, t in g.out[s]:
            if t not in parent:
                parent[t] = (s, a)
                q.append(t)
    return parent


def _path_to(parent: dict[State, tuple[State, Action] | None], s: State) -> list[Edge]:
    path: list[Edge] = []
    while (p := parent[s]) is not None:
        path.append((p[0], p[1], s))
        s = p[0]
    return path[::-1]


def _walk_to_uncovered(g: ModelGraph, start: State, uncovered: set[Edge]) -> list[Edge]:
    """Shortest walk (<= HOP steps) from start to a state with an uncovered out-edge."""
    prev: dict[State, Edge | None] = {start: None}
    q = deque([(start, 0)])
    while q:
        s, d = q.popleft()
        if d and any((s, a, t) in uncovered for a, t in g.out[s]):
            walk: list[Edge] = []
            while (e := prev[s]) is not None:
                walk.append(e)
                s = e[0]
            return walk[::-1]
        if d == HOP:
            continue
        for a, t in g.out[s]:
            if t not in prev:
                prev[t] = (s, a, t)
                q.append((t, d + 1))
    return []


def select_traces(g: ModelGraph) -> list[list[Edge]]:
    """Paths from init that together cover every edge, shortest first."""
    parent = _bfs_paths(g)
    edges = g.edges  # BFS order of source, then action
    uncovered = set(edges)
    traces: list[list[Edge]] = []
    for e in edges:
        if e not in uncovered:
            continue
        path = [*_path_to(parent, e[0]), e]
        uncovered.difference_update(path)
        cur = e[2]
        while len(path) < MAX_LEN:
            nxt = next(((cur, a, t) for a, t in g.out[cur] if (cur, a, t) in uncovered), None)
            if nxt is not None:
                step = [nxt]
            else:
                step = _walk_to_uncovered(g, cur, uncovered)
                if not step or len(path) + len(step) >= MAX_LEN:
                    break
            path += step
            uncovered.difference_update(step)
            cur = path[-1][2]
        traces.append(path)
    return traces


# ---------------------------------------------------------------- ITF documents


def model_meta(row: ModelRow) -> dict[str, JSON]:
    t = row.topology
    return {
        "model": row.name,
        "variant": row.variant,
        "composition": row.composition,
        "topology": {"tp": t.tp, "pp": t.pp, "pcp": t.pcp},
        "requests": row.requests,
        "capacity": row.capacity,
        "async_scheduling": row.async_scheduling,
        "seed": 0,
        "generator": GENERATOR,
    }


def _state_doc(row: ModelRow, i: int, action: str, s: State) -> dict[str, JSON]:
    item: dict[str, JSON] = {"#meta": {"index": i, "action": action}}
    item.update({k: value_to_itf(v) for k, v in to_values(row, s).items()})
    return item


def trace_doc(
    row: ModelRow, init: State, path: list[Edge], extra_meta: dict[str, JSON]
) -> dict[str, JSON]:
    states = [_state_doc(row, 0, "init", init)]
    states += [_state_doc(row, i, str(a), t) for i, (_, a, t) in enumerate(path, 1)]
    meta = {**model_meta(row), **extra_meta}
    return {"#meta": meta, "vars": sorted(states[0].keys() - {"#meta"}), "states": states}


def counterexample_docs(row: ModelRow, check_dir: Path) -> dict[str, dict[str, JSON]]:
    """`cex-<stem>` -> trace doc for each counterexample `kvspec check` saved for row."""
    model = Model(row)
    out: dict[str, dict[str, JSON]] = {}
    for file in sorted((check_dir / row.name).glob("*.itf.json")):
        doc = json.loads(file.read_text())
        raw = [{k: value_from_itf(v) for k, v in st.items() if not k.startswith("#")}
               for st in doc.get("states", [])]  # fmt: skip
        if not raw:
            continue
        seq = [from_values(row, v) for v in raw]
        loop = doc.get("loop")
        stutter = bool(doc.get("#meta", {}).get("stuttering")) or loop == len(seq) - 1
        if isinstance(loop, int) and not stutter:
            # After the last state comes seq[loop] again: go round LASSO_UNROLL more times.
            seq = seq + seq[loop:] * LASSO_UNROLL + [seq[loop]]
        try:
            labels = model.label_path(seq)
        except ValueError as exc:
            raise TraceError(f"{file}: {exc}") from exc
        path: list[Edge] = [(s, a, t) for s, a, t in zip(seq, labels, seq[1:], strict=False)]
        stem = file.name.removesuffix(".itf.json")
        extra: dict[str, JSON] = {
            "kind": "counterexample",
            "source": f"build/check/{row.name}/{file.name}",
            "property": doc.get("#meta", {}).get("property", stem),
            "coverage": {"edges_total": 0, "edges_covered": len(set(path))},
        }
        if isinstance(loop, int):
            last = seq[-1]
            extra["expect_quiescent"] = [r for r in range(1, row.requests + 1)
                                         if last.req[r - 1] != "freed"]  # fmt: skip
        out[f"cex-{stem}"] = trace_doc(row, seq[0], path, extra)
    return out


# ---------------------------------------------------------------- generation


@dataclass
class ModelSummary:
    model: str
    edges: int = 0
    covered: int = 0
    actions: int = 0  # distinct action instances covered
    actions_total: int = 0
    traces: int = 0
    steps: int = 0
    seconds: float = 0.0
    skipped: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # file name -> text


def generate_model(
    row: ModelRow, workdir: Path, *, cap: int = STATE_CAP, check_dir: Path = CHECK_DIR
) -> ModelSummary:
    import time

    t0 = time.monotonic()
    summ = ModelSummary(row.name)
    if reachable(row, cap=cap) is None:
        summ.skipped = f"more than {cap} reachable states (raise --cap to include it)"
        return summ
    g = graph_from_tlc(row, tlc_state_graph(row, workdir / row.name))
    traces = select_traces(g)
    all_edges = g.edges
    covered = {e for t in traces for e in t}
    summ.edges, summ.covered = len(all_edges), len(covered & set(all_edges))
    summ.actions_total = len({a for _, a, _ in all_edges})
    summ.actions = len({a for _, a, _ in covered})
    summ.traces, summ.steps = len(traces), sum(len(t) for t in traces)
    width = max(3, len(str(len(traces) - 1)))
    for i, path in enumerate(traces):
        extra = {
            "kind": "coverage",
            "coverage": {"edges_total": len(all_edges), "edges_covered": len(set(path))},
        }
        summ.files[f"{i:0{width}d}.itf.json"] = dumps(trace_doc(row, g.init, path, extra))
    for stem, doc in counterexample_docs(row, check_dir).items():
        summ.files[f"{stem}.itf.json"] = dumps(doc)
    summ.seconds = time.monotonic() - t0
    return summ


def _write_model(out_dir: Path, summ: ModelSummary, keep_cex: bool) -> None:
    """Replace the model's directory content with summ.files (committed cex kept if asked)."""
    d = out_dir / summ.model
    d.mkdir(parents=True, exist_ok=True)
    for old in sorted(d.glob("*.itf.json")):
        if old.name not in summ.files and not (keep_cex and old.name.startswith("cex-")):
            old.unlink()
    for name, text in summ.files.items():
        p = d / name
        if not p.is_file() or p.read_text() != text:
            p.write_text(text)


def stale_files(out_dir: Path, summ: ModelSummary, keep_cex: bool) -> list[str]:
    """Files under out_dir/<model> that differ from, lack, or are not in a regeneration."""
    d = out_dir / summ.model
    have = {p.name: p for p in d.glob("*.itf.json")} if d.is_dir() else {}
    stale = [f"{summ.model}/{n} (missing)" for n in sorted(summ.files) if n not in have]
    stale += [f"{summ.model}/{n} (differs)" for n in sorted(summ.files)
              if n in have and have[n].read_text() != summ.files[n]]  # fmt: skip
    stale += [f"{summ.model}/{n} (no longer generated)" for n in sorted(have)
              if n not in summ.files and not (keep_cex and n.startswith("cex-"))]  # fmt: skip
    return stale


def _table(summaries: list[ModelSummary]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="conformance traces")
    for col in ("model", "reachable edges", "edges covered", "actions covered", "traces",
                "steps", "seconds"):  # fmt: skip
        t.add_column(col, justify="left" if col == "model" else "right")
    for s in summaries:
        if s.skipped:
            t.add_row(s.model, "-", "-", "-", "-", "-", "-", end_section=False)
            continue
        pct = 100.0 * s.covered / s.edges if s.edges else 100.0
        t.add_row(s.model, str(s.edges), f"{s.covered} ({pct:.0f}%)",
                  f"{s.actions}/{s.actions_total}", str(s.traces), str(s.steps),
                  f"{s.seconds:.1f}")  # fmt: skip
    Console(width=140).print(t)
    for s in summaries:
        if s.skipped:
            print(f"skipped {s.model}: {s.skipped}")


def run(args: argparse.Namespace) -> int:
    try:
        rows = [r for r in load_matrix(args.matrix) if r.tier == "default"]
    except MatrixError as exc:
        print(f"kvspec traces: {exc}", file=sys.stderr)
        return 2
    if args.only:
        rows = [r for r in rows if r.name == args.only]
        if not rows:
            print(f"kvspec traces: no default-tier model {args.only!r}", file=sys.stderr)
            return 2
    out_dir: Path = args.out
    work = Path(tempfile.mkdtemp(prefix="kvspec-traces-"))
    summaries: list[ModelSummary] = []
    stale: list[str] = []
    try:
        for row in rows:
            check_dir: Path = args.check_dir
            has_cex = (check_dir / row.name).is_dir()
            try:
                summ = generate_model(row, work, cap=args.cap, check_dir=check_dir)
            except (TraceError, DotError) as exc:
                print(f"kvspec traces: {row.name}: {exc}", file=sys.stderr)
                return 2
            summaries.append(summ)
            if summ.skipped:
                continue
            if args.check:
                stale += stale_files(out_dir, summ, keep_cex=not has_cex)
            else:
                _write_model(out_dir, summ, keep_cex=not has_cex)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _table(summaries)
    if args.json is not None:
        _write_json(args.json, summaries)
    if args.check and stale:
        print(f"{len(stale)} stale trace files under {out_dir}; run `kvspec traces`:")
        for s in stale:
            print(f"  {s}")
        return 1
    if args.check:
        print(f"traces under {out_dir} are up to date")
    return 0


def _write_json(path: Path, summaries: list[ModelSummary]) -> None:
    """Coverage per model, read by `kvspec review` (build/traces.json)."""
    import json

    models = {
        s.model: {
            "edges_total": s.edges,
            "edges_covered": s.covered,
            "actions_covered": s.actions,
            "actions_total": s.actions_total,
            "traces": s.traces,
            "steps": s.steps,
            "skipped": s.skipped,
        }
        for s in summaries
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"models": models}, indent=1, sort_keys=True) + "\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--matrix", type=Path, default=CONFORMANCE_MATRIX, help="matrix TOML")
    p.add_argument("--json", type=Path, default=None, help="write coverage JSON here")
    p.add_argument("--only", metavar="NAME", help="only this model row")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    p.add_argument(
        "--check", action="store_true", help="regenerate in memory; exit 1 listing stale files"
    )
    p.add_argument(
        "--cap", type=int, default=STATE_CAP, help=f"state cap per model (default {STATE_CAP})"
    )
    p.add_argument("--check-dir", type=Path, default=CHECK_DIR,
                   help="where `kvspec check` saved counterexamples (build/check)")  # fmt: skip
