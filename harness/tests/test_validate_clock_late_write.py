"""Push mode's WRITE from freed blocks, in trace validation (spec/ClockTrace.tla with
KVClock's PHsMax open: P's lazy handshake with D, `push_match` silent, `push_handshake_done`
at P's recorded `handshake`, `push_deferred` at the `write` after it). A recording whose
producer handshakes D after its lease ran out and it freed the requests, and then WRITEs
them, is a behaviour of 0.32's design: admitted, and flagged (NoWriteFromFreed on the run).
The recording: the real pd-push-p-handshake-fail run (its staged fault refused P's
handshake with D; P freed both requests at its lease, 32.4 s after the match), doctored so
that the handshake succeeds 1 ms after the free and the writer re-drives both parked
requests, as vLLM's `_on_handshake` and inbox do. Controls: the same doctoring with the
handshake done before the free is admitted with no WRITE from freed blocks; the proposed
fix (PushLeaseCheck) rejects the late WRITE at that event. The three TLC checks take
about 2-3 min each on 2 cores, so they run in `make test-full` (marked slow); the mapping
tests stay in `make test`."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from kvspec.record.clock_mapping import ClockMapped, map_clock
from kvspec.record.doctored import handshake_done_at
from kvspec.record.log import Event, read_dir
from kvspec.validate_clock import ClockVerdict, check_clock

REC = Path(__file__).resolve().parents[2] / "conformance" / "recorded"
RUN = REC / "pd-push-p-handshake-fail"


@functools.cache
def _events() -> tuple[Event, ...]:
    return tuple(read_dir(RUN))


def _free_ns() -> int:
    """P's free of the requests (the update that reaped both leases)."""
    return max(e.t_ns for e in _events() if e.engine == "P" and e.call == "free_blocks")


def _doctored(after_free: bool) -> ClockMapped:
    at = _free_ns() + 1_000_000 if after_free else _free_ns() - 2_000_000_000
    return map_clock(handshake_done_at(list(_events()), "P", at))


def _verdict(cm: ClockMapped, tmp_path: Path, lease_check: bool = False) -> ClockVerdict:
    v = check_clock(cm, "v0.30-shipped", tmp_path, lease_check=lease_check)
    if "inconclusive" in (v.design.verdict, v.safe, v.writes):
        pytest.skip(f"inconclusive: {v.design.detail}")
    return v


def test_the_doctored_run_maps_the_handshake_then_the_writes_after_the_free() -> None:
    cm = _doctored(after_free=True)
    kinds = [e.a for e in cm.log]
    free = next(n for n, e in enumerate(cm.log) if e.a == "update" and e.freed)
    assert kinds[free + 1 :][:3] == ["phs", "write", "write"]
    assert cm.phs_recorded
    # the real run: P's failed handshake maps to nothing (no match parked anything)
    assert not any(e.a == "phs" for e in map_clock(list(_events())).log)


def test_handshake_done_at_refuses_a_run_whose_producer_handshake_did_not_fail() -> None:
    with pytest.raises(ValueError, match="no event to doctor"):
        handshake_done_at(read_dir(REC / "pd-push"), "P", 0)


@pytest.mark.slow
def test_a_write_after_the_free_is_admitted_and_flagged(tmp_path: Path) -> None:
    cm = _doctored(after_free=True)
    v = _verdict(cm, tmp_path)
    assert (v.design.verdict, v.design.explained) == ("admitted", len(cm.log))
    assert v.writes == "unsafe"  # NoWriteFromFreed: the WRITEs read freed blocks


@pytest.mark.slow
def test_control_the_same_writes_before_the_free_write_no_freed_block(tmp_path: Path) -> None:
    cm = _doctored(after_free=False)
    v = _verdict(cm, tmp_path)
    assert (v.design.verdict, v.design.explained, v.writes) == ("admitted", len(cm.log), "safe")


@pytest.mark.slow
def test_the_proposed_fix_rejects_the_write_after_the_free(tmp_path: Path) -> None:
    cm = _doctored(after_free=True)
    first = next(n for n, e in enumerate(cm.log) if e.a == "write")
    v = _verdict(cm, tmp_path, lease_check=True)
    assert (v.design.variant, v.design.verdict, v.design.explained) == (
        "v0.30-shipped+push-lease-check", "rejected", first,
    )  # fmt: skip
