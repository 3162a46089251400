"""Push mode in trace validation (NixlPushConnector, 0.32): the recorder writes the
producer's WRITEs (`write`, push_worker.py _xfer_blocks) and KVTrace explains each by
push_write; D's finished_recving is then an observation that a WRITE was posted. A
synthetic one-request push run (the shape of the conformance driver's push rows) is
admitted; D reporting its receive before P's WRITE is rejected at that receive; the
same log read as pull is rejected at the WRITE (the negative control of the mode)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from kvspec.record.clock_mapping import map_clock
from kvspec.record.log import Event
from kvspec.record.mapping import MappingError, map_recording
from kvspec.validate import check_design
from synth_recording import Synth


def _push_run(write_after_recv: bool = False, connector: str = "NixlPushConnector") -> list[Event]:
    s = Synth()
    s.start()
    s.events[0] = dataclasses.replace(s.events[0], result={**s.events[0].result,
                                                           "connector": connector})  # fmt: skip
    s.ev("P", "scheduler", 0, "add_request", ("a",), free=10)
    s.step(1, new=("a",), finished=("a",))
    s.ev("D", "scheduler", 0, "add_request", ("d-a",), remote_prefill=True, remote_engine="P",
         remote_request_id="a", free=10)  # fmt: skip
    s.step(2)
    write = {"remote_request_id": "d-a", "remote_rank": 0, "remote_engine": "D", "posted": True}
    if not write_after_recv:
        s.ev("P", "worker", 0, "write", ("a",), **write)
    s.recv("a")
    if write_after_recv:
        s.ev("P", "worker", 0, "write", ("a",), **write)
    s.step(3, outs={0: ["a"]}, sending=("a",))
    return s.events


def _verdict(events: list[Event], tmp: Path) -> tuple[str, int]:
    v = check_design(map_recording(events), "v0.30-shipped", tmp)
    if v.verdict == "inconclusive":  # TLC timed out twice (a loaded machine): no verdict
        pytest.skip(f"inconclusive: {v.detail}")
    return v.verdict, v.explained


def _index(events: list[Event], a: str) -> int:
    return next(n for n, e in enumerate(map_recording(events).log) if e.a == a)


@pytest.mark.slow  # an admitted side: make test-full
def test_a_push_run_maps_its_write_and_is_admitted(tmp_path: Path) -> None:
    events = _push_run()
    log = map_recording(events).log
    assert [(e.a, e.r, e.w) for e in log if e.a in ("write", "recv")] == [("write", 1, 0),
                                                                         ("recv", 1, 0)]
    assert _verdict(events, tmp_path) == ("admitted", len(log))


def test_a_receive_before_the_write_is_rejected_there(tmp_path: Path) -> None:
    events = _push_run(write_after_recv=True)
    assert _verdict(events, tmp_path) == ("rejected", _index(events, "recv"))


def test_the_same_log_read_as_pull_is_rejected_at_the_write(tmp_path: Path) -> None:
    events = _push_run(connector="NixlConnector")
    assert _verdict(events, tmp_path) == ("rejected", _index(events, "write"))


def test_the_clock_refuses_push() -> None:
    with pytest.raises(MappingError, match="push mode"):
        map_clock(_push_run(), lease_s=30)


def test_one_write_per_request_and_rank_and_none_where_nothing_was_posted() -> None:
    # KVCompletion has one WRITE per (r, w): a request's WRITEs to several D ranks are
    # that one (the first is its post); an _xfer_blocks that submitted nothing is none
    events = _push_run()
    at = next(n for n, e in enumerate(events) if e.call == "write")
    again = dataclasses.replace(events[at], seq=99, result={**events[at].result,
                                                            "remote_rank": 1})  # fmt: skip
    empty = dataclasses.replace(events[at], seq=98, result={**events[at].result,
                                                            "posted": False})  # fmt: skip
    twice = events[: at + 1] + [again] + events[at + 1 :]
    assert [e.a for e in map_recording(twice).log].count("write") == 1
    unposted = events[:at] + [empty] + events[at + 1 :]
    assert [e.a for e in map_recording(unposted).log].count("write") == 0
