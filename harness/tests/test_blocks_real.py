"""DecodeBlocks on vLLM's real decode scheduler (kvspec.blocks_traces): 0.32's
AsyncScheduler, a KV consumer with two batches in flight, follows every edge-covering trace
of the deferred-free design; the kept counterexample of the at-once design (#45357's race)
diverges on it where vLLM defers the free, and replays to the race step for step once the
bug is re-introduced in memory (defer_block_free off). That mutant is caught by the shipped
row's traces: the negative control."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from kvspec.blocks import BLOCKS
from kvspec.blocks_traces import REGRESSIONS, conform_row, replay_regression, why_not_driven
from kvspec.itf import value_from_itf
from kvspec.lease_traces import TRACES
from kvspec.sweep import load_sweep_matrix

ROWS = {r.name: r for r in load_sweep_matrix(BLOCKS)}
KEPT = REGRESSIONS / "async-at-once-stop-NoStaleWriteUnderRead.itf.json"
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java not installed")


def test_which_rows_are_driven() -> None:
    assert why_not_driven(ROWS["async-defer-stop"]) is None
    assert why_not_driven(ROWS["sync-at-once-stop"]) is None
    assert "not the installed" in str(why_not_driven(ROWS["async-at-once-stop"]))
    assert why_not_driven(ROWS["async-defer-preempt"]) is None  # Grow, steered
    assert why_not_driven(ROWS["v2pp2-defer-preempt"]) is None  # V2 runner, PP 2
    # every init state; a self-preempting request ends the running loop up to 0.32 only
    assert why_not_driven(ROWS["v2pp2-defer-preempt-priority"], "0.32.0") is None
    assert why_not_driven(ROWS["v2pp2-defer-preempt-priority-v0.33"], "0.34.0") is None
    assert "does go on" in str(why_not_driven(ROWS["v2pp2-defer-preempt-priority"], "0.33.0"))
    assert "does not go on" in str(
        why_not_driven(ROWS["v2pp2-defer-preempt-priority-v0.33"], "0.32.0"))
    assert why_not_driven(ROWS["v2pp2-defer-preempt"], "0.34.0") is None  # FCFS: the same
    assert "stagger" in str(why_not_driven(ROWS["xpu-v2pp2-defer-preempt-priority-no-microbatch"]))


def _driver(pre_fix: bool) -> Any:
    from kvspec.drivers.blocks_driver import BlocksDriver

    return lambda row, plan: BlocksDriver(
        row, pre_fix=pre_fix, prompts=plan.prompts, priorities=plan.priorities
    )


def _shifted(by: int) -> Any:
    """The shipped scheduler with every prompt `by` tokens off the trace's plan."""
    from kvspec.drivers.blocks_driver import BlocksDriver

    return lambda row, plan: BlocksDriver(
        row, prompts={r: p + by for r, p in plan.prompts.items()}, priorities=plan.priorities
    )


@pytest.mark.vllm
@needs_java
def test_the_running_loop_preempts_as_the_spec_says(tmp_path: Path) -> None:
    """Grow steered by the prompt length: every trace of the preemption row conforms
    (vLLM's own running loop picks the victim, running[-1]); negative control: one token
    more, and each request's block boundary comes a schedule before the trace's grow, so
    every trace diverges (each one grows a request)."""
    row = ROWS["async-defer-preempt"]
    res = conform_row(BLOCKS, row, tmp_path, _driver(False))
    assert res.traces > 20 and res.conforming == res.traces, res.divergences
    docs = json.loads((tmp_path / row.name / TRACES).read_text())
    nlocal = int(row.consts["NLocal"])

    def preempts(doc: dict[str, Any]) -> bool:  # a local request back to waiting
        sts = [value_from_itf(s["st"]) for s in doc["states"]]  # a tuple: request r at r - 1
        return any(st[r] == "waiting" for st in sts for r in range(nlocal))  # type: ignore[index]

    assert sum(map(preempts, docs)) >= 10  # preempted on the real scheduler, as the spec
    early = conform_row(BLOCKS, row, tmp_path / "early", _shifted(+1))
    assert len(early.divergences) == early.traces, early


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


HEAP = REGRESSIONS / "v2pp2-defer-preempt-priority-heap-order.itf.json"


@pytest.mark.vllm
def test_under_priority_the_running_order_is_the_heap_s_and_its_victim_is_vllm_s() -> None:
    """The kept priority trace (request 1 of lower priority): vLLM admits request 2 first,
    so request 2 preempts request 1 and takes its block, as the spec now starts (`run`
    sorted by priority, arrival). Negative control: the same steps with every request at
    one priority (the spec's old id-order start, as an FCFS-ordered admission gives)
    diverge at the preempting schedule."""
    from kvspec.drivers.blocks_driver import BlocksDriver

    assert replay_regression(HEAP, ROWS, _driver(False)).divergence is None

    def flat(row: Any, plan: Any) -> Any:
        return BlocksDriver(row, prompts=plan.prompts, priorities={r: 1 for r in plan.priorities})

    bad = replay_regression(HEAP, ROWS, flat).divergence
    assert bad is not None and bad.startswith("step 3"), bad


@pytest.mark.vllm
@needs_java
def test_the_campaign_kills_the_blocks_mutant() -> None:
    from kvspec.mutants import run_mutant
    from kvspec.mutations.catalogue import MUTANTS

    out = run_mutant(MUTANTS["blocks-freed-at-once"])
    assert out.killed and out.trace is not None and out.trace.startswith("async-defer-stop/")


@pytest.mark.vllm
@needs_java
@pytest.mark.slow  # 1,416 traces twice (~50 s): make test-full
def test_three_batches_follow_the_v2_runner_s_decode_stagger(tmp_path: Path) -> None:
    """V2 runner + PP 2 + async: 3 batches, each request decodes every other step; the
    shipped scheduler follows every trace. Negative control: the stagger set to 1 (XPU
    without PP microbatching) schedules requests the spec skips, and traces diverge."""
    from kvspec.drivers.blocks_driver import BlocksDriver

    row = ROWS["v2pp2-defer-preempt"]
    res = conform_row(BLOCKS, row, tmp_path, _driver(False))
    assert res.traces > 1000 and res.conforming == res.traces, res.divergences

    def unstaggered(row: Any, plan: Any) -> Any:
        d = BlocksDriver(row, prompts=plan.prompts, priorities=plan.priorities)
        d.d.decode_stagger = 1
        return d

    bad = conform_row(BLOCKS, row, tmp_path / "m", unstaggered)
    assert bad.divergences and "batches" in bad.divergences[0], bad.divergences[:1]


@needs_java
def test_a_trace_no_prompt_length_can_steer_is_not_driven_and_the_others_still_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prompt_plan refuses a trace longer than a block (DriverUnavailable): that trace
    gets no verdict and says why; the row's other traces are still replayed (a fake
    replay here: what is asserted is the bookkeeping, not vLLM)."""
    import kvspec.blocks_traces as bt
    from kvspec.drivers.vllm_env import DriverUnavailable

    real_plan, seen = bt._plan, []

    def plan(doc: Any, row: Any) -> Any:
        if not seen:
            seen.append(doc)
            raise DriverUnavailable("request 1: no prompt length puts its block boundary")
        return real_plan(doc, row)

    class Fake:
        def __enter__(self) -> Fake:
            return self

        def __exit__(self, *a: object) -> None:
            pass

    monkeypatch.setattr(bt, "_plan", plan)
    monkeypatch.setattr(bt, "replay_blocks", lambda doc, d: bt.BlocksReplay(1, None))
    res = conform_row(BLOCKS, ROWS["async-defer-preempt"], tmp_path, lambda row, p: Fake())
    assert len(res.not_driven) == 1 and "no prompt length" in res.not_driven[0]
    assert res.conforming == res.traces - 1 > 0
    assert res.summary().endswith(", 1 not driven")
