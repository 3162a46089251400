"""Trace validation against the lease clock (kvspec validate --side clock,
spec/ClockTrace.tla): recorded real runs, heartbeats and time included, are behaviours of
KVClock; doctored ones (a lease they did not run under, heartbeats P never handled) are
not, at the event that gives them away. The recordings under conformance/recorded/ come
from real vLLM 0.32 engines (kvspec scenario); the heartbeat-kept lease is synthetic
(synth_recording.heartbeating): on 2 shared cores every real attempt stalled D (README)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from kvspec.record import doctored
from kvspec.record.clock_mapping import ClockEvent, map_clock
from kvspec.record.compact import compact
from kvspec.record.log import Event, read_dir
from kvspec.record.mapping import MappingError
from kvspec.validate_clock import validate_clock
from synth_recording import heartbeating

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "conformance" / "recorded"


def _recorded(name: str) -> list[Event]:
    d = RECORDED / name
    if not d.is_dir():
        pytest.skip(f"{d} not committed")
    return read_dir(d)


def _verdict(events: list[Event], tmp: Path) -> tuple[str, int, str, list[ClockEvent]]:
    v = validate_clock(events, tmp, ("v0.30-shipped",))
    (d,) = v.designs
    if d.design.verdict == "inconclusive":  # TLC timed out twice (a loaded machine)
        pytest.skip(f"inconclusive: {d.design.detail}")
    return d.design.verdict, d.design.explained, d.safe, v.mapped.log


def _first(log: list[ClockEvent], pred: object) -> int:
    return next(n for n, e in enumerate(log) if pred(e))  # type: ignore[operator]


# ------------------------------------------------------------------ mapping (pure)
def test_heartbeats_map_as_swallowed_then_unhandled() -> None:
    """The hand-off run: D's first two heartbeats found the handshake pending; the next
    two went out after P had freed everything and stopped stepping (never handled)."""
    cm = map_clock(_recorded("handoff-lease-expiry"))
    meta = json.loads((RECORDED / "handoff-lease-expiry" / "expect.json").read_text())
    hbs = [e for e in cm.log if e.a == "hb"]
    assert cm.lease_s == 6 and len(hbs) == meta["clock"]["heartbeats"]
    assert [e.swallow for e in hbs] == [True, True, False, False]
    assert all(e.lost == {0} for e in hbs[2:]) and cm.swallow_first


def test_the_clock_keeps_a_producer_step_in_every_tick() -> None:
    """A lease that ran out must be reaped at P's next step: each tick keeps P's steps."""
    cm = map_clock(_recorded("handoff-lease-expiry"))
    ticks = {e.t for e in cm.log if e.a == "execute"}
    assert set(range(7)) <= ticks
    assert [e.t for e in cm.log] == sorted(e.t for e in cm.log)


def test_compacting_keeps_the_clock_log() -> None:
    events = _recorded("handoff-lease-expiry")
    again = compact(events)
    assert len(again) == len(events)
    assert [e.describe() for e in map_clock(again).log] == [
        e.describe() for e in map_clock(events).log
    ]


def test_a_recording_without_a_lease_needs_one_and_a_lease_needs_whole_ticks() -> None:
    events = _recorded("pd-basic")  # recorded before the start event said its lease
    with pytest.raises(MappingError, match="--lease"):
        map_clock(events)
    assert map_clock(events, lease_s=120).lease_s == 120
    with pytest.raises(MappingError, match="multiple of 6"):
        map_clock(events, lease_s=31)


# ------------------------------------------------------------------ TLC
def test_negative_control_the_same_run_under_a_longer_lease_frees_too_early(
    tmp_path: Path,
) -> None:
    """Claimed 12 s: the reaper's free came at half the lease: rejected at that step."""
    events = doctored.claim_lease(_recorded("handoff-lease-expiry"), "P", 12)
    verdict, explained, _, log = _verdict(events, tmp_path)
    assert (verdict, explained) == (
        "rejected",
        _first(log, lambda e: e.a == "execute" and any(e.out)),
    )


@pytest.mark.slow  # an admitted side (its negative control, the longer lease, stays)
def test_a_lease_reaped_when_it_runs_out_is_admitted(tmp_path: Path) -> None:
    """P only, nobody reads: the reaper frees in the tick the 6 s lease ends."""
    verdict, explained, safe, log = _verdict(_recorded("lease-expiry"), tmp_path)
    assert (verdict, explained, safe) == ("admitted", len(log), "safe")


@pytest.mark.parametrize(
    ("name", "heartbeats"),
    # the D TP 2 run's (8 s) in make test-full: the same explanation as the others'
    [("handoff-lease-expiry", 4), ("d-stall-lease-expiry", 11),
     pytest.param("d-tp2-stall-lease-expiry", 3, marks=pytest.mark.slow)],
)
def test_runs_that_read_freed_blocks_are_explained_up_to_that_read(
    name: str, heartbeats: int, tmp_path: Path
) -> None:
    """The hand-off outlasted the lease (no heartbeat possible), or D's engine stalled
    12 s with a heartbeat due: P's free at the lease is explained, D's READ is not."""
    meta = json.loads((RECORDED / name / "expect.json").read_text())
    verdict, explained, _, log = _verdict(_recorded(name), tmp_path)
    assert sum(1 for e in log if e.a == "hb") == heartbeats == meta["clock"]["heartbeats"]
    r = meta["clock"].get("read_r")  # the request READ after its free (default: any)
    at = _first(log, lambda e: e.a == "read" and r in (None, e.r))
    assert (verdict, explained) == ("rejected", at)


@pytest.mark.slow  # an admitted side (make test-full); its negative control stays
def test_heartbeats_p_handled_keep_a_lease_alive_past_its_end(tmp_path: Path) -> None:
    """D waits 10 ticks (the lease is 6) heartbeating every tick; P handles each: the lease
    never runs out, P frees on the READ's notification: admitted, reads safe."""
    verdict, explained, safe, log = _verdict(heartbeating(), tmp_path)
    assert (verdict, explained, safe) == ("admitted", len(log), "safe")
    assert sum(1 for e in log if e.a == "hb" and not e.swallow and not e.lost) == 10


def test_negative_control_heartbeats_p_never_handled_cannot_keep_the_lease(
    tmp_path: Path,
) -> None:
    """The same run without P's receipts: the lease ran out during tick 6 (stamped in
    tick 0, its deadline falls inside tick 6: ClockTrace's deadline_passes), so by tick 7
    (8 if P shipped the deadline a tick late) and P's step then did not reap it:
    rejected there."""
    events = doctored.drop_heartbeat_receipts(heartbeating(), "P")
    verdict, explained, _, log = _verdict(events, tmp_path)
    assert verdict == "rejected"
    # a P step in tick 7, or 8: P may have shipped the deadline a tick late (ShipLate)
    assert log[explained].a == "execute" and log[explained].t in (7, 8)


@pytest.mark.slow  # an admitted side: make test-full (its negative control stays)
def test_a_real_heartbeat_kept_lease_with_a_late_producer_is_admitted(tmp_path: Path) -> None:
    """A real run (shm queue re-check shortened: P, not D, stalled). D's heartbeats kept
    the 12 s lease alive for 32 s; P's worker installed request 2's deadline 4.9 s late.
    Admitted and safe with ShipLate (time passes while a deadline is unshipped); without
    it (KVClock's first urgency) the run left the model at D's second heartbeat."""
    verdict, explained, safe, log = _verdict(_recorded("queued-heartbeats-shm-recheck"), tmp_path)
    assert (verdict, explained, safe) == ("admitted", len(log), "safe")
    free = _first(log, lambda e: e.a == "execute" and any(e.out))
    assert log[free].t > 2 * 6  # freed more than two leases after request_finished


def test_mla_notify_only_ranks_are_reads_of_no_bytes() -> None:
    """pd-tp2-mla (real engines, MLA, P TP 2 -> D TP 1): D READs producer rank 0 and, right
    after posting it, notifies rank 1 (pull_worker.py:369-391). KVClock has a READ per
    producer rank: the notify-only one is mapped as a READ of no bytes posted with the real
    one (the run is admitted, reads safe: the next test)."""
    log = map_clock(_recorded("pd-tp2-mla")).log
    reads = [(e.r, e.w) for e in log if e.a == "read"]
    assert reads and {w for _, w in reads} == {0, 1}
    # each notify-only READ right after the READ D posted, of the same request
    assert all(reads[k + 1] == (r, 1) for k, (r, w) in enumerate(reads) if w == 0)


# TLC's run (10 s) in make test-full; the mapping above and the control below in make test
@pytest.mark.slow
def test_the_mla_run_with_notify_only_reads_is_admitted(tmp_path: Path) -> None:
    verdict, explained, safe, log = _verdict(_recorded("pd-tp2-mla"), tmp_path)
    assert (verdict, explained, safe) == ("admitted", len(log), "safe")


def test_negative_control_without_mla_rank_1s_report_has_no_read(tmp_path: Path) -> None:
    """The same run recorded as non-MLA: rank 1 reports r sent with no READ of it posted,
    which no KVClock step explains: rejected at that report."""
    events = [
        replace(e, result={**e.result, "mla": False}) if e.call == "start" else e
        for e in _recorded("pd-tp2-mla")
    ]
    verdict, explained, _, log = _verdict(events, tmp_path)
    assert verdict == "rejected"
    assert log[explained].a == "execute" and log[explained].out[1]


def test_mla_with_d_tp_above_1_is_not_mapped_onto_the_clock() -> None:
    """KVClock models one decode worker: an MLA D of TP 2 reading a P of TP 4 is refused
    with one line (no verdict). Negative control: pd-tp2 (no MLA) maps."""
    events = _recorded("pd-tp2-mla")
    starts = {e.engine: e.result for e in events if e.call == "start"}
    p = next(k for k, v in starts.items() if v.get("mla") and int(v.get("tp", 1)) == 2)
    doctored_tp = [
        replace(e, result={**e.result, "tp": 4 if e.engine == p else 2})
        if e.call == "start" else e
        for e in events
    ]  # fmt: skip
    with pytest.raises(MappingError, match="P TP > D TP > 1"):
        map_clock(doctored_tp)
    assert map_clock(_recorded("pd-tp2"), lease_s=120).log  # recorded before the lease was


def test_every_d_ranks_send_of_one_heartbeat_is_one_clock_heartbeat() -> None:
    """pd-d-tp2 (real engines, P TP 1 -> D TP 2): D's scheduler packages a heartbeat and
    every D rank sends it (base_worker.py _send_heartbeats), so the 4 recorded sends are
    KVClock's 2 heartbeats (the run is admitted, reads safe: the next test)."""
    events = _recorded("pd-d-tp2")
    meta = json.loads((RECORDED / "pd-d-tp2" / "expect.json").read_text())["clock"]
    assert sum(1 for e in events if e.call == "heartbeat_send") == meta["sends"]
    assert sum(1 for e in map_clock(events).log if e.a == "hb") == meta["heartbeats"]


# TLC's run (10 s) in make test-full; the mapping above and the control below in make test
@pytest.mark.slow
def test_the_d_tp2_run_with_grouped_heartbeats_is_admitted(tmp_path: Path) -> None:
    verdict, explained, safe, log = _verdict(_recorded("pd-d-tp2"), tmp_path)
    assert (verdict, explained, safe) == ("admitted", len(log), "safe")


def test_negative_control_each_d_ranks_send_as_a_heartbeat_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run mapped with one heartbeat per send: four within 30 ms, where KVClock's
    D heartbeats once per tick: rejected at a heartbeat."""
    from kvspec.record import clock_mapping

    grouped = clock_mapping._d_heartbeats
    monkeypatch.setattr(clock_mapping, "_d_heartbeats",
                        lambda ev, m: [[e] for g in grouped(ev, m) for e in g])  # fmt: skip
    verdict, explained, _, log = _verdict(_recorded("pd-d-tp2"), tmp_path)
    assert verdict == "rejected" and log[explained].a == "hb"


def test_heartbeats_of_different_payloads_are_not_one_heartbeat() -> None:
    events = _recorded("pd-d-tp2")
    hit = next(e for e in events if e.call == "heartbeat_send" and e.rank == 1)
    doc = [replace(e, reqs=("other",)) if e is hit else e for e in events]
    with pytest.raises(MappingError, match="carry different requests"):
        map_clock(doc)


def _two_d_ranks(events: list[Event], receipts: int) -> list[Event]:
    """`events` as a D of TP 2 sends them: every heartbeat_send also from D rank 1, and
    each P receipt `receipts` times (one per D rank whose message P handled)."""
    out: list[Event] = []
    for n, e in enumerate(events):
        if e.call == "heartbeat_recv":
            out += [replace(e, seq=10_000 + 2 * n + k) for k in range(receipts)]
            continue
        out.append(e)
        if e.call == "heartbeat_send":
            out.append(replace(e, rank=1, pid=e.pid + 1, seq=10_000 + 2 * n, world=2))
    return out


@pytest.mark.parametrize(("receipts", "lost"), [(2, frozenset()), (1, frozenset()),
                                                (0, frozenset({0}))])  # fmt: skip
def test_two_d_ranks_sends_are_one_heartbeat_lost_only_where_none_arrived(
    receipts: int, lost: frozenset[int]
) -> None:
    """The heartbeat-kept synthetic run with D at TP 2 (pd-d-tp2's shape, whose recorded
    heartbeats were all swallowed): each packaged heartbeat is one KVClock heartbeat,
    lost at P rank 0 only where neither D rank's message was handled there."""
    one = [e for e in map_clock(heartbeating(ticks=2)).log if e.a == "hb"]
    two = [e for e in map_clock(_two_d_ranks(heartbeating(ticks=2), receipts)).log
           if e.a == "hb"]  # fmt: skip
    assert len(two) == len(one) == 3
    assert [e.swallow for e in two] == [True, False, False]
    assert all(e.lost == lost for e in two[1:])


def test_a_receipt_no_recorded_decode_worker_sent_is_a_mapping_error() -> None:
    """One D rank, every heartbeat handled twice at P rank 0: more receipts than sends
    (a decode engine that was not recorded). Negative control: the run as recorded maps."""
    events = heartbeating(ticks=2)
    assert map_clock(events).log
    doubled = _two_d_ranks(events, receipts=2)
    one_rank = [e for e in doubled if not (e.call == "heartbeat_send" and e.rank == 1)]
    with pytest.raises(MappingError, match="no recorded decode worker sent"):
        map_clock(one_rank)


# ---------------------------------------------------- heartbeats the recorder would have seen
def _without_heartbeats() -> list[Event]:
    """The heartbeat-kept real run (its 12 s lease lived 32 s) with every heartbeat event
    gone: its recorder (lease in `start`) records every heartbeat, so this log says D sent
    none."""
    return [e for e in _recorded("queued-heartbeats-shm-recheck")
            if e.call not in ("heartbeat_send", "heartbeat_recv")]  # fmt: skip


def test_a_recording_that_records_heartbeats_says_which_were_not_sent(tmp_path: Path) -> None:
    events = _without_heartbeats()
    cm = map_clock(events)
    assert (cm.heartbeats, cm.hb_recorded) == (0, True)
    # no heartbeat kept the lease: P's first step in the tick after it ran out, which
    # freed nothing, is rejected
    verdict, explained, _safe, log = _verdict(events, tmp_path)
    assert verdict == "rejected"
    assert (log[explained].a, log[explained].t) == ("execute", 9)
    # a recorder that could not wrap _send_heartbeats says so: heartbeats are then silent
    note = Event("D", "kv_both", "worker", 0, 1, 9999, 0, 0, "recorder_note",
                 result={"note": "heartbeats not recorded: AttributeError()"})  # fmt: skip
    assert map_clock([*events, note]).hb_recorded is False


@pytest.mark.slow  # 40 s of TLC: the silent heartbeats' interleavings
def test_negative_control_heartbeats_read_as_silent_explain_the_lost_ones(
    tmp_path: Path,
) -> None:
    # the rule before the eighteenth session (heartbeats silent where the log has none)
    from kvspec.validate_clock import check_clock

    cm = replace(map_clock(_without_heartbeats()), hb_recorded=False)
    v = check_clock(cm, "v0.30-shipped", tmp_path)
    if v.design.verdict == "inconclusive":
        pytest.skip(f"inconclusive: {v.design.detail}")
    assert (v.design.verdict, v.safe) == ("admitted", "safe")
