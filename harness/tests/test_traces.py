"""Trace selection covers every edge, output is deterministic, counterexamples unroll."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvspec.codec import to_values
from kvspec.drivers.reference import ReferenceDriver
from kvspec.itf import dumps, value_to_itf
from kvspec.matrix import ModelRow, Topology, load_matrix
from kvspec.replay import load_trace, replay
from kvspec.traces import generate, graph_from_reference, select_traces, trace_doc
from kvspec.traces_cmd import lock_of
from kvspec.tracestore import ensure_generated, lock_mismatches, trace_paths

ROW = ModelRow("t-shipped-nixl-pcp2", "v0.30-shipped", "nixl", Topology(1, 1, 2), 1, 1, False)


def test_selection_covers_every_edge_from_init() -> None:
    g = graph_from_reference(ROW)
    traces = select_traces(g)
    covered = {e for t in traces for e in t}
    assert covered == set(g.edges)
    for t in traces:  # each trace is a connected path starting at Init
        assert t[0][0] == g.init
        assert all(a[2] == b[0] for a, b in zip(t, t[1:], strict=False))


def test_selection_is_deterministic() -> None:
    a = [dumps(trace_doc(ROW, graph_from_reference(ROW).init, t, {})) for t in
         select_traces(graph_from_reference(ROW))]  # fmt: skip
    b = [dumps(trace_doc(ROW, graph_from_reference(ROW).init, t, {})) for t in
         select_traces(graph_from_reference(ROW))]  # fmt: skip
    assert a == b


def _generate_into(out: Path, rows: list[ModelRow]) -> int:
    """Generate `rows` into `out` through the cache; returns how often the generator ran."""
    calls = []

    def gen(rs: list[ModelRow]) -> list[tuple[ModelRow, dict[str, str]]]:
        calls.append(rs)
        return generate(rs)

    matrix = out.parent / "matrix.toml"
    if not matrix.exists():
        matrix.write_text(MATRIX)
    ensure_generated(gen, matrix, out)
    return len(calls)


MATRIX = """
[[model]]
name = "t-shipped-nixl-pcp2"
variant = "v0.30-shipped"
composition = "nixl"
topology = {tp = 1, pp = 1, pcp = 2}
"""


def test_generated_traces_are_cached_by_their_inputs(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    assert _generate_into(out, [ROW]) == 1
    files = trace_paths(out)
    assert files and all(p.parent == out / "v0.30-shipped" / ROW.name for p in files)
    assert _generate_into(out, [ROW]) == 0  # fresh: not regenerated
    (tmp_path / "matrix.toml").write_text(MATRIX + "\n# changed\n")
    assert _generate_into(out, [ROW]) == 1  # an input changed: regenerated
    (out / "STAMP").unlink()  # an interrupted write leaves no stamp: regenerated
    assert _generate_into(out, [ROW]) == 1


def test_lock_detects_a_changed_trace_set(tmp_path: Path) -> None:
    out = tmp_path / "traces"
    _generate_into(out, [ROW])
    _, lock = lock_of(ROW, out)
    assert lock.traces == len(trace_paths(out)) and lock.edges == lock.covered > 0
    assert lock_mismatches({ROW.name: lock}, {ROW.name: lock}) == []
    # Negative control: one byte of one trace differs -> the lock no longer matches.
    first = trace_paths(out)[0]
    first.write_text(first.read_text().replace('"init"', '"init "', 1))
    _, edited = lock_of(ROW, out)
    (line,) = lock_mismatches({ROW.name: edited}, {ROW.name: lock})
    assert line.startswith(f"{ROW.name}: sha256 ")
    assert lock_mismatches({}, {ROW.name: lock}) == [f"{ROW.name}: locked but no longer generated"]


def test_committed_locks_match_the_generated_traces() -> None:
    """What `kvspec traces --check` proves in make test, for a plain pytest run. It reads
    build/traces (regenerated only if stale; the suite replays the same files)."""
    from kvspec.tracestore import CONFORMANCE_MATRIX, GENERATED, read_locks

    out = ensure_generated(generate, CONFORMANCE_MATRIX, GENERATED)
    rows = [r for r in load_matrix(CONFORMANCE_MATRIX) if r.tier == "default"]
    have = {r.name: lock_of(r, out)[1] for r in rows}
    assert lock_mismatches(have, read_locks()) == []


def test_regression_that_is_no_longer_a_spec_path_is_reported(tmp_path: Path) -> None:
    from kvspec.traces_cmd import bad_regressions

    assert bad_regressions() == []  # the committed ones replay on the model
    g = graph_from_reference(ROW)
    doc = trace_doc(ROW, g.init, select_traces(g)[0], {})
    doc["states"][1]["req"] = ["sending"]  # negative control: no first step sends
    bad = tmp_path / ROW.variant / ROW.name / "cex-x.itf.json"
    bad.parent.mkdir(parents=True)
    bad.write_text(dumps(doc))
    (line,) = bad_regressions(tmp_path)
    assert "incorrect state at step 1" in line


@pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")
def test_counterexample_lasso_is_unrolled_with_quiescence(tmp_path: Path) -> None:
    """A hand-made lasso (schedule/execute/update cycling with a stuck request)."""
    from kvspec.model import Model, initial_state
    from kvspec.traces import counterexample_docs

    model = Model(ROW)
    s = initial_state(ROW)
    states = [s]
    for name in ["schedule", "execute_model", "update_from_output"] * 3:
        s = next(t for a, t in model.successors(s) if a.name == name)
        states.append(s)
    # v0.30-shipped PCP=2 never frees: after the lease is set (state 6) the engine cycles.
    assert states[9] == states[6] and states[6].req == ("sending",)
    loop_doc = {
        "#meta": {"property": "DelayedEventuallyFreed"},
        "states": [
            {k: value_to_itf(v) for k, v in to_values(ROW, x).items()} for x in states[:9]
        ],  # fmt: skip
        "loop": 6,
    }
    check_dir = tmp_path / "check"
    (check_dir / ROW.name).mkdir(parents=True)
    (check_dir / ROW.name / "DelayedEventuallyFreed.itf.json").write_text(json.dumps(loop_doc))
    docs = counterexample_docs(ROW, check_dir)
    doc = docs["cex-DelayedEventuallyFreed"]
    assert doc["#meta"]["expect_quiescent"] == [1]
    assert len(doc["states"]) == 9 + 3 + 1  # one more turn round the loop, back to its head
    out = tmp_path / "traces" / ROW.name
    out.mkdir(parents=True)
    (out / "cex-DelayedEventuallyFreed.itf.json").write_text(dumps(doc))
    trace = load_trace(out / "cex-DelayedEventuallyFreed.itf.json")
    assert replay(ReferenceDriver(ROW), trace).ok


def test_sample_per_model_spreads_and_keeps_regressions() -> None:
    from kvspec.traces import sample_per_model

    gen = [Path(f"v/m/{i:03d}.itf.json") for i in range(10)]
    cex = Path("v/m/cex-NoStall.itf.json")
    other = [Path(f"v/n/{i:03d}.itf.json") for i in range(2)]
    got = sample_per_model([*gen, cex, *other], 4)
    assert [p.name for p in got if p.parent.name == "m"] == [
        "000.itf.json", "002.itf.json", "005.itf.json", "007.itf.json", "cex-NoStall.itf.json"
    ]  # fmt: skip
    assert [p for p in got if p.parent.name == "n"] == other  # fewer than n: all kept
    assert sample_per_model([*gen, cex], 100) == sorted([*gen, cex])


def test_save_regressions_skips_a_row_checked_as_another_model(tmp_path: Path) -> None:
    """The spec matrix's row of a conformance row's name may be another model (async
    there, synchronous here): its counterexamples are not paths of this row, so they are
    skipped with a note instead of failing every other row's (negative control: the same
    constants are kept)."""
    from dataclasses import replace

    from kvspec.traces import regression_docs

    checked = replace(ROW, async_scheduling=True)
    work = tmp_path / ROW.name
    work.mkdir()
    (work / "joint.cfg").write_text(checked.cfg_text(["TypeOK"], []))
    (work / "X.itf.json").write_text("{}")  # not read: the row is skipped first
    docs, notes = regression_docs([ROW], tmp_path)
    assert docs == {} and notes == [
        f"{ROW.name}: checked with other constants (AsyncScheduling); skipped"
    ]
    (work / "joint.cfg").write_text(ROW.cfg_text(["TypeOK"], []))
    (work / "X.itf.json").write_text(json.dumps({"states": []}))
    assert regression_docs([ROW], tmp_path) == ({}, [])


def test_spec_matrix_traces_include_its_fast_rows(tmp_path: Path) -> None:
    # The nightly spec-matrix replay: the default matrix is its "fast" rows plus its
    # "default" ones; generating "default" only left 7 fast rows without traces.
    from kvspec.matrix import DEFAULT_MATRIX

    seen: list[str] = []

    class Generated(Exception):
        pass

    def fake(rows: list[ModelRow]) -> dict[str, object]:
        seen.extend(r.name for r in rows)
        raise Generated  # the rows are all this test needs: nothing is written

    with pytest.raises(Generated):
        ensure_generated(fake, DEFAULT_MATRIX, tmp_path / "t")  # type: ignore[arg-type]
    tiers = {r.name: r.tier for r in load_matrix(DEFAULT_MATRIX)}
    assert sorted(seen) == sorted(tiers)
    assert {tiers[n] for n in seen} == {"fast", "default"}
