"""D's side of the lease clock on recorded runs (spec/ClockTrace.tla): the requests a
recorded heartbeat names are the ones KVClock says D tracks (`Tracked`), from its
add_request to its request_finished or its processed finished_recving. A client abort on
D (pd-handshake-fail-abort: request 2 aborted while D waited for its KV) ends request 2's
heartbeats at D's request_finished (`pull_scheduler.py:215-217`), which the clock maps as
`finish`; without it, the next heartbeat names a request the model says D still tracks.
Where the recorder wrote D's handshake (since 2026-12-05), the handshake ends at its
event, and a heartbeat that went out before it is unexplained."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from clock_checks import assert_admitted_reads_safe, assert_rejected_at
from kvspec.record.clock_mapping import map_clock
from kvspec.record.log import Event, read_dir

RUN = Path(__file__).resolve().parents[2] / "conformance" / "recorded" / "pd-handshake-fail-abort"


def test_heartbeats_stop_naming_a_request_at_ds_request_finished() -> None:
    log = map_clock(read_dir(RUN)).log
    fin = next(n for n, e in enumerate(log) if e.a == "finish")
    assert log[fin].r == 2
    before = [e.names for e in log[:fin] if e.a == "hb"]
    after = [e.names for e in log[fin:] if e.a == "hb"]
    assert before[-1] == (1, 2) and after and all(n == (1,) for n in after)


# the admitted side (TLC, 4-7 s) in make test-full; its negative control in make test
@pytest.mark.slow
def test_the_clock_admits_it_with_the_finish(tmp_path: Path) -> None:
    cm = map_clock(read_dir(RUN))
    assert_admitted_reads_safe(cm, tmp_path)


def test_negative_control_without_the_finish_the_next_heartbeat_is_unexplained(
    tmp_path: Path,
) -> None:
    """The same log with D's request_finished of request 2 dropped (the mapping before
    2026-12-05): KVClock's D still tracks request 2, the recorded heartbeat does not name
    it, and the run is rejected at that heartbeat."""
    cm = map_clock(read_dir(RUN))
    fin = next(n for n, e in enumerate(cm.log) if e.a == "finish")
    doctored = dataclasses.replace(cm, log=[e for e in cm.log if e.a != "finish"])
    at = next(n for n, e in enumerate(doctored.log) if e.a == "hb" and n >= fin)
    assert_rejected_at(doctored, at, tmp_path)


SHM = RUN.parent / "queued-heartbeats-shm-recheck"  # first heartbeat swallowed, then sent


def _with_handshake_at(t_ns: int) -> list[Event]:
    """The recording with D's handshake with P ending at `t_ns` (the recorder's
    `handshake` event, which this run predates)."""
    events = read_dir(SHM)
    d = next(e for e in events if e.engine == "D" and e.role == "worker")
    ok = {"remote_engine": "P", "ok": True, "started_ns": 0}
    hs = dataclasses.replace(d, seq=10**6, t_ns=t_ns, call="handshake", reqs=(), result=ok)
    return sorted([*events, hs], key=lambda e: (e.t_ns, e.pid, e.seq))


def _sends() -> list[int]:
    return [e.t_ns for e in read_dir(SHM) if e.call == "heartbeat_send" and e.engine == "D"]


# the admitted side (TLC, 4-7 s) in make test-full; its negative control in make test
@pytest.mark.slow
def test_a_recorded_handshake_ends_between_the_swallowed_and_the_first_sent_heartbeat(
    tmp_path: Path,
) -> None:
    sends = _sends()
    cm = map_clock(_with_handshake_at((sends[0] + sends[1]) // 2))
    assert cm.hs_recorded and [e.a for e in cm.log if e.a in ("hs", "hb")][:3] == [
        "hb", "hs", "hb"]  # fmt: skip
    assert_admitted_reads_safe(cm, tmp_path)


def test_negative_control_a_heartbeat_sent_before_the_handshake_ended_is_unexplained(
    tmp_path: Path,
) -> None:
    """The handshake's end moved after the second heartbeat, which went out: KVClock's D
    sends nothing while its handshake is pending (`_send_heartbeats` ->
    `_ensure_handshake`), so that heartbeat has no explanation."""
    sends = _sends()
    cm = map_clock(_with_handshake_at(sends[1] + 1))
    at = [n for n, e in enumerate(cm.log) if e.a == "hb"][1]
    assert not cm.log[at].swallow
    assert_rejected_at(cm, at, tmp_path)


# kvspec scenario pd-decode-abort recorded 2026-12-05 with the recorder's handshake events
HS_RUN = RUN.parent / "pd-decode-abort-handshake"


def test_a_real_handshake_ends_after_the_swallowed_heartbeat_and_before_the_reads() -> None:
    events = read_dir(HS_RUN)
    hs = next(e for e in events if e.call == "handshake")
    took = round((hs.t_ns - int(hs.result["started_ns"])) / 1e9, 3)
    assert hs.result["ok"] and took == json.loads((HS_RUN / "expect.json").read_text())[
        "clock"]["handshake_s"]  # fmt: skip
    log = map_clock(events).log
    order = [e.a for e in log if e.a in ("hb", "hs", "read", "finish")]
    assert order[:2] == ["hb", "finish"] and order[2] == "hs" and set(order[3:]) == {"read"}
    assert log[[e.a for e in log].index("hb")].swallow


# the admitted side (TLC, 4-7 s) in make test-full; its negative control in make test
@pytest.mark.slow
def test_the_clock_admits_the_real_handshake_run(tmp_path: Path) -> None:
    cm = map_clock(read_dir(HS_RUN))
    assert cm.hs_recorded
    assert_admitted_reads_safe(cm, tmp_path)


def test_negative_control_a_read_before_the_recorded_handshake_ended_is_unexplained(
    tmp_path: Path,
) -> None:
    """D's handshake event moved after its READs: KVClock's D posts no READ while its
    handshake is pending (one handshake per producer engine, `_handshake_futures`)."""
    events = read_dir(HS_RUN)
    last_read = max(e.t_ns for e in events if e.call == "read")
    moved = sorted((dataclasses.replace(e, t_ns=last_read + 1) if e.call == "handshake" else e
                    for e in events), key=lambda e: (e.t_ns, e.pid, e.seq))  # fmt: skip
    cm = map_clock(moved)
    at = next(n for n, e in enumerate(cm.log) if e.a == "read")
    assert_rejected_at(cm, at, tmp_path)
