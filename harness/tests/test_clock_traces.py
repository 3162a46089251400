"""KVClock traces on the real classes (kvspec.clock_traces, drivers.clock_driver): a sample
of a fast row's edge-covering traces conforms on vLLM 0.32 as installed, with the controlled
clock, real heartbeats, READs landing and notifications as separate steps; the heartbeat
mutants of issue #13 diverge on the first trace that needs them (negative controls)."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from kvspec.clock import CLOCK
from kvspec.clock_traces import model_row, replay_clock, replay_docs
from kvspec.lease_traces import _edges, edge_traces, lease_graph
from kvspec.statgraph import StateGraph
from kvspec.sweep import SweepRow, load_sweep_matrix

ROW = "tp1-wait80s-hb-ok"
SAMPLE = 10  # traces replayed in make test (the row has ~500: `kvspec clock --conform`)


def _row() -> SweepRow:
    return next(r for r in load_sweep_matrix(CLOCK) if r.name == ROW)


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> StateGraph:
    if shutil.which("java") is None:
        pytest.skip("java not installed")
    return lease_graph(CLOCK, _row(), tmp_path_factory.mktemp("clock"))


@pytest.fixture(scope="module")
def docs(graph: StateGraph) -> list[dict[str, Any]]:
    """The row's edge-covering traces, computed once (about 15 s) for the module."""
    return edge_traces(graph, _row())


def _extends_during_read(doc: dict[str, Any]) -> bool:
    """A waiting heartbeat raises an installed lease's TTL (at P's step, which reads it)
    while a READ is posted."""
    states: Any = doc["states"]
    for a, b in zip(states, states[1:], strict=False):
        if b["#meta"]["action"] != "execute_model" or not a["hbq"]["#map"][0][1]["#set"]:
            continue
        ta, tb = a["ttl"]["#map"][0][1], b["ttl"]["#map"][0][1]
        posted = a["rd"][0]["#map"][0][1] != "none"
        if tb[0] > ta[0] and posted:
            return True
    return False


def _reaped_at_install(doc: dict[str, Any]) -> bool:
    """A late producer's step installs a deadline that ran out before it (TTL 0) and its
    reaper reports it in that same step (vLLM's start_load_kv, then the reaper)."""
    states: Any = doc["states"]
    for a, b in zip(states, states[1:], strict=False):
        lease_a = a["lease"]["#map"][0][1]["#set"]
        notified = 1 in a["notif"]["#map"][0][1]["#set"]  # freed by its READ's "r:1"
        if (b["#meta"]["action"] == "execute_model" and a["req"][0] == "sending"
                and 1 not in lease_a and a["ttl"]["#map"][0][1][0] == 0
                and not notified):  # fmt: skip
            ran = [s for s in b["steps"] if s["ran"]]
            if ran and 1 in ran[-1]["out"]["#map"][0][1]["#set"]:
                return True
    return False


def test_traces_cover_every_edge(graph: StateGraph, docs: list[dict[str, Any]]) -> None:
    assert len(docs) > 100 and len(_edges(graph)) > 1000
    assert any(_extends_during_read(d) for d in docs)  # heartbeats go on under a READ


@pytest.mark.vllm
@pytest.mark.parametrize(
    "mutant",
    # the second mutant's replay (27 s) runs in make test-full
    ["heartbeat-not-extending", pytest.param("heartbeat-full-lease", marks=pytest.mark.slow)],
)
def test_a_sample_conforms_and_heartbeat_mutants_diverge(
    graph: StateGraph, docs: list[dict[str, Any]], mutant: str
) -> None:
    pytest.importorskip("nixl")
    from kvspec.drivers.clock_driver import ClockDriver
    from kvspec.mutations import Base, patched
    from kvspec.mutations.catalogue import MUTANTS

    row = _row()
    if mutant == "heartbeat-not-extending":  # the sample once, with the first control
        got = replay_docs(row, len(_edges(graph)), docs[:SAMPLE])
        if got.inconclusive:  # a wait expired twice (a loaded machine): no verdict
            pytest.skip(f"inconclusive: {got.inconclusive[0]}")
        assert (got.conforming, got.divergences, got.not_driven) == (SAMPLE, [], [])
    doc = next(d for d in docs if _extends_during_read(d))
    mrow = model_row(row)
    with patched(Base("v0.30-shipped"), MUTANTS[mutant].patch):
        with ClockDriver(mrow) as driver:
            res = replay_clock(doc, driver)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is not None and "ttl" in res.divergence


LATE = "tp1-p-late-wait25s-hb-lost"


@pytest.mark.vllm
@pytest.mark.slow  # a second TLC graph and two replays: make test-full (nightly)
def test_a_late_deadline_is_reaped_in_its_install_step(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """ShipLate rows are driven: the step that installs a deadline which ran out frees it,
    in vLLM as in KVClock. Negative control: with the reaper mutated away
    (`lease-never-expires`) the same trace diverges."""
    pytest.importorskip("nixl")
    if shutil.which("java") is None:
        pytest.skip("java not installed")
    from kvspec.drivers.clock_driver import ClockDriver
    from kvspec.mutations import Base, patched
    from kvspec.mutations.catalogue import MUTANTS

    row = next(r for r in load_sweep_matrix(CLOCK) if r.name == LATE)
    g = lease_graph(CLOCK, row, tmp_path_factory.mktemp("late"))
    doc = next(d for d in edge_traces(g, row) if _reaped_at_install(d))
    with ClockDriver(model_row(row)) as driver:
        res = replay_clock(doc, driver)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is None, res.divergence
    with patched(Base("v0.30-shipped"), MUTANTS["lease-never-expires"].patch):
        with ClockDriver(model_row(row)) as driver:
            bad = replay_clock(doc, driver)
    if bad.timeout is not None:
        pytest.skip(f"inconclusive: {bad.timeout}")
    assert bad.divergence is not None
