"""Deliberately broken reference models: the negative controls.

Every bug-catching claim of the suite needs a control that must fail. These subclasses of
the reference model each break one accounting rule; tests prove that the TLC state-graph
comparison and the trace replay both catch them.
"""

from __future__ import annotations

from kvspec.drivers.reference import Model, Params, RankResult, State, Step


class DropLastRankModel(Model):
    """The last rank's finished_sending report never reaches the aggregator."""

    def rank_step(self, p: Params, s: State, w: int, m: Step) -> RankResult:
        res = super().rank_step(p, s, w, m)
        if w == p.w - 1:
            return RankResult(res.toProcess, res.lease, res.expired, res.replQ, res.extra,
                              frozenset())  # fmt: skip
        return res
