"""Spec's fairness is written with cheap guards in place of ENABLED (KVCompletion.tla,
Fairness); the invariant FairnessExact proves them equal in every reachable state. A wrong
guard must violate it (the negative control), the shipped guards must not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kvspec.matrix import SPEC_FILE, ModelRow, Topology
from kvspec.tlc import run_tlc

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")

GUARD = "CanUpdate == ~lateFinish /\\ Len(steps) > 0 /\\ steps[1].ran"
# A row whose pipeline holds two steps (async): a scheduled, not yet executed step is
# where update_from_output's guard and this wrong one differ.
ROW = ModelRow(
    name="fairness", variant="fixed", composition="nixl", topology=Topology(1, 1, 1),
    requests=1, capacity=1, async_scheduling=True, expect={},
)  # fmt: skip


def _check(tmp_path: Path, spec_text: str) -> str:
    spec = tmp_path / SPEC_FILE.name
    spec.write_text(spec_text)
    cfg = tmp_path / "fair.cfg"
    cfg.write_text(ROW.cfg_text(["TypeOK", "FairnessExact"], []))
    res = run_tlc(spec, cfg, deadlock=False, timeout_s=300, log_dir=tmp_path / "tlc")
    return res.verdict


def test_the_shipped_guards_equal_enabled(tmp_path: Path) -> None:
    assert _check(tmp_path, SPEC_FILE.read_text()) == "holds"


def test_a_guard_wider_than_enabled_violates_fairness_exact(tmp_path: Path) -> None:
    text = SPEC_FILE.read_text()
    assert GUARD in text
    wrong = text.replace(GUARD, "CanUpdate == ~lateFinish /\\ Len(steps) > 0")
    assert _check(tmp_path, wrong) == "violated"
