"""Negative controls: deliberately broken drivers must fail `replay` on the committed
traces, with the right failure class. Without these, a green suite could mean a replay
that compares nothing.
"""

from __future__ import annotations

import pytest
from kvspec.drivers.base import MissingAction
from kvspec.drivers.broken import DropRankDriver, OffByOneDriver
from kvspec.drivers.reference import ReferenceDriver
from kvspec.matrix import ModelRow
from kvspec.model import Action
from kvspec.replay import (
    INCORRECT,
    MISSING,
    UNEXPECTED,
    ReplayResult,
    SpecTrace,
    load_trace,
    replay,
)
from kvspec.traces import trace_files

PCP2 = "conf-fixed-nixl-pcp2"  # fixed design, PCP=2: both ranks report every send


class RefusesHeartbeat(ReferenceDriver):
    """Cannot deliver heartbeats at all."""

    def heartbeat(self, r: int) -> None:
        raise MissingAction("no heartbeat path")


class WrongRankExpiry(ReferenceDriver):
    """Expires the lease on another rank than asked (when that one is possible)."""

    def lease_expire(self, r: int, w: int) -> None:
        for other in range(self.model.d.w):
            if other != w and Action("lease_expire", r, other) in self.enabled():
                self._do(Action("lease_expire", r, other))
                return
        self._do(Action("lease_expire", r, w))


class ExtraEnabled(ReferenceDriver):
    """Claims it can abort requests that already finished (the spec says no-op/not an action)."""

    def enabled(self) -> list[Action]:
        extra = [Action("abort", r) for r in range(1, self.row.requests + 1)]
        return sorted(set(super().enabled()) | set(extra))


def traces_of(model: str) -> list[SpecTrace]:
    return [load_trace(p) for p in trace_files() if p.parent.name == model]


def run_all(driver_cls: type[ReferenceDriver], traces: list[SpecTrace]) -> list[ReplayResult]:
    out = []
    for t in traces:
        with driver_cls(t.row) as d:
            out.append(replay(d, t))
    return out


@pytest.fixture(scope="module")
def pcp2() -> list[SpecTrace]:
    traces = traces_of(PCP2)
    assert traces, f"no traces for {PCP2}; is it in conformance/matrix.toml?"
    return traces


def test_positive_control_reference_conforms(pcp2: list[SpecTrace]) -> None:
    assert all(r.ok for r in run_all(ReferenceDriver, pcp2))


def test_dropped_rank_report_is_incorrect_state(pcp2: list[SpecTrace]) -> None:
    failures = [r.failure for r in run_all(DropRankDriver, pcp2) if r.failure]
    assert failures, "dropping a rank's report went unnoticed"
    assert {f.cls for f in failures} == {INCORRECT}
    # The first visible effect is the step's per-rank output, right at execute_model.
    assert all(f.action == "execute_model" and "steps" in f.diff for f in failures)


def test_aggregator_off_by_one_is_incorrect_state(pcp2: list[SpecTrace]) -> None:
    failures = [r.failure for r in run_all(OffByOneDriver, pcp2) if r.failure]
    assert failures, "an off-by-one aggregator count went unnoticed"
    assert {f.cls for f in failures} == {INCORRECT}
    assert all(f.action == "update_from_output" and "agg" in f.diff for f in failures)


def test_refused_action_is_missing_action(pcp2: list[SpecTrace]) -> None:
    results = run_all(RefusesHeartbeat, pcp2)
    hb = [r for r, t in zip(results, pcp2, strict=True)
          if any(a.name == "heartbeat" for a in t.actions)]  # fmt: skip
    assert hb and all(r.failure is not None and r.failure.cls == MISSING for r in hb)
    assert all(r.ok for r in results if r not in hb)


def test_other_transition_is_unexpected_action() -> None:
    # naive replicas: every PCP rank serves and holds a lease, so another rank exists.
    traces = traces_of("conf-naive-replicas-nixl-pcp2")
    failures = [r.failure for r in run_all(WrongRankExpiry, traces) if r.failure]
    assert failures and {f.cls for f in failures} == {UNEXPECTED}
    assert all(f.action.startswith("lease_expire") for f in failures)


def test_extra_enabled_is_unexpected_action(pcp2: list[SpecTrace]) -> None:
    failures = [r.failure for r in run_all(ExtraEnabled, pcp2) if r.failure]
    assert failures and {f.cls for f in failures} == {UNEXPECTED}
    assert all("forbids" in f.detail for f in failures)


def test_failure_message_names_class_step_and_replay(pcp2: list[SpecTrace]) -> None:
    from kvspec.replay import replay_command

    bad = next(r for r in run_all(OffByOneDriver, pcp2) if r.failure)
    assert bad.failure is not None
    text = bad.failure.format(bad.trace, replay_command(bad.trace))
    assert text.startswith(f"{bad.trace}: incorrect state at step {bad.failure.step}")
    assert "agg: expected" in text and "observed" in text
    assert f"test_trace[{bad.trace}]" in text


def test_row_roundtrip(pcp2: list[SpecTrace]) -> None:
    row: ModelRow = pcp2[0].row
    assert (row.variant, row.topology.pcp, row.requests) == ("fixed", 2, 1)
