"""D's recorded NIXL handshake on the decode side (spec/DecodeTrace.tla's "hs", HsSeen):
where the recorder wrote D's handshakes, Decode.tla's handshake_done / handshake_fail
happen only at or after the recorded one, with its outcome. The recording
pd-decode-abort-handshake (vLLM 0.32, the handshake 44 ms, READs 2 ms after it) is
admitted; doctored so the handshake returns after the first READ, or fails, it is
rejected at the step that posted that READ; with no handshake recorded (the observation
off), the same READs are admitted: the observation is what rejects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from decode_checks import decode_verdict
from kvspec.record.decode_mapping import DecodeMapped, map_decode
from kvspec.record.log import Event, read_dir
from kvspec.validate_decode import constants

RUN = Path(__file__).resolve().parents[2] / "conformance" / "recorded" / "pd-decode-abort-handshake"


def _events() -> list[Event]:
    return read_dir(RUN)


def _first_read(m: DecodeMapped) -> int:
    return next(n for n, e in enumerate(m.log) if e.a == "execute" and any(e.reads))


def _handshake(events: list[Event]) -> Event:
    return next(e for e in events if e.engine == "D" and e.call == "handshake")


def _replaced(events: list[Event], old: Event, new: Event | None) -> list[Event]:
    out = [new if e is old else e for e in events]
    return sorted((e for e in out if e is not None), key=lambda e: (e.t_ns, e.pid, e.seq))


@pytest.mark.slow  # an admitted side: make test-full
def test_the_recorded_handshake_is_observed_and_admitted(tmp_path: Path) -> None:
    m = map_decode(_events())
    hs = [e for e in m.log if e.a == "hs"]
    assert [(e.w, e.ok) for e in hs] == [(0, True)]
    assert constants(m, "none")["HsSeen"] == "TRUE"
    assert m.log.index(hs[0]) < _first_read(m)  # it returned before D's first READ
    assert decode_verdict(m, tmp_path) == ("admitted", len(m.log))


def test_a_handshake_returning_after_the_first_read_is_rejected_there(tmp_path: Path) -> None:
    events = _events()
    read = next(e for e in events if e.engine == "D" and e.call == "read")
    hs = _handshake(events)
    # the last rank's report after the READ closes the step, so the hs lands after it
    report = next(e for e in events if e.engine == "D" and e.call == "get_transfer_results"
                  and e.t_ns > read.t_ns)  # fmt: skip
    late = dataclasses.replace(hs, t_ns=report.t_ns + 1)
    m = map_decode(_replaced(events, hs, late))
    first = _first_read(m)
    assert m.log[first + 1].a == "hs"
    assert decode_verdict(m, tmp_path) == ("rejected", first)


def test_a_failed_handshake_cannot_have_posted_reads(tmp_path: Path) -> None:
    events = _events()
    hs = _handshake(events)
    failed = dataclasses.replace(hs, result={**hs.result, "ok": False})
    m = map_decode(_replaced(events, hs, failed))
    assert decode_verdict(m, tmp_path) == ("rejected", _first_read(m))


@pytest.mark.slow  # an admitted side: make test-full
def test_without_the_handshake_recorded_it_stays_silent(tmp_path: Path) -> None:
    # the negative control of the two above: the handshake unobserved (HsSeen FALSE, a
    # recording made before 2026-12-05), Decode.tla ends it whenever the READs need
    events = _events()
    m = map_decode(_replaced(events, _handshake(events), None))
    assert not m.hs_recorded and all(e.a != "hs" for e in m.log)
    assert decode_verdict(m, tmp_path) == ("admitted", len(m.log))
