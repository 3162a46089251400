"""A producer that stalls while it holds requests (a loaded machine's shm-queue stall)
sees neither its lease nor D's heartbeats: pd-push-p-handshake-fail, whose check is that
D's heartbeats kept P's blocks, then has no verdict (a timeout, retried), not a failure.
Measured in make e2e, 2026-12-07: P's worker stalled 77 s (vLLM: "No available shared
memory broadcast block found in 60 seconds") and freed at its first step after it."""

from __future__ import annotations

from kvspec.record.log import Event
from kvspec.scenario import SCENARIOS, _handshake_timed_out
from kvspec.scenario_checks import heartbeat_chances, longest_hold_gap_s


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


def _hb(t_s: float, sent: bool = True) -> Event:
    """D's worker heartbeats p0: delivered to P's agent (0, 0), or swallowed (`sent` empty:
    its handshake with P still pending)."""
    got = {"remote_engine": "P", "sent": ["0:0"] if sent else []}
    return Event("D", "kv_both", "worker", 0, 1, 3, 0, int(t_s * 1e9), "heartbeat_send",
                 reqs=("p0",), result=got)  # fmt: skip


def _worker(t_s: float) -> Event:
    return Event("P", "kv_both", "worker", 0, 1, 2, 0, int(t_s * 1e9), "get_transfer_results")


def test_a_producer_that_stalled_past_its_lease_gives_no_verdict() -> None:
    stalled = _run([6.5, 7.8, 83.9])
    assert round(longest_hold_gap_s(stalled, "P")) == 76
    sc = SCENARIOS["pd-push-p-handshake-fail"]
    said = _handshake_timed_out(sc, stalled, ["D"])
    assert said.startswith("timeout: P did not step for 76 s") and "30 s lease" in said
    # negative controls: a P that stepped every second; a scenario that stages no such wait
    busy = [*_run([4.0 + n for n in range(80)]), _hb(10.0),
            *[_worker(4.0 + n) for n in range(80)]]  # fmt: skip
    assert longest_hold_gap_s(busy, "P") <= 1.0 and _handshake_timed_out(sc, busy, ["D"]) == ""
    assert "did not step" not in _handshake_timed_out(SCENARIOS["pd-basic"], stalled, ["D"])
    # nothing held: no gap
    assert longest_hold_gap_s([_p("schedule", 1.0)], "P") == 0.0


def test_a_worker_that_stalled_across_the_heartbeats_gives_no_verdict() -> None:
    """make e2e, 2026-12-07: P finished at 10.0 s (lease 30 s: to 40.0 s); D's heartbeats
    reached P's agent from 23.6 s; P's worker stepped until 21.8 s and next at 48.9 s, so
    no heartbeat could be read in time, and P freed at 48.9 s. P's scheduler had stepped at
    33.2 s, so its longest gap (15.8 s) was under the lease: only the worker's steps show
    it. Negative control: the same run with the worker stepping every second."""
    sc = SCENARIOS["pd-push-p-handshake-fail"]
    hs = Event("P", "kv_both", "worker", 0, 1, 2, 0, 1, "handshake",
               result={"remote_engine": "D", "ok": False})  # fmt: skip
    base = [hs, _p("request_finished", 10.0, delay=True),
            *[_p("schedule", t) for t in (20.0, 21.8, 33.2)], _p("free_blocks", 48.9),
            _hb(18.6, sent=False), *[_hb(23.6 + 5 * k) for k in range(6)]]  # fmt: skip
    stalled = [*base, _worker(20.0), _worker(21.8), _worker(48.9)]
    assert longest_hold_gap_s(stalled, "P") < 30 and heartbeat_chances(stalled, "P", 30) == 0
    said = _handshake_timed_out(sc, stalled, ["D"])
    assert said.startswith("timeout: P's worker took 0 step(s)") and "30 s lease" in said
    busy = [*base, *[_worker(10.0 + k) for k in range(39)]]
    assert heartbeat_chances(busy, "P", 30) == 16  # 24 .. 39 s
    assert _handshake_timed_out(sc, busy, ["D"]) == ""
    # one step in the window is not enough in push: the writer forwards, the next handles
    once = [*base, _worker(30.0)]
    assert "took 1 step(s)" in _handshake_timed_out(sc, once, ["D"])
    # no heartbeat reached P at all: no chance either
    assert heartbeat_chances([e for e in busy if e.call != "heartbeat_send"], "P", 30) == 0
    # P held nothing: the question does not arise
    held_nothing = [e for e in busy if e.call != "request_finished"]
    assert heartbeat_chances(held_nothing, "P", 30) is None
    assert _handshake_timed_out(sc, held_nothing, ["D"]) == ""
