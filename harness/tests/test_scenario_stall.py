"""A producer that stalls while it holds requests (a loaded machine's shm-queue stall)
sees neither its lease nor D's heartbeats: pd-push-p-handshake-fail, whose check is that
D's heartbeats kept P's blocks, then has no verdict (a timeout, retried), not a failure.
Measured in make e2e, 2026-12-07: P's worker stalled 77 s (vLLM: "No available shared
memory broadcast block found in 60 seconds") and freed at its first step after it."""

from __future__ import annotations

from kvspec.record.log import Event
from kvspec.scenario import SCENARIOS, _handshake_timed_out
from kvspec.scenario_checks import longest_hold_gap_s


def _p(call: str, t_s: float, **result: object) -> Event:
    return Event("P", "kv_both", "scheduler", 0, 1, 1, 0, int(t_s * 1e9), call, reqs=("p0",),
                 result=dict(result))  # fmt: skip


def _run(step_s: list[float]) -> list[Event]:
    """P finishes p0 at 4 s holding its blocks, steps at step_s, frees it at 84 s; its
    handshake with D (refused, as staged) recorded."""
    hs = Event("P", "kv_both", "worker", 0, 1, 2, 0, 1, "handshake",
               result={"remote_engine": "D", "ok": False})  # fmt: skip
    return [hs, _p("request_finished", 4.0, delay=True),
            *[_p("schedule", t) for t in step_s], _p("free_blocks", 84.0)]  # fmt: skip


def test_a_producer_that_stalled_past_its_lease_gives_no_verdict() -> None:
    stalled = _run([6.5, 7.8, 83.9])
    assert round(longest_hold_gap_s(stalled, "P")) == 76
    sc = SCENARIOS["pd-push-p-handshake-fail"]
    said = _handshake_timed_out(sc, stalled, ["D"])
    assert said.startswith("timeout: P did not step for 76 s") and "30 s lease" in said
    # negative controls: a P that stepped every second; a scenario that stages no such wait
    busy = _run([4.0 + n for n in range(80)])
    assert longest_hold_gap_s(busy, "P") <= 1.0 and _handshake_timed_out(sc, busy, ["D"]) == ""
    assert "did not step" not in _handshake_timed_out(SCENARIOS["pd-basic"], stalled, ["D"])
    # nothing held: no gap
    assert longest_hold_gap_s([_p("schedule", 1.0)], "P") == 0.0
