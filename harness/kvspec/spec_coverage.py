"""How much of the spec matrix the conformance suite replays (issue #15, item 3).

`kvspec check` decides verdicts on the rows of spec/matrix.toml; the conformance suite
replays traces of the rows of conformance/matrix.toml (and the kept regressions). An edge
(state, action, state) of a spec row's graph is *covered* when some conformance trace of
a model with exactly the same constants (the name aside) takes it: only then is it the
same transition of the same model. Per design (variant + non-default reaper): edges of
every spec row with at most 2 requests, and how many the conformance traces cover. The
nightly `conform-spec-matrix` job generates traces of the spec rows themselves (every
edge), so what is reported here is what `make test`/`make review` replay.

`kvspec traces --spec-coverage [FILE]` prints the table and writes the JSON.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from kvspec.codec import from_itf
from kvspec.itf import JSON
from kvspec.matrix import ModelRow, design
from kvspec.model import Action, reachable
from kvspec.replay import SpecTrace
from kvspec.vocab import State

MAX_REQUESTS = 2
Edge = tuple[State, Action, State]


@dataclass(frozen=True)
class RowCoverage:
    row: str
    design: str
    edges: int
    covered: int

    def to_json(self) -> dict[str, JSON]:
        return {"row": self.row, "design": self.design, "edges": self.edges,
                "covered": self.covered}  # fmt: skip


def _shape(row: ModelRow) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(row.constants().items()))


def trace_edges(traces: Iterable[SpecTrace]) -> dict[tuple[tuple[str, str], ...], set[Edge]]:
    """The edges the traces take, keyed by their model's constants."""
    out: dict[tuple[tuple[str, str], ...], set[Edge]] = defaultdict(set)
    for t in traces:
        states = [from_itf(t.row, s) for s in t.states]
        out[_shape(t.row)].update(zip(states, t.actions, states[1:], strict=False))
    return out


def row_coverage(rows: Iterable[ModelRow], traces: Iterable[SpecTrace]) -> list[RowCoverage]:
    taken = trace_edges(traces)
    out = []
    for row in rows:
        if row.requests > MAX_REQUESTS:
            continue
        got = reachable(row)
        assert got is not None  # no cap
        edges = set(got[1])
        covered = len(edges & taken.get(_shape(row), set()))
        out.append(RowCoverage(row.name, design(row), len(edges), covered))
    return out


def by_design(cov: list[RowCoverage]) -> dict[str, tuple[int, int, int, int]]:
    """design -> (rows, rows fully covered, edges, edges covered)."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for c in cov:
        a = acc[c.design]
        a[0] += 1
        a[1] += c.covered == c.edges
        a[2] += c.edges
        a[3] += c.covered
    return {d: (a[0], a[1], a[2], a[3]) for d, a in sorted(acc.items())}
