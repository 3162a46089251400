"""Trace selection covers every edge, output is deterministic, counterexamples unroll."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kvspec.drivers.reference import ReferenceDriver
from kvspec.itf import dumps, value_to_itf
from kvspec.matrix import ModelRow, Topology
from kvspec.model import to_values
from kvspec.replay import load_trace, replay
from kvspec.traces import (
    ModelSummary,
    graph_from_reference,
    select_traces,
    stale_files,
    trace_doc,
)

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


def test_stale_files_detects_edits(tmp_path: Path) -> None:
    summ = ModelSummary("m", files={"000.itf.json": "{}\n", "001.itf.json": "[]\n"})
    d = tmp_path / "m"
    d.mkdir()
    (d / "000.itf.json").write_text("{}\n")
    (d / "002.itf.json").write_text("x")
    stale = stale_files(tmp_path, summ, keep_cex=True)
    assert stale == ["m/001.itf.json (missing)", "m/002.itf.json (no longer generated)"]
    (d / "001.itf.json").write_text("[]\n")
    (d / "002.itf.json").unlink()
    assert stale_files(tmp_path, summ, keep_cex=True) == []
    (d / "000.itf.json").write_text("{ }\n")  # negative control: one byte differs
    assert stale_files(tmp_path, summ, keep_cex=True) == ["m/000.itf.json (differs)"]


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
        "states": [{k: value_to_itf(v) for k, v in to_values(ROW, x).items()}
                   for x in states[:9]],  # fmt: skip
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
