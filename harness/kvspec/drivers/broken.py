"""Deliberately broken reference models: the negative controls.

Every bug-catching claim of the suite needs a control that must fail. Each function here
builds a model that breaks one accounting rule; tests prove that the TLC state-graph
comparison and the trace replay both catch them.
"""

from __future__ import annotations

from dataclasses import replace

from kvspec.drivers.reference import ReferenceDriver
from kvspec.matrix import ModelRow
from kvspec.model import Defs, Model, RankResult, State, Step, rank_step


def _drop_last_rank(d: Defs, s: State, w: int, m: Step) -> RankResult:
    res = rank_step(d, s, w, m)
    return replace(res, out=frozenset()) if w == d.w - 1 else res


def drop_last_rank_model(row: ModelRow) -> Model:
    """The last rank's finished_sending report never reaches the aggregator."""
    return Model(row, Defs.of(row, _drop_last_rank))


def off_by_one_model(row: ModelRow) -> Model:
    """The aggregator's expected count is one lower than get_finished_count implies."""
    d = Defs.of(row)
    return Model(row, replace(d, expected=d.expected - 1 or 1))


class DropRankDriver(ReferenceDriver):
    def make_model(self, row: ModelRow) -> Model:
        return drop_last_rank_model(row)


class OffByOneDriver(ReferenceDriver):
    def make_model(self, row: ModelRow) -> Model:
        return off_by_one_model(row)
