"""kvspec.spec_coverage: a conformance trace covers a spec row's edge only when its model
has exactly the row's constants."""

from __future__ import annotations

from dataclasses import replace

from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from kvspec.replay import trace_from_actions
from kvspec.spec_coverage import by_design, row_coverage

ROW = ModelRow("spec-row", "fixed", "nixl", Topology(1, 1, 1), 1, 1, False)
STEPS = [Action.parse(a) for a in ["schedule", "execute_model", "update_from_output"] * 2]


def test_same_constants_cover_and_another_shape_does_not() -> None:
    same = trace_from_actions(replace(ROW, name="conf-row"), STEPS, "conf-row/0")
    (cov,) = row_coverage([ROW], [same])
    assert cov.covered == len(STEPS) and 0 < cov.covered < cov.edges
    # Negative control: the same actions on the async twin are other transitions.
    twin = replace(ROW, name="conf-async", async_scheduling=True)
    (cov2,) = row_coverage([ROW], [trace_from_actions(twin, STEPS, "conf-async/0")])
    assert cov2.covered == 0
    assert by_design([cov, cov2]) == {"fixed": (2, 0, 2 * cov.edges, len(STEPS))}
