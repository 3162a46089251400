"""`kvspec check`: run planning and scheduling (the matrix verdicts are `make test`'s fast tier)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from kvspec.check import check_row, estimated_cost, run_check
from kvspec.matrix import TEMPORAL, ModelRow, Topology, load_matrix
from kvspec.tlc import TLCResult, Trace, Verdict


def test_rows_start_longest_first() -> None:
    rows = load_matrix()
    order = [r.name for r in sorted(rows, key=estimated_cost, reverse=True)]
    # The PCP2 delaying rows (W = 2, the costliest child, async) start first, the cheapest
    # PCP=1 TP=1 synchronous NIXL rows last.
    first = {"pcp2-v0.29-hf3fs", "pcp2-v0.30-shipped-hf3fs", "pcp2-tp1-fixed-hf3fs"}
    assert set(order[:3]) == first
    cheapest = {r.name for r in rows if estimated_cost(r) == min(map(estimated_cost, rows))}
    assert cheapest == {
        r.name
        for r in rows
        if r.name.startswith("pcp1-tp1-") and r.composition == "nixl" and not r.async_scheduling
    }


def test_child_compositions_cost_more_than_nixl() -> None:
    row = next(r for r in load_matrix() if r.name == "pcp1-tp1-fixed-nixl-sync")
    base = estimated_cost(row)
    for c in ("multi-nixl-offload-upstream", "multi-nixl-hf3fs"):
        assert estimated_cost(replace(row, composition=c)) > base


needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")


def _row(expect: dict[str, str]) -> ModelRow:
    # naive-replicas publishes a handshake identity per PCP replica: HandshakeIdentityUnique
    # fails from the initial state, everything else holds; one request keeps TLC fast.
    return ModelRow(
        name="joint",
        variant="naive-replicas",
        composition="nixl",
        topology=Topology(1, 1, 2),
        requests=1,
        capacity=1,
        async_scheduling=False,
        expect=expect,
    )


TRUTH = {
    "TypeOK": "holds",
    "HandshakeIdentityUnique": "violated",
    "DelayedEventuallyFreed": "holds",
    "NoStall": "holds",
    "ReachSending": "violated",
}


@needs_java
def test_joint_run_decides_what_holds_in_one_tlc_run(tmp_path: Path) -> None:
    results = {r.prop: r for r in check_row(_row(TRUTH), tmp_path)}
    assert {p: r.verdict for p, r in results.items()} == TRUTH
    logs = {p: r.log_path for p, r in results.items()}
    # TypeOK and both temporal properties come from the same (joint) TLC run.
    assert logs["TypeOK"] == logs["NoStall"] == logs["DelayedEventuallyFreed"]
    # Both violations from -continue runs, each with its counterexample. Every state
    # violates HandshakeIdentityUnique, which TLC names first, so ReachSending goes unnamed
    # in the first violations run and gets one of its own: 3 runs.
    assert all(results[p].counterexample for p in ("HandshakeIdentityUnique", "ReachSending"))
    assert len(list((tmp_path / "joint" / "tlc").iterdir())) == 3


@needs_java
def test_wrong_expectation_falls_back_and_reports_the_true_verdict(tmp_path: Path) -> None:
    # Negative control: expecting the violated invariant to hold makes the joint run fail;
    # every property must then be decided on its own and the violation still reported.
    wrong = {**TRUTH, "HandshakeIdentityUnique": "holds"}
    results = {r.prop: r for r in check_row(_row(wrong), tmp_path)}
    assert {p: r.verdict for p, r in results.items()} == TRUTH
    bad = results["HandshakeIdentityUnique"]
    assert not bad.ok and bad.counterexample is not None
    assert [p for p, r in results.items() if not r.ok] == ["HandshakeIdentityUnique"]


Run = tuple[list[str], list[str], bool]  # invariants, temporal properties, every_violation


class Oracle:
    """A fake TLC runner that knows the answers (`truth`, default the row's expectations)
    and plays TLC's rules: without -continue a run stops at the first violation; under it
    each violated invariant is named unless it is in `masked` and listed after its masker;
    a temporal violation is found in the complete graph unless `partial`; `slow` run kinds
    ("temporal", "violations") time out. It records every run, so tests decide TLC's
    verdicts by construction, not by the clock."""

    def __init__(
        self, tmp: Path, truth: dict[str, str] | None = None, slow: tuple[str, ...] = (),
        masked: dict[str, str] | None = None, partial: bool = False,
    ) -> None:  # fmt: skip
        self.log = tmp / "tlc.log"
        self.truth, self.slow, self.partial = truth, slow, partial
        self.masked = masked or {}
        self.runs: list[Run] = []

    def __call__(
        self, row: ModelRow, invariants: list[str], properties: list[str], work: Path,
        *, every_violation: bool = False,
    ) -> TLCResult:  # fmt: skip
        self.runs.append((list(invariants), list(properties), every_violation))
        truth = self.truth or row.expect
        if ("temporal" in self.slow and properties) or (
            "violations" in self.slow and every_violation
        ):
            return self._result("timeout", error=f"TLC timed out after 600.0s; raw log: {self.log}")
        bad = [p for p in invariants if truth[p] == "violated"]
        if every_violation:
            named = [p for p in bad if self.masked.get(p) not in invariants[: invariants.index(p)]]
            return (
                self._result("violated", named[0], {p: None for p in named})
                if bad
                else self._result("holds")
            )
        if bad:
            return self._result("violated", bad[0], {bad[0]: None})
        refuted = [p for p in properties if truth[p] == "violated"]
        if refuted:
            res = self._result("violated", refuted[0] if len(properties) == 1 else None)
            res.complete = not self.partial
            return res
        return self._result("holds")

    def _result(
        self, verdict: Verdict, prop: str | None = None,
        violations: dict[str, Trace | None] | None = None, error: str | None = None,
    ) -> TLCResult:  # fmt: skip
        return TLCResult(verdict, prop, None, 7, 9, 1.0, None, self.log, 0, error,
                         violations=violations or {}, complete=verdict == "holds")  # fmt: skip


def verdicts(row: ModelRow, tmp_path: Path, oracle: Oracle) -> dict[str, str]:
    return {r.prop: r.verdict for r in check_row(row, tmp_path, oracle)}


def test_expected_violations_take_one_run(tmp_path: Path) -> None:
    oracle = Oracle(tmp_path)
    assert verdicts(_row(TRUTH), tmp_path, oracle) == TRUTH
    assert oracle.runs == [
        (["TypeOK"], ["DelayedEventuallyFreed", "NoStall"], False),  # joint
        (["HandshakeIdentityUnique", "ReachSending"], [], True),  # -continue: both named
    ]


def test_an_invariant_tlc_did_not_name_gets_a_run_of_its_own(tmp_path: Path) -> None:
    oracle = Oracle(tmp_path, masked={"ReachSending": "HandshakeIdentityUnique"})
    assert verdicts(_row(TRUTH), tmp_path, oracle) == TRUTH
    assert oracle.runs[1:] == [
        (["HandshakeIdentityUnique", "ReachSending"], [], True),  # names the first only
        (["ReachSending"], [], True),
    ]


def test_expected_violation_that_holds_is_decided_by_tlc(tmp_path: Path) -> None:
    oracle = Oracle(tmp_path, truth={**TRUTH, "ReachSending": "holds"})
    results = {r.prop: r for r in check_row(_row(TRUTH), tmp_path, oracle)}
    assert results["ReachSending"].verdict == "holds" and not results["ReachSending"].ok
    assert oracle.runs[2:] == [(["ReachSending"], [], True)]  # after HIU was named alone


STALL = {**TRUTH, "HandshakeIdentityUnique": "holds", "ReachSending": "holds",
         "DelayedEventuallyFreed": "violated", "NoStall": "violated"}  # fmt: skip


def test_a_temporal_violation_in_the_complete_graph_carries_the_invariants(
    tmp_path: Path,
) -> None:
    oracle = Oracle(tmp_path)
    assert verdicts(_row(STALL), tmp_path, oracle) == STALL
    invariants = ["TypeOK", "HandshakeIdentityUnique", "ReachSending"]
    assert oracle.runs == [
        (invariants, ["DelayedEventuallyFreed"], False),  # all three hold, DEF violated
        ([], ["NoStall"], False),  # TLC does not name the refuted property: one each
    ]


def test_a_temporal_violation_in_a_partial_graph_decides_nothing(tmp_path: Path) -> None:
    # Found before the BFS was over (no -lncheck final, say): the invariants were not
    # checked everywhere, so everything is decided again the per-property way.
    oracle = Oracle(tmp_path, partial=True)
    assert verdicts(_row(STALL), tmp_path, oracle) == STALL
    assert oracle.runs[1:] == [
        (["TypeOK", "HandshakeIdentityUnique", "ReachSending"], [], False),
        ([], ["DelayedEventuallyFreed"], False),
        ([], ["NoStall"], False),
    ]


def test_joint_timeout_is_not_waited_for_twice(tmp_path: Path) -> None:
    # Checking the temporal properties alone costs at least what the joint run did: they
    # keep its timeout and only the invariants are decided again.
    oracle = Oracle(tmp_path, slow=("temporal",))
    results = verdicts(_row(TRUTH), tmp_path, oracle)
    assert results == {p: "timeout" if p in TEMPORAL else v for p, v in TRUTH.items()}
    assert oracle.runs == [
        (["TypeOK"], ["DelayedEventuallyFreed", "NoStall"], False),  # joint: times out
        (["TypeOK"], [], False),
        (["HandshakeIdentityUnique", "ReachSending"], [], True),
    ]


def test_a_timed_out_violations_run_is_no_verdict(tmp_path: Path) -> None:
    oracle = Oracle(tmp_path, slow=("violations",))
    results = verdicts(_row(TRUTH), tmp_path, oracle)
    assert results == {
        p: "timeout" if p in ("HandshakeIdentityUnique", "ReachSending") else v
        for p, v in TRUTH.items()
    }


def test_results_json_carries_the_row_and_what_report_reads(tmp_path: Path) -> None:
    row = _row(TRUTH)
    out = tmp_path / "results.json"
    run_check([row], json_out=out, out_dir=tmp_path, progress=False, run=Oracle(tmp_path))
    doc = json.loads(out.read_text())
    assert [r["property"] for r in doc["results"]] == [
        "TypeOK", "HandshakeIdentityUnique", "DelayedEventuallyFreed", "NoStall", "ReachSending"
    ]  # fmt: skip
    for res in doc["results"]:
        assert ModelRow.from_meta(res) == replace(row, expect={})
        # report.py reads these
        assert {"model", "property", "expected", "verdict", "counterexample", "topology",
                "variant", "composition", "distinct_states", "seconds", "async_scheduling",
                "error", "log"} <= res.keys()  # fmt: skip
        assert res["topology"] == {"tp": 1, "pp": 1, "pcp": 2}


def test_row_meta_round_trip() -> None:
    for row in load_matrix():
        meta = row.to_meta()
        assert json.loads(json.dumps(meta)) == meta
        assert ModelRow.from_meta(meta) == replace(row, expect={}, tier="default")


def test_rank_coords_follow_the_spec_layout() -> None:
    # KVCompletion.tla, as vLLM numbers ranks (TP innermost): TpOf(w) == w % TP,
    # PcpOf(w) == (w \div TP) % PCP, PpOf(w) == w \div (TP * PCP); the driver builds
    # worker w at these coordinates.
    topo = Topology(tp=2, pp=2, pcp=3)
    coords = [topo.rank_coords(w) for w in range(topo.world_size)]
    assert all(((c.pp * 3) + c.pcp) * 2 + c.tp == w for w, c in enumerate(coords))
    assert [c.tp for c in coords[:4]] == [0, 1, 0, 1]
    assert [c.pcp for c in coords[:7]] == [0, 0, 1, 1, 2, 2, 0]
    assert coords[6] == (1, 0, 0) and coords[11] == (1, 1, 2)  # (pp, tp, pcp)
