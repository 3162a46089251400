"""Checks the decode-side trace-validation tests share: DecodeTrace's verdict on a mapped
recording under 0.32's design (kvspec.validate_decode.check_bug), skipped where TLC gave
none (it timed out twice on a loaded machine: a timeout is never a verdict)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.record.decode_mapping import DecodeMapped
from kvspec.validate_decode import check_bug


def decode_verdict(m: DecodeMapped, tmp: Path) -> tuple[str, int]:
    """(verdict, events explained) of 0.32's decode design on `m`."""
    v = check_bug(m, "none", tmp)
    if v.verdict == "inconclusive":
        pytest.skip(f"inconclusive: {v.detail}")
    return v.verdict, v.explained
