"""`kvspec check`: run planning and scheduling (the matrix verdicts are `make test`'s fast tier)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kvspec.check import check_row, estimated_cost
from kvspec.matrix import ModelRow, Topology, load_matrix


def test_rows_start_longest_first() -> None:
    rows = load_matrix()
    order = [r.name for r in sorted(rows, key=estimated_cost, reverse=True)]
    # The measured long pole (TP2 x PCP2 + delaying child, ~100 s of TLC) must start first,
    # the cheapest PCP=1 TP=1 NIXL rows last.
    assert order[0] == "pcp2-tp2-fixed-offload-delaying"
    cheapest = {r.name for r in rows if estimated_cost(r) == min(map(estimated_cost, rows))}
    assert cheapest == {
        r.name
        for r in rows
        if r.name.startswith("pcp1-tp1-") and "nixl" in r.name and "offload" not in r.name
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


@needs_java
def test_joint_timeout_is_not_waited_for_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # TP2 x PCP2 + delaying: safety explores its 39k states in ~4 s, liveness needs ~50 s.
    from kvspec import check
    from kvspec.matrix import find_row

    row = find_row(load_matrix(), "pcp2-tp2-fixed-offload-delaying")
    monkeypatch.setattr(check, "TIMEOUT_S", 15.0)
    results = {r.prop: r.verdict for r in check_row(row, tmp_path)}
    assert results == {
        p: ("timeout" if p in ("DelayedEventuallyFreed", "NoStall") else "holds")
        for p in row.expect
    }
    assert len(list((tmp_path / row.name / "tlc").iterdir())) == 2  # joint + safety only


def test_rank_coords_follow_the_spec_layout() -> None:
    # KVCompletion.tla: PcpOf(w) == w % PCP, TpOf(w) == (w \div PCP) % TP,
    # PpOf(w) == w \div (PCP * TP); the driver builds worker w at these coordinates.
    topo = Topology(tp=2, pp=2, pcp=3)
    coords = [topo.rank_coords(w) for w in range(topo.world_size)]
    assert len(set(coords)) == topo.world_size
    assert [c.pcp for c in coords[:4]] == [0, 1, 2, 0]
    assert coords[3] == (0, 1, 0) and coords[6] == (1, 0, 0)
