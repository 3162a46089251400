"""Push mode against the lease clock (spec/KVClock.tla with Transfer = "push",
ClockTrace's "write"): a recorded WRITE is KVClock's push_write at its tick, and P's
report of a request is its WRITE ending or its lease running out, which the clock now
tells apart. The real push runs (conformance/recorded/pd-push, pd-push-tp2: real 0.32
engines) map each WRITE before D's receive; pd-push is admitted. Negative control: the
same run with P's WRITE of one request (and D's receive of it) dropped, P still reporting
it in the step where it did, 40 s into a 120 s lease: KVTrace, untimed, reads that report
as the lease running out and admits it; the clock rejects it at that report. After a
producer stall, real pull handles the heartbeats that waited before its reaper and real
push reaps first (pd-push-p-stall), the difference KVClock's push hbf models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from clock_checks import assert_admitted_reads_safe, assert_rejected_at
from kvspec.record.clock_mapping import ClockEvent, map_clock
from kvspec.record.doctored import unwritten
from kvspec.record.log import Event, read_dir
from kvspec.record.mapping import map_recording
from kvspec.validate import check_design

REC = Path(__file__).resolve().parents[2] / "conformance" / "recorded"


def _pd_push() -> list[Event]:
    return read_dir(REC / "pd-push")


def _p0(events: list[Event]) -> str:
    """The producer's id of the first request (spec r = 1)."""
    m = map_recording(events)
    return next(rid for rid, r in m.requests.items() if r == 1)


def test_the_push_runs_put_each_write_on_the_clock_before_ds_receive() -> None:
    cm = map_clock(_pd_push())
    assert cm.lease_s == 120
    got = [(e.a, e.r, e.w, e.t) for e in cm.log if e.a in ("write", "recv")]
    assert got == [("write", 1, 0, 2), ("write", 2, 0, 2), ("recv", 1, 0, 2), ("recv", 2, 0, 2)]
    tp2 = map_clock(read_dir(REC / "pd-push-tp2"))
    assert sorted((e.r, e.w) for e in tp2.log if e.a == "write") == [
        (1, 0), (1, 1), (2, 0), (2, 1)]
    # pd-push-late: D heartbeats a P that freed both requests at its lease, every second
    late = map_clock(read_dir(REC / "pd-push-late"))
    meta = json.loads((REC / "pd-push-late" / "expect.json").read_text())
    assert late.heartbeats == meta["clock"]["heartbeats"]
    assert not any(e.a == "write" for e in late.log)


@pytest.mark.slow  # an admitted side: make test-full (make e2e validates every push run)
def test_the_real_push_run_is_admitted_by_the_clock_and_reads_safe(tmp_path: Path) -> None:
    assert_admitted_reads_safe(map_clock(_pd_push()), tmp_path)


def _report_of(log: list[ClockEvent], r: int) -> int:
    """The first producer step in which a rank reports r sent."""
    return next(n for n, e in enumerate(log) if e.a == "execute" and any(r in o for o in e.out))


def test_negative_control_a_report_with_no_write_inside_the_lease_is_rejected_there(
    tmp_path: Path,
) -> None:
    events = _pd_push()
    doctored = unwritten(events, "P", _p0(events))
    cm = map_clock(doctored)
    assert [(e.r, e.w) for e in cm.log if e.a == "write"] == [(2, 0)]
    at = _report_of(list(cm.log), 1)
    assert cm.log[at].t < 6  # the lease (6 ticks) had not run out
    assert_rejected_at(cm, at, tmp_path)


@pytest.mark.slow  # an admitted side: the untimed spec's blind spot, make test-full
def test_the_untimed_spec_admits_the_report_with_no_write(tmp_path: Path) -> None:
    events = _pd_push()
    m = map_recording(unwritten(events, "P", _p0(events)))
    v = check_design(m, "v0.30-shipped", tmp_path)
    if v.verdict == "inconclusive":
        pytest.skip(f"inconclusive: {v.detail}")
    assert (v.verdict, v.explained) == ("admitted", len(m.log))


def test_unwritten_refuses_a_request_the_producer_never_wrote() -> None:
    with pytest.raises(ValueError, match="never wrote"):
        unwritten(_pd_push(), "P", "no-such-request")


def _p_worker_gaps(events: list[Event], min_s: float) -> list[tuple[int, int]]:
    """(last P worker event before, first after) each gap of P's worker over min_s."""
    p = [e for e in events if e.engine == "P" and e.role == "worker"
         and e.call in ("get_transfer_results", "heartbeat_recv")]  # fmt: skip
    return [(a.t_ns, b.t_ns) for a, b in zip(p, p[1:], strict=False)
            if b.t_ns - a.t_ns > min_s * 1e9]  # fmt: skip


def test_after_a_producer_stall_pull_handles_waiting_heartbeats_first_push_reaps() -> None:
    """Real 0.32 runs. Pull (queued-heartbeats-shm-recheck): after each stall of P's worker
    its first call is _handle_heartbeat (the heartbeats that waited at the agent, before
    the reaper). Push (pd-push-p-stall): after a 25 s stall P's first step reports both
    requests (the reaper) and no heartbeat is ever handled again, though D sent four before
    the lease's deadline: push reads only what its parked writer thread forwarded (KVClock's
    hbf; the model's push-tp1-wait80s-hb-ok-p-step-15s)."""
    pull = read_dir(REC / "queued-heartbeats-shm-recheck")
    gaps = _p_worker_gaps(pull, 5)
    assert len(gaps) >= 2
    for _, after in gaps:
        first = next(e for e in pull if e.engine == "P" and e.t_ns == after)
        assert first.call == "heartbeat_recv"
    push = read_dir(REC / "pd-push-p-stall")
    meta = json.loads((REC / "pd-push-p-stall" / "expect.json").read_text())
    (before, after), = _p_worker_gaps(push, 20)
    first = next(e for e in push if e.engine == "P" and e.role == "worker" and e.t_ns == after)
    assert first.call == "get_transfer_results" and len(first.ids("finished_sending")) == 2
    assert not any(e.call == "heartbeat_recv" and e.t_ns > before for e in push)
    handled = max(e.t_ns for e in push if e.call == "heartbeat_recv")
    deadline = handled + 20e9  # the last heartbeat P handled, + 2/3 of the 30 s lease
    sent = [e for e in push if e.call == "heartbeat_send" and before < e.t_ns < deadline]
    assert len(sent) == meta["heartbeats_sent_in_stall_before_deadline"]
