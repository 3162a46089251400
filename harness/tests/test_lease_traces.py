"""Edge-covering LeaseClock traces (kvspec.lease_traces): generated from TLC's graph, every
edge covered, and replayed on vLLM's real lease code; a mutant of the heartbeat diverges.
make test replays a sample of one row; `kvspec lease --conform` (nightly) replays all."""

from __future__ import annotations

import shutil
from typing import Any

import pytest
from kvspec.lease import LEASE, load_lease_matrix
from kvspec.lease_traces import _edges, edge_traces, lease_graph, replay_docs
from kvspec.statgraph import StateGraph
from kvspec.sweep import SweepRow

SAMPLE = 8  # traces of the row replayed in make test (the row has 37; ~0.5 s each)


def _row(name: str) -> SweepRow:
    return next(r for r in load_lease_matrix() if r.name == name)


@pytest.fixture(scope="module")
def graph(tmp_path_factory: pytest.TempPathFactory) -> StateGraph:
    """wait80s-hb-ok's graph: one TLC run for the module."""
    if shutil.which("java") is None:
        pytest.skip("java not installed")
    return lease_graph(LEASE, _row("wait80s-hb-ok"), tmp_path_factory.mktemp("lease"))


def test_traces_cover_every_edge_and_follow_tlcs_graph(graph: StateGraph) -> None:
    row, g = _row("wait80s-hb-ok"), graph
    docs = edge_traces(g, row)
    key = {fp: st for fp, st in g.states.items()}
    seen: set[tuple[str, str]] = set()
    for doc in docs:
        states: Any = doc["states"]
        assert states[0]["#meta"]["action"] == "init"
        for a, b in zip(states, states[1:], strict=False):
            seen.add((repr(_strip(a)), b["#meta"]["action"] + repr(_strip(b))))
    edges = {(repr(_itf(key[s])), act + repr(_itf(key[t]))) for s, act, t in _edges(g)}
    assert seen == edges and len(edges) > 50
    # deterministic: the same graph gives the same traces
    assert edge_traces(g, row) == docs


def _strip(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "#meta"}


def _itf(state: dict[str, Any]) -> dict[str, Any]:
    from kvspec.itf import value_to_itf

    return {k: value_to_itf(v) for k, v in sorted(state.items())}


def _extends(doc: dict[str, Any]) -> bool:
    """A delivered heartbeat raises a ttl somewhere in the trace."""
    states: Any = doc["states"]
    return any(
        b["#meta"]["action"] == "heartbeat"
        and any(y > x for x, y in zip(a["ttl"], b["ttl"], strict=True))
        for a, b in zip(states, states[1:], strict=False)
    )


@pytest.mark.vllm
def test_a_sample_conforms_and_a_heartbeat_mutant_diverges(graph: StateGraph) -> None:
    pytest.importorskip("nixl")
    from kvspec.drivers.lease_driver import LeaseDriver
    from kvspec.lease_replay import replay_lease
    from kvspec.mutations import Base, patched
    from kvspec.mutations.catalogue import MUTANTS

    row = _row("wait80s-hb-ok")
    docs = edge_traces(graph, row)
    got = replay_docs(row, len(_edges(graph)), docs[:SAMPLE])
    if got.inconclusive:  # a wait expired twice (a loaded machine): no verdict either way
        pytest.skip(f"inconclusive: {got.inconclusive[0]}")
    assert (got.conforming, got.divergences) == (SAMPLE, [])
    # Negative control: the first trace in which a heartbeat extends the lease diverges
    # when the heartbeat does not extend it (the mutant heartbeat-not-extending).
    doc = next(d for d in docs if _extends(d))
    with patched(Base("v0.30-shipped"), MUTANTS["heartbeat-not-extending"].patch):
        with LeaseDriver(row.requests) as driver:
            res = replay_lease(doc, driver)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is not None


def test_several_initial_states_each_start_a_trace_and_every_edge_is_covered() -> None:
    """Two initial states (as a priority row's assignments): the cover starts from a
    virtual root, so each initial state begins some trace, the root never appears, and
    every edge of either part is covered; states carry only the graph's variables."""
    g = StateGraph(
        states={1: {"x": 0}, 2: {"x": 10}, 3: {"x": 1}, 4: {"x": 11}},
        edges=[(1, "a", 3), (2, "a", 4), (4, "b", 2)],
        initial={1, 2},
    )
    row = _row("wait80s-hb-ok")
    docs = edge_traces(g, row)
    starts = {doc["states"][0]["x"] for doc in docs}
    assert starts == {0, 10}
    seen = set()
    for doc in docs:
        xs = [s["x"] for s in doc["states"]]
        acts = [s["#meta"]["action"] for s in doc["states"]]
        assert acts[0] == "init" and "init" not in acts[1:]
        seen |= {(x, a, y) for x, a, y in zip(xs, acts[1:], xs[1:], strict=False)}
    assert seen == {(0, "a", 1), (10, "a", 11), (11, "b", 10)}
