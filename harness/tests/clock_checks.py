"""Checks the clock trace-validation tests share: KVClock's verdict on a mapped recording
under 0.32's design (kvspec.validate_clock.check_clock), skipped where TLC gave none (it
timed out twice on a loaded machine: a timeout is never a verdict)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.record.clock_mapping import ClockMapped
from kvspec.validate_clock import ClockVerdict, check_clock


def clock_verdict(cm: ClockMapped, tmp_path: Path) -> ClockVerdict:
    v = check_clock(cm, "v0.30-shipped", tmp_path)
    if v.design.verdict == "inconclusive":
        pytest.skip(f"inconclusive: {v.design.detail}")
    return v


def assert_admitted_reads_safe(cm: ClockMapped, tmp_path: Path) -> None:
    v = clock_verdict(cm, tmp_path)
    assert (v.design.verdict, v.design.explained, v.safe) == ("admitted", len(cm.log), "safe")


def assert_rejected_at(cm: ClockMapped, at: int, tmp_path: Path) -> None:
    """Rejected at log event `at`: every event before it explained, that one not."""
    v = clock_verdict(cm, tmp_path)
    assert (v.design.verdict, v.design.explained) == ("rejected", at)
