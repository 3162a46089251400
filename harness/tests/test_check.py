"""`kvspec check`: run planning and scheduling (the matrix verdicts are `make test`'s fast tier)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from kvspec.check import check_row, estimated_cost, run_check
from kvspec.matrix import TEMPORAL, ModelRow, Topology, load_matrix
from kvspec.tlc import TLCResult, Verdict


def test_rows_start_longest_first() -> None:
    rows = load_matrix()
    order = [r.name for r in sorted(rows, key=estimated_cost, reverse=True)]
    # The measured long pole (TP2 x PCP2 + delaying child, ~100 s of TLC) must start first,
    # the cheapest PCP=1 TP=1 synchronous NIXL rows last.
    assert order[0] == "pcp2-tp2-fixed-offload-delaying-sync"
    cheapest = {r.name for r in rows if estimated_cost(r) == min(map(estimated_cost, rows))}
    assert cheapest == {
        r.name
        for r in rows
        if r.name.startswith("pcp1-tp1-") and "offload" not in r.name and not r.async_scheduling
    }


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
    results = check_row(_row(TRUTH), tmp_path)
    assert {r.prop: r.verdict for r in results} == TRUTH
    logs = {r.prop: r.log_path for r in results}
    # TypeOK and both temporal properties come from the same (joint) TLC run.
    assert logs["TypeOK"] == logs["NoStall"] == logs["DelayedEventuallyFreed"]
    assert len(list((tmp_path / "joint" / "tlc").iterdir())) == 3  # joint + 2 safety runs


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


class Oracle:
    """A fake TLC runner that knows the answers: each invariant is violated iff the row
    expects it to be; temporal properties hold, or time out with `slow_temporal`. It
    records every run, so tests decide TLC's verdicts by construction, not by the clock."""

    def __init__(self, tmp: Path, slow_temporal: bool = False) -> None:
        self.log = tmp / "tlc.log"
        self.slow_temporal = slow_temporal
        self.runs: list[tuple[list[str], list[str]]] = []

    def __call__(
        self, row: ModelRow, invariants: list[str], properties: list[str], work: Path
    ) -> TLCResult:
        self.runs.append((list(invariants), list(properties)))
        if properties and self.slow_temporal:
            return self._result("timeout", error=f"TLC timed out after 600.0s; raw log: {self.log}")
        bad = [p for p in invariants if row.expect[p] == "violated"]
        return self._result("violated", bad[0]) if bad else self._result("holds")

    def _result(
        self, verdict: Verdict, prop: str | None = None, error: str | None = None
    ) -> TLCResult:
        return TLCResult(verdict, prop, None, 7, 9, 1.0, None, self.log, 0, error)


def test_joint_timeout_is_not_waited_for_twice(tmp_path: Path) -> None:
    # Checking the temporal properties alone costs at least what the timed-out joint run
    # did: they keep its timeout and only the invariants are decided again (one safety run
    # per violated invariant, as always).
    oracle = Oracle(tmp_path, slow_temporal=True)
    results = {r.prop: r.verdict for r in check_row(_row(TRUTH), tmp_path, oracle)}
    assert results == {p: "timeout" if p in TEMPORAL else v for p, v in TRUTH.items()}
    assert oracle.runs == [
        (["TypeOK"], ["DelayedEventuallyFreed", "NoStall"]),  # joint: times out
        (["TypeOK", "HandshakeIdentityUnique", "ReachSending"], []),
        (["TypeOK", "ReachSending"], []),
        (["TypeOK"], []),
    ]


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
