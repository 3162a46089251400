"""A producer whose worker stalls while it holds requests (a loaded machine's shm-queue
stall) reads neither D's heartbeats nor its lease: pd-push-p-handshake-fail, whose check is
that D's heartbeats kept P's blocks, then has no verdict (a timeout, retried), not a
failure. The rule counts the worker's steps between D's first delivered heartbeat and the
lease's end (scenario_checks.heartbeat_chances): two are needed in push."""

from __future__ import annotations

from kvspec.record.log import Event
from kvspec.scenario import SCENARIOS, _handshake_timed_out
from kvspec.scenario_checks import heartbeat_chances

SC = SCENARIOS["pd-push-p-handshake-fail"]


def _p(call: str, t_s: float, **result: object) -> Event:
    return Event("P", "kv_both", "scheduler", 0, 1, 1, 0, int(t_s * 1e9), call, reqs=("p0",),
                 result=dict(result))  # fmt: skip


def _hb(t_s: float, sent: bool = True) -> Event:
    """D's worker heartbeats p0: delivered to P's agent (0, 0), or swallowed (`sent` empty:
    its handshake with P still pending)."""
    got = {"remote_engine": "P", "sent": ["0:0"] if sent else []}
    return Event("D", "kv_both", "worker", 0, 1, 3, 0, int(t_s * 1e9), "heartbeat_send",
                 reqs=("p0",), result=got)  # fmt: skip


def _worker(t_s: float) -> Event:
    return Event("P", "kv_both", "worker", 0, 1, 2, 0, int(t_s * 1e9), "get_transfer_results")


def _run(finish_s: float, free_s: float, sched_s: list[float], hb_s: list[float]) -> list[Event]:
    """P finishes p0 at finish_s holding its blocks, schedules at sched_s and frees p0 at
    free_s; D heartbeats it at hb_s (delivered); P's handshake with D refused, as staged."""
    hs = Event("P", "kv_both", "worker", 0, 1, 2, 0, 1, "handshake",
               result={"remote_engine": "D", "ok": False})  # fmt: skip
    return [hs, _p("request_finished", finish_s, delay=True),
            *[_p("schedule", t) for t in sched_s], _p("free_blocks", free_s),
            *[_hb(t) for t in hb_s]]  # fmt: skip


def test_a_worker_that_stalled_past_the_lease_gives_no_verdict() -> None:
    """make e2e, session 28: P finished at 4 s, its worker stepped at 6.5 and 7.8 s and
    next at 83.9 s, freeing p0 at its long-expired lease. Controls: a worker that stepped
    every second; a scenario that stages no such wait."""
    hb = [10.0 + 5 * k for k in range(14)]
    stalled = [*_run(4.0, 84.0, [6.5, 7.8, 83.9], hb), *map(_worker, (6.5, 7.8, 83.9))]
    assert heartbeat_chances(stalled, "P", 30) == 0
    said = _handshake_timed_out(SC, stalled, ["D"])
    assert said.startswith("timeout: P's worker took 0 step(s)") and "30 s lease" in said
    steps = [4.0 + n for n in range(80)]
    busy = [*_run(4.0, 84.0, steps, hb), *map(_worker, steps)]
    assert heartbeat_chances(busy, "P", 30) == 23  # 11 .. 33 s
    assert _handshake_timed_out(SC, busy, ["D"]) == ""
    assert "worker took" not in _handshake_timed_out(SCENARIOS["pd-basic"], stalled, ["D"])


def test_a_worker_stall_the_scheduler_did_not_show_gives_no_verdict() -> None:
    """make e2e, 2026-12-07: P finished at 10.0 s (lease to 40.0 s); D's heartbeats reached
    P's agent from 23.6 s; P's worker stepped until 21.8 s and next at 48.9 s, so no
    heartbeat could be read in time, and P freed at 48.9 s. P's scheduler had stepped at
    33.2 s, so its longest gap (15.8 s) was under the lease: only the worker's steps show
    the stall. Negative control: the same run with the worker stepping every second."""
    base = [*_run(10.0, 48.9, [20.0, 21.8, 33.2], [23.6 + 5 * k for k in range(6)]),
            _hb(18.6, sent=False)]  # fmt: skip
    stalled = [*base, *map(_worker, (20.0, 21.8, 48.9))]
    assert heartbeat_chances(stalled, "P", 30) == 0
    said = _handshake_timed_out(SC, stalled, ["D"])
    assert said.startswith("timeout: P's worker took 0 step(s)") and "30 s lease" in said
    busy = [*base, *[_worker(10.0 + k) for k in range(39)]]
    assert heartbeat_chances(busy, "P", 30) == 16  # 24 .. 39 s
    assert _handshake_timed_out(SC, busy, ["D"]) == ""
    # one step in the window is not enough in push: the writer forwards, the next handles
    assert "took 1 step(s)" in _handshake_timed_out(SC, [*base, _worker(30.0)], ["D"])
    # no heartbeat reached P at all: no chance either
    assert heartbeat_chances([e for e in busy if e.call != "heartbeat_send"], "P", 30) == 0
    # P held nothing: the question does not arise
    held_nothing = [e for e in busy if e.call != "request_finished"]
    assert heartbeat_chances(held_nothing, "P", 30) is None
    assert _handshake_timed_out(SC, held_nothing, ["D"]) == ""
