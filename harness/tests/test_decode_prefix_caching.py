"""The decode side with vLLM's default prefix caching on: Decode.tla's traces on the real
decode engine (`kvspec decode --conform --prefix-caching`) and DecodeBlocks' on the real
decode scheduler (`kvspec blocks --conform --prefix-caching`).

With it on, D caches a received request's blocks only once the READ landed
(`v1/core/kv_cache_manager.py:602-605`, delay_cache_blocks for a remote load), a freed full
block goes to the free queue's tail and an unhashed one to its head
(`v1/core/block_pool.py:792-803`), and a preempted request's recompute hits its own cached
blocks. Measured 2026-12-07, as with it off: all 18 rows of 0.32's design conform (6,513
traces; the 0.29 rows diverge at `reg`, as they must) and every driven DecodeBlocks row
(4,411 traces); README, "The decode side" and "Decode blocks"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvspec.blocks import BLOCKS  # noqa: E402
from kvspec.blocks_traces import (  # noqa: E402
    REGRESSIONS,
    cached_blocks_driver,
    conform_row,
    hit_counting_driver,
    replay_regression,
)
from kvspec.decode_traces import driver_for, replay_with_retry, suite  # noqa: E402
from kvspec.sweep import load_sweep_matrix  # noqa: E402

pytestmark = pytest.mark.vllm

ROWS = {r.name: r for r in load_sweep_matrix(BLOCKS)}
KEPT = REGRESSIONS / "async-at-once-stop-NoStaleWriteUnderRead.itf.json"


def _cached_blocks(d: Any) -> int:
    """Blocks D's prefix cache holds (hash -> block entries)."""
    return len(d.d.kv_cache_manager.block_pool.cached_block_hash_to_block)


def test_decode_traces_conform_and_d_caches_what_it_received() -> None:
    """Traces 60-74 of conf-decode-d1-fail (the earlier ones abort before a receive; 27
    of its 102 cache a received block, the first is 068) conform with D's prefix caching
    on, and D's cache then holds received blocks (cached once the READ landed,
    scheduler.py:3155-3157); negative control: the same traces with it off leave D's
    cache empty."""
    traces = suite("full", frozenset(["conf-decode-d1-fail"]))[60:75]
    cached = {}
    for caching in (True, False):
        held: list[int] = []
        for name, row, trace in traces:
            make = _recording(driver_for(row, trace, prefix_caching=caching), caching, held)
            res = replay_with_retry(trace, make)  # a timeout retried, then inconclusive
            if res.timeout is not None:
                pytest.skip(f"inconclusive: {name}: {res.timeout}")
            assert res.divergence is None, (name, res.divergence)
        cached[caching] = sum(held)
    assert cached[True] > 0 and cached[False] == 0, cached


def _recording(make: Any, caching: bool, held: list[int]) -> Any:
    """`make`'s drivers, each adding to `held`, as it closes, the blocks D's cache holds."""

    def build(wait_scale: float = 1.0) -> Any:
        d = make(wait_scale)
        assert d.d.kv_cache_manager.enable_caching is caching
        close = d.close

        def close_counting() -> None:
            held.append(_cached_blocks(d))
            close()

        d.close = close_counting
        return d

    return build


def test_preemption_conforms_with_recomputes_that_hit_the_cache(tmp_path: Path) -> None:
    """async-defer-preempt (41 traces): each conforms with prefix caching on, and some
    preempted request's recompute takes a prefix hit on its own cached block; negative
    control: with it off, no lookup hits."""
    row = ROWS["async-defer-preempt"]
    for caching in (True, False):
        hits: list[int] = []
        res = conform_row(BLOCKS, row, tmp_path / str(caching), hit_counting_driver(caching, hits))
        assert res.traces > 20 and res.conforming == res.traces, res.divergences
        assert (sum(hits) > 0) is caching, sum(hits)


def test_prefix_caching_does_not_hide_45357s_race() -> None:
    """The at-once counterexample's freed block is a partial one (no hash), so it goes to
    the free queue's head with caching on too: the race replays step for step with the bug
    re-introduced, and 0.32 as shipped still defers the block."""
    from kvspec.drivers.blocks_driver import BlocksDriver

    def buggy(row: Any, plan: Any) -> Any:
        return BlocksDriver(row, pre_fix=True, prompts=plan.prompts,
                            priorities=plan.priorities, prefix_caching=True)  # fmt: skip

    assert replay_regression(KEPT, ROWS, buggy).divergence is None
    shipped = replay_regression(KEPT, ROWS, cached_blocks_driver).divergence
    assert shipped is not None and "nfree: spec 1, vLLM 0" in shipped


def test_the_cli_flags_exist() -> None:
    import argparse

    from kvspec import blocks, decode

    for mod in (blocks, decode):
        p = argparse.ArgumentParser()
        mod.add_arguments(p)
        assert p.parse_args(["--conform", "--prefix-caching"]).prefix_caching is True
