"""Trace validation (kvspec validate, spec/KVTrace.tla): recorded runs are admitted by the
designs that can produce them, and doctored ones are rejected at the doctored event.
Synthetic recordings (synth_recording.py) need no engine; the committed recordings under
conformance/recorded/ come from real vLLM 0.32 engines (kvspec scenario)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvspec.cli import main
from kvspec.record import doctored
from kvspec.record.compact import compact
from kvspec.record.log import RecordError, read_dir
from kvspec.record.mapping import MappingError, map_recording
from kvspec.validate import validate_events
from synth_recording import busy_waiting, d_tp2_round_trip, one_request, pcp2_fixed

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "conformance" / "recorded"


def _verdicts(events: list, tmp: Path, variants: tuple[str, ...]) -> dict[str, tuple[str, int]]:
    v = validate_events(events, tmp, variants)
    slow = [d.detail for d in v.designs if d.verdict == "inconclusive"]
    if slow:  # TLC timed out twice (a loaded machine): no verdict either way
        pytest.skip(f"inconclusive: {slow[0]}")
    return {d.variant: (d.verdict, d.explained) for d in v.designs}


def test_a_synthetic_round_trip_is_admitted(tmp_path: Path) -> None:
    got = _verdicts(one_request(), tmp_path, ("fixed",))
    assert {v for v, _ in got.values()} == {"admitted"}


def test_a_pcp_replica_reporting_from_its_queue_is_only_the_fixed_design(tmp_path: Path) -> None:
    got = _verdicts(pcp2_fixed(), tmp_path, ("v0.30-shipped", "fixed"))
    assert got["fixed"][0] == "admitted"
    # v0.30-shipped clears the replica's queue: its report is the 6th spec event
    assert got["v0.30-shipped"] == ("rejected", 5)


def _index_of(events: list, pred: object) -> int:
    log = map_recording(events).log
    return next(n for n, e in enumerate(log) if pred(e))  # type: ignore[operator]


@pytest.mark.parametrize(
    "doctor, at",
    [
        # the report that lost its request is explainable (the notification may come
        # later); the scheduler's finished_sending of it then is not
        (
            lambda ev: doctored.drop_finished_sending(ev, "P", "a"),
            lambda e: e.a == "update" and e.freed,
        ),
        # the free moved before the READ: the update that frees
        (lambda ev: doctored.free_before_read(ev, "P", "a"), lambda e: e.a == "update" and e.freed),
    ],
    ids=["dropped-finished-sending", "free-before-read"],
)
def test_doctored_recordings_are_rejected_at_the_doctored_event(
    doctor: object, at: object, tmp_path: Path
) -> None:
    events = doctor(one_request())  # type: ignore[operator]
    got = _verdicts(events, tmp_path, ("fixed",))
    assert got == {"fixed": ("rejected", _index_of(events, at))}


def test_a_report_from_a_rank_never_read_is_rejected(tmp_path: Path) -> None:
    events = doctored.report_on_rank(pcp2_fixed(), "P", "a", src=1, dst=0)
    got = _verdicts(events, tmp_path, ("fixed",))
    assert {v for v, _ in got.values()} == {"rejected"}
    assert got["fixed"][1] == _index_of(events, lambda e: e.a == "execute" and any(e.out))


def test_a_read_from_a_rank_outside_the_producer_is_a_mapping_error() -> None:
    events = [e if e.call != "read" else type(e)(**{**e.__dict__, "result": {
        **e.result, "remote_rank": 3}}) for e in one_request()]  # fmt: skip
    with pytest.raises(MappingError, match="producer rank 3, outside 0..0"):
        map_recording(events)


def test_a_report_from_a_rank_outside_the_producer_is_a_mapping_error() -> None:
    events = [e if not (e.role == "worker" and e.engine == "P") else
              type(e)(**{**e.__dict__, "rank": 1}) for e in one_request()]  # fmt: skip
    with pytest.raises(MappingError, match="rank 1 reported, but its world is 1"):
        map_recording(events)


def test_a_torn_line_names_file_and_line_and_the_cli_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "P-scheduler-0-1.ndjson").write_text('{"v": 1}\n{"v": 1, "eng')
    with pytest.raises(RecordError, match=r"P-scheduler-0-1.ndjson:1: missing engine"):
        read_dir(tmp_path)
    assert main(["validate", str(tmp_path), "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ndjson:1:" in err[0]


def _recorded(name: str) -> Path:
    d = RECORDED / name
    if not d.is_dir():
        pytest.skip(f"{d} not committed")
    return d


def test_compaction_drops_idle_steps_and_keeps_the_spec_log(tmp_path: Path) -> None:
    events = busy_waiting(idle=30)
    kept = compact(events)
    # 30 idle steps (schedule, report, update each) -> 2 kept: 28 x 3 events dropped
    assert len(events) - len(kept) == 28 * 3
    assert [e.describe() for e in map_recording(kept).log] == [
        e.describe() for e in map_recording(events).log
    ]
    # arrive, step 1, two idle steps, read, recv, the step that reports: 15 events
    assert _verdicts(kept, tmp_path, ("fixed",)) == {"fixed": ("admitted", 15)}


def test_compacting_a_committed_recording_again_changes_nothing() -> None:
    events = read_dir(_recorded("pd-basic"))
    full = [e.describe() for e in map_recording(events).log]
    assert [e.describe() for e in map_recording(compact(events)).log] == full


def test_every_committed_recording_is_compacted_already() -> None:
    # compaction only drops events: the same count is the same recording (xPyD ones too,
    # whose producers, clock shares and decode shares each keep their log)
    runs = sorted(d for d in RECORDED.iterdir() if d.is_dir())
    assert len(runs) >= 28
    assert [d.name for d in runs if len(compact(read_dir(d))) != len(read_dir(d))] == []


@pytest.mark.parametrize(
    "name",
    ["pd-basic", pytest.param("pd-tp2", marks=pytest.mark.slow),  # make test-full
     "pd-abort", "lease-expiry", "queued-heartbeats-shm-recheck",
     "pd-kv-pressure", "pd-multi", "pd-mla", "pd-tp2-mla", "pd-d-tp2",
     "pd-d-tp2-decode-abort"],
)
def test_the_recorded_real_round_trips_are_admitted(name: str, tmp_path: Path) -> None:
    d = _recorded(name)
    meta = json.loads((d / "expect.json").read_text())
    assert meta["admitted"] == ["v0.29", "v0.30-shipped", "fixed", "naive-replicas"]
    # TP 1-2 without PCP cannot tell the designs apart (make e2e checks all four)
    got = _verdicts(read_dir(d), tmp_path, ("v0.30-shipped",))
    assert {v for v, _ in got.values()} == {"admitted"}


def test_the_recorded_read_after_lease_expiry_is_rejected_at_the_read(tmp_path: Path) -> None:
    """A real run (vllm 0.32, `LLM.generate` on the producer) in which the decode engine
    posted its READ after the producer's 30 s lease expired and the blocks were freed."""
    d = _recorded("read-after-lease-expiry")
    events = read_dir(d)
    got = _verdicts(events, tmp_path, ("fixed",))
    assert got["fixed"] == ("rejected", _index_of(events, lambda e: e.a == "read"))


def test_a_stalled_d_of_tp_2_reading_after_the_lease_is_rejected_at_that_read(
    tmp_path: Path,
) -> None:
    """d-tp2-stall-lease-expiry (real engines, D TP 2): D's engine took no step for 10 s
    while request 2 waited in its queue; P's 6 s lease freed it and D READ the freed
    blocks. Rejected at D's first READ of request 2 (a READ, not a coread)."""
    events = read_dir(_recorded("d-tp2-stall-lease-expiry"))
    at = _index_of(events, lambda e: e.a == "read" and e.r == 2)
    assert _verdicts(events, tmp_path, ("fixed",)) == {"fixed": ("rejected", at)}


def _sched(call: str, seq: int, **result: object) -> object:
    from kvspec.record.log import Event

    return Event("P", "kv_producer", "scheduler", 0, 1, 1, seq, seq, call, reqs=("a",),
                 result=dict(result))  # fmt: skip


def test_capacity_is_the_recorded_pool_over_the_blocks_a_request_holds() -> None:
    from kvspec.record.mapping import kv_capacity

    ev = [_sched("add_request", 1, free=3), _sched("request_finished", 2, blocks=2),
          _sched("request_finished", 3, blocks=1)]  # fmt: skip
    assert kv_capacity(ev) is None  # type: ignore[arg-type]  # sizes differ: no bound
    ev[2] = _sched("request_finished", 3, blocks=2)  # type: ignore[call-overload]
    assert kv_capacity(ev) == 1  # type: ignore[arg-type]
    big = [_sched("add_request", 1, free=4000), _sched("request_finished", 2, blocks=2)]
    assert kv_capacity(big) == 2000  # type: ignore[arg-type]
    # recordings made before `blocks` was recorded: unknown (one slot per request)
    assert kv_capacity([_sched("add_request", 1, free=3), _sched("request_finished", 2)]) is None  # type: ignore[list-item]


def test_under_kv_pressure_the_run_is_explained_only_with_the_recorded_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pd-kv-pressure: P's pool holds one request, so request 2 waits at P until D's READ
    frees request 1. Mapped Capacity (3 free blocks // 2 per request = 1) explains it.
    Negative control: one slot per request (the mapping before blocks were recorded) has
    P schedule both at once, and the schedule of request 1 alone is not explained."""
    import kvspec.record.mapping as mapping

    events = read_dir(_recorded("pd-kv-pressure"))
    m = map_recording(events)
    assert m.capacity == 1 and len(m.requests) == 2
    got = _verdicts(events, tmp_path / "cap", ("v0.30-shipped",))
    assert got["v0.30-shipped"][0] == "admitted"
    monkeypatch.setattr(mapping, "kv_capacity", lambda _ev: None)
    verdict, explained = _verdicts(events, tmp_path / "n", ("v0.30-shipped",))["v0.30-shipped"]
    first_schedule = next(n for n, e in enumerate(m.log) if e.a == "schedule" and e.batch)
    assert (verdict, explained) == ("rejected", first_schedule)


def test_a_capacity_the_log_refutes_is_dropped() -> None:
    """Shared prefix blocks let a real pool hold more requests than free // blocks: a log
    with more requests held at once than that keeps one slot per request."""
    from kvspec.record.mapping import SpecEvent, most_holding

    log = [
        SpecEvent("schedule", batch=frozenset({1, 2})),
        SpecEvent("update", freed=frozenset({1})),
        SpecEvent("schedule", batch=frozenset({3})),
        SpecEvent("update", freed=frozenset({2, 3})),
    ]
    assert most_holding(log) == 2
    assert most_holding(map_recording(read_dir(_recorded("pd-kv-pressure"))).log) == 1


def test_a_multiconnector_is_mapped_by_its_children_in_their_order() -> None:
    """The recorded order of MultiConnector's children is the config's (the first child
    that loads a request wins), NIXL under its 0.32 class name. Negative control: the
    children as the recorder once wrote them (sorted) name no composition."""
    from kvspec.record.mapping import MappingError
    from kvspec.validate import composition

    start = next(e.result for e in read_dir(_recorded("pd-multi")) if e.call == "start")
    assert start["children"] == ["NixlPullConnector", "ExampleConnector"]
    assert composition(start) == "multi-nixl-example"
    with pytest.raises(MappingError, match="no KVCompletion composition"):
        composition({**start, "children": sorted(start["children"])})


def test_a_decode_engine_that_never_read_is_still_a_consumer() -> None:
    """Recorded in make e2e (pd-tp2 under load): D's first handshake with P timed out, so
    D posted no READ and P freed at its lease. D is still the consumer: its scheduler
    was handed requests with do_remote_prefill. Negative control: without that, two
    engines schedule and neither READ, and the recording names no single producer."""
    from kvspec.record.log import Event
    from kvspec.record.mapping import MappingError, engines_of

    def ev(engine: str, call: str, seq: int, **result: object) -> Event:
        return Event(engine, "kv_both", "scheduler", 0, 1, seq, seq, seq, call,
                     reqs=("x",), result=dict(result))  # fmt: skip

    events = [ev("P", "schedule", 1), ev("D", "add_request", 2, remote_prefill=True),
              ev("D", "schedule", 3)]  # fmt: skip
    assert engines_of(events) == ("P", ["D"])
    events[1] = ev("D", "add_request", 2, remote_prefill=False)
    with pytest.raises(MappingError, match="found 2 producer engines"):
        engines_of(events)


def test_d_ranks_reading_their_heads_of_one_producer_rank_are_one_spec_read() -> None:
    # D TP 2 > P TP 1 (pd-d-tp2): KVCompletion's READ of (r, w) is the first D rank's, the
    # other rank's is a sibling that must be posted while it is in flight
    log = map_recording(d_tp2_round_trip()).log
    assert [e.describe() for e in log if "read" in e.a] == ["read r=1 w=0", "coread r=1 w=0"]
    # the same D rank reading twice is two READs, as the spec sees it
    log = map_recording(d_tp2_round_trip(second_reader=0)).log
    assert [e.describe() for e in log if "read" in e.a] == ["read r=1 w=0"] * 2


@pytest.mark.parametrize(
    "events, at",
    [
        (d_tp2_round_trip(second_reader=0), lambda e: e.a == "read" and e.r == 1),
        # #56033's count (P waits for one "r:n" whatever D reads): P freed r after D rank
        # 0's READ, and D rank 1 READ freed blocks
        (d_tp2_round_trip(late_sibling=True), lambda e: e.a == "coread"),
    ],
    ids=["one-rank-reads-twice", "sibling-after-the-free"],
)
def test_negative_controls_a_d_tp2_round_trip_is_rejected_at_the_bad_read(
    events: list, at: object, tmp_path: Path
) -> None:
    reads = [n for n, e in enumerate(map_recording(events).log) if at(e)]  # type: ignore[operator]
    assert _verdicts(events, tmp_path, ("fixed",)) == {"fixed": ("rejected", reads[-1])}


def test_a_d_tp2_round_trip_is_admitted(tmp_path: Path) -> None:
    assert _verdicts(d_tp2_round_trip(), tmp_path, ("fixed",))["fixed"][0] == "admitted"


def test_a_real_d_tp2_sibling_read_after_the_free_is_rejected_at_it(tmp_path: Path) -> None:
    """pd-d-tp2 (real engines, P TP 1 -> D TP 2) doctored: D rank 0's READ of the first
    request moved after P's free of it, the run a producer that counted one of the two
    "r:2" notifications would make. Rejected at that READ (a coread of a finished READ)."""
    events = read_dir(_recorded("pd-d-tp2"))
    rid = map_recording(events).requests
    first = next(k for k, r in rid.items() if r == 1)
    doc = doctored.sibling_read_after_free(events, "P", first)
    at = _index_of(doc, lambda e: e.a == "coread" and e.r == 1)
    assert _verdicts(doc, tmp_path, ("fixed",)) == {"fixed": ("rejected", at)}
