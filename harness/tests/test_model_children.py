"""The MultiConnector children in the Python model: the offloading flush fence and job
accounting carry their properties (negative controls bend one mechanism and the property
must then fail), and HF3FS delays aborted requests."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvspec.matrix import ModelRow, Topology
from kvspec.model import ACTION_FNS, Defs, Model, State, reachable, update_from_output

UPSTREAM = "multi-nixl-offload-upstream"


def offload_row(nreq: int = 2, asy: bool = True) -> ModelRow:
    return ModelRow("offload", "fixed", UPSTREAM, Topology(1, 1, 1), nreq, 1, asy)


def states(model: Model) -> list[State]:
    got = reachable(model.row, model=model)
    assert got is not None
    return got[0]


@pytest.mark.parametrize("asy", [False, True])
def test_fence_keeps_reused_blocks_unread(asy: bool) -> None:
    all_states = states(Model(offload_row(asy=asy)))
    assert not any(s.clobbered for s in all_states)
    # non-vacuous: a block with a pending store is reallocated, and a flush happens
    assert any(st.reused for s in all_states for st in s.steps)
    assert any(st.flush for s in all_states for st in s.steps)


class NoFenceModel(Model):
    """Negative control: request_finished registers no fence (#46951's shape)."""

    def apply(self, s: State, a: object) -> State | None:
        t = super().apply(s, a)  # type: ignore[arg-type]
        return None if t is None else replace(t, fence=frozenset())


def test_without_the_fence_a_store_reads_a_reused_block() -> None:
    assert any(s.clobbered for s in states(NoFenceModel(offload_row())))


def stuck_jobs(model: Model) -> tuple[int, int]:
    """(all-freed states with a job in flight, those of them from which no terminal
    state, i.e. the engine going idle, is reachable)."""
    got = reachable(model.row, model=model)
    assert got is not None
    all_states, edges = got
    preds: dict[State, list[State]] = {}
    has_succ = set()
    for a, _, b in edges:
        preds.setdefault(b, []).append(a)
        has_succ.add(a)
    can_finish = {s for s in all_states if s not in has_succ}
    todo = list(can_finish)
    while todo:
        for p in preds.get(todo.pop(), []):
            if p not in can_finish:
                can_finish.add(p)
                todo.append(p)
    pending = [s for s in all_states if all(x == "freed" for x in s.req) and any(s.jobs)]
    return len(pending), sum(1 for s in pending if s not in can_finish)


def test_jobs_complete_and_the_engine_goes_idle() -> None:
    pending, stuck = stuck_jobs(Model(offload_row()))
    assert pending > 0 and stuck == 0
    got = reachable(offload_row())
    assert got is not None
    srcs = {a for a, _, _ in got[1]}
    idle = [s for s in got[0] if s not in srcs]
    assert idle and all(not any(s.jobs) and not s.fence for s in idle)


def test_lost_acks_keep_the_engine_stepping() -> None:
    """Negative control for StoreJobsComplete: if rank acks are lost (#46019's shape), a
    job's pending_count never reaches 0 and the engine keeps stepping forever
    (has_pending_push_work)."""

    def lossy(d: Defs, s: State) -> State | None:
        t = update_from_output(d, s)
        return None if t is None else replace(t, jobs=s.jobs)

    real = ACTION_FNS["update_from_output"]
    try:
        ACTION_FNS["update_from_output"] = lossy
        pending, stuck = stuck_jobs(Model(offload_row(nreq=1)))
    finally:
        ACTION_FNS["update_from_output"] = real
    assert pending > 0 and stuck == pending


def test_hf3fs_delays_aborted_requests() -> None:
    row = ModelRow("h", "fixed", "multi-nixl-hf3fs", Topology(1, 1, 1), 2, 1, True)
    seen = {x for s in states(Model(row)) for x in s.req}
    assert {"aborted-held", "aborted-empty"} <= seen
