"""DecodeBlocks on vLLM's real decode scheduler (kvspec.blocks_traces): 0.32's
AsyncScheduler, a KV consumer with two batches in flight, follows every edge-covering trace
of the deferred-free design; the kept counterexample of the at-once design (#45357's race)
diverges on it where vLLM defers the free, and replays to the race step for step once the
bug is re-introduced in memory (defer_block_free off). That mutant is caught by the shipped
row's traces: the negative control."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from kvspec.blocks import BLOCKS
from kvspec.blocks_traces import REGRESSIONS, conform_row, replay_regression, why_not_driven
from kvspec.sweep import load_sweep_matrix

ROWS = {r.name: r for r in load_sweep_matrix(BLOCKS)}
KEPT = REGRESSIONS / "async-at-once-stop-NoStaleWriteUnderRead.itf.json"
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")


def test_which_rows_are_driven() -> None:
    assert why_not_driven(ROWS["async-defer-stop"]) is None
    assert why_not_driven(ROWS["sync-at-once-stop"]) is None
    assert "not the installed" in str(why_not_driven(ROWS["async-at-once-stop"]))
    assert "block boundary" in str(why_not_driven(ROWS["async-defer-preempt"]))


def _driver(pre_fix: bool) -> Any:
    from kvspec.drivers.blocks_driver import BlocksDriver

    return lambda row: BlocksDriver(row, pre_fix=pre_fix)


@pytest.mark.vllm
@needs_java
def test_the_shipped_scheduler_follows_the_deferred_free_design(tmp_path: Path) -> None:
    res = conform_row(BLOCKS, ROWS["async-defer-stop"], tmp_path, _driver(False))
    assert res.traces > 10 and res.conforming == res.traces, res.divergences
    # negative control: #45357's bug re-introduced is caught by the same traces
    bad = conform_row(BLOCKS, ROWS["async-defer-stop"], tmp_path / "m", _driver(True))
    assert bad.divergences and "ndeferred" in bad.divergences[0]


@pytest.mark.vllm
def test_45357s_race_happens_only_with_the_bug_reintroduced() -> None:
    shipped = replay_regression(KEPT, ROWS, _driver(False))
    assert shipped.divergence is not None and "nfree: spec 1, vLLM 0" in shipped.divergence
    buggy = replay_regression(KEPT, ROWS, _driver(True))
    assert buggy.divergence is None


@pytest.mark.vllm
@needs_java
def test_the_campaign_kills_the_blocks_mutant() -> None:
    from kvspec.mutants import run_mutant
    from kvspec.mutations.catalogue import MUTANTS

    out = run_mutant(MUTANTS["blocks-freed-at-once"])
    assert out.killed and out.trace is not None and out.trace.startswith("async-defer-stop/")
