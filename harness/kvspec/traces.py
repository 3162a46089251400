"""Conformance traces: paths of a model's state graph that together cover every edge.

Per model row (tier "default"):

1. The graph: the model's reachable graph (kvspec.model, with action parameters), or,
   for the cross-check `kvspec traces --tlc`, TLC's (`-dump dot`), each TLC edge's
   parameters recovered as the unique action instance of that name leading to its target.
   An edge no instance explains (or two do) is an error: model and spec disagree.
2. Selection, shortest first: edges are visited in BFS order of their source; an
   uncovered edge gets a trace = shortest path to its source + the edge, then the trace
   is extended greedily: take the first uncovered edge out of the current state, or walk
   (at most HOP steps, shortest) to the nearest state that has one, until none is near
   or the trace reaches MAX_LEN. Everything is ordered by BFS index and sorted actions,
   so output is deterministic.
3. Counterexamples `kvspec check` saved (build/check/<model>/*.itf.json) become
   regression traces on request; a lasso is unrolled once more around its loop and ends
   with `#meta.expect_quiescent`, the requests that must still be unfreed.

Where the files go and how they are pinned: kvspec.tracestore.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvspec.codec import from_values, to_itf
from kvspec.cover import bfs_order, cover_edges
from kvspec.itf import JSON, value_from_itf
from kvspec.matrix import ModelRow
from kvspec.model import Action, Model, State, initial_state, reachable
from kvspec.statgraph import StateGraph
from kvspec.tracestore import GENERATED, REGRESSIONS, ensure_generated, trace_paths

GENERATOR = "kvspec-traces/2"
STATE_CAP = 20_000
MAX_LEN = 40  # steps per trace: long enough to reach anything in small models
HOP = 4  # how far a trace may walk through covered edges to reach an uncovered one
LASSO_UNROLL = 1  # extra turns around a counterexample's loop

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
    order = bfs_order(init, ordered)
    return ModelGraph(row, init, order, {s: i for i, s in enumerate(order)}, ordered)


def graph_from_reference(row: ModelRow) -> ModelGraph:
    """The same graph from the model alone (no TLC)."""
    got = reachable(row)
    assert got is not None  # no cap
    return _model_graph(row, *got)


def _model_graph(row: ModelRow, states: list[State], edges: list[Edge]) -> ModelGraph:
    out: dict[State, list[tuple[Action, State]]] = {s: [] for s in states}
    for s, a, t in edges:
        out[s].append((a, t))
    order = bfs_order(states[0], out)
    return ModelGraph(row, states[0], order, {s: i for i, s in enumerate(order)}, out)


# ---------------------------------------------------------------- selection


def select_traces(g: ModelGraph) -> list[list[Edge]]:
    """Paths from init that together cover every edge, shortest first (kvspec.cover)."""
    return cover_edges(g.init, g.out, max_len=MAX_LEN, hop=HOP)


# ---------------------------------------------------------------- ITF documents


def _state_doc(row: ModelRow, i: int, action: str, s: State) -> dict[str, JSON]:
    item: dict[str, JSON] = {"#meta": {"index": i, "action": action}}
    item.update(to_itf(row, s))
    return item


def trace_doc(
    row: ModelRow, init: State, path: list[Edge], extra_meta: dict[str, JSON]
) -> dict[str, JSON]:
    states = [_state_doc(row, 0, "init", init)]
    states += [_state_doc(row, i, str(a), t) for i, (_, a, t) in enumerate(path, 1)]
    meta = {**row.to_meta(), "seed": 0, "generator": GENERATOR, **extra_meta}
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
            "source": f"kvspec check: {row.name}/{file.name}",
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


@dataclass(frozen=True)
class Coverage:
    """What one model's generated trace set covers (written beside it as COVERAGE)."""

    model: str
    variant: str
    edges: int = 0
    covered: int = 0
    actions: int = 0  # distinct action instances covered
    actions_total: int = 0
    traces: int = 0
    steps: int = 0
    skipped: str | None = None


COVERAGE = "COVERAGE.json"


def compact(doc: JSON) -> str:
    """Generated traces are read by programs only: compact, sorted, deterministic JSON."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def generate_row(row: ModelRow, cap: int = STATE_CAP) -> tuple[Coverage, dict[str, str]]:
    """The edge-covering trace set of one row from the model: coverage, file name -> text."""
    got = reachable(row, cap=cap)  # explored once: the cap is checked on the way
    if got is None:
        why = f"more than {cap} reachable states (raise the row's size limit to include it)"
        return Coverage(row.name, row.variant, skipped=why), {}
    g = _model_graph(row, *got)
    traces = select_traces(g)
    all_edges = g.edges
    covered = {e for t in traces for e in t}
    cov = Coverage(
        row.name, row.variant, len(all_edges), len(covered & set(all_edges)),
        len({a for _, a, _ in covered}), len({a for _, a, _ in all_edges}),
        len(traces), sum(len(t) for t in traces),
    )  # fmt: skip
    width = max(3, len(str(len(traces) - 1)))
    files: dict[str, str] = {}
    for i, path in enumerate(traces):
        extra = {
            "kind": "coverage",
            "coverage": {"edges_total": len(all_edges), "edges_covered": len(set(path))},
        }
        files[f"{i:0{width}d}.itf.json"] = compact(trace_doc(row, g.init, path, extra))
    return cov, files


def generate(rows: list[ModelRow]) -> list[tuple[ModelRow, dict[str, str]]]:
    """Every row's trace set plus its COVERAGE file (tracestore.ensure_generated's input)."""
    out: list[tuple[ModelRow, dict[str, str]]] = []
    for row in rows:
        cov, files = generate_row(row)
        files[COVERAGE] = json.dumps(cov.__dict__, sort_keys=True) + "\n"
        out.append((row, files))
    return out


def trace_files(variant: str | None = None) -> list[Path]:
    """The traces to replay: generated ones (regenerated first if stale) and the committed
    regressions, for one design variant or all."""
    ensure_generated(generate)
    return trace_paths(GENERATED, variant) + trace_paths(REGRESSIONS, variant)


def sample_per_model(paths: list[Path], n: int) -> list[Path]:
    """At most n generated traces of each model, evenly spread over its (BFS-ordered) set so
    short and long traces both stay; regressions (`cex-*`) always stay. Deterministic."""
    by_model: dict[Path, list[Path]] = {}
    for p in paths:
        by_model.setdefault(p.parent, []).append(p)
    out: list[Path] = []
    for group in by_model.values():
        gen = [p for p in group if not p.name.startswith("cex-")]
        keep = gen if len(gen) <= n else [gen[i * len(gen) // n] for i in range(n)]
        out += sorted(set(keep) | {p for p in group if p.name.startswith("cex-")})
    return out


def find_trace(name: str) -> Path:
    """The trace named `<model>/<stem>` (a pytest id), generated or a regression."""
    model, _, stem = name.partition("/")
    for p in trace_files():
        if p.parent.name == model and p.name == f"{stem}.itf.json":
            return p
    raise KeyError(f"no trace named {name!r}; `kvspec traces` lists the models")


def read_coverage(model_dir: Path) -> Coverage:
    return Coverage(**json.loads((model_dir / COVERAGE).read_text()))


_CFG_CONSTANT = re.compile(r"^\s+(\w+) = (.+)$", re.M)


def checked_constants(row: ModelRow, check_dir: Path) -> dict[str, str] | None:
    """The CONSTANTS `kvspec check` ran a row of this name with (read from a cfg it left
    beside the counterexamples), or None where there is none."""
    for cfg in sorted((check_dir / row.name).glob("*.cfg")):
        return dict(_CFG_CONSTANT.findall(cfg.read_text().split("SPECIFICATION")[0]))
    return None


def regression_docs(
    rows: list[ModelRow], check_dir: Path
) -> tuple[dict[Path, Mapping[str, JSON]], list[str]]:
    """Counterexamples `kvspec check` saved for these rows, as regression trace documents
    keyed by their path under conformance/regressions (`kvspec traces --save-regressions`),
    and one note per row skipped because the spec matrix's row of that name is another
    model (e.g. async there, synchronous here): its counterexamples are not paths here."""
    out: dict[Path, Mapping[str, JSON]] = {}
    notes: list[str] = []
    for row in rows:
        ran = checked_constants(row, check_dir)
        if ran is not None and ran != row.constants():
            diff = sorted(k for k in row.constants() if ran.get(k) != row.constants()[k])
            notes.append(f"{row.name}: checked with other constants ({', '.join(diff)}); skipped")
            continue
        for stem, doc in counterexample_docs(row, check_dir).items():
            out[REGRESSIONS / row.variant / row.name / f"{stem}.itf.json"] = doc
    return out, notes
