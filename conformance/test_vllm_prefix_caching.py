"""The producer's verdicts with vLLM's prefix caching on and a prompt block shared.

Every other conformance replay gives each request a one-block prompt of its own with
prefix caching off; vLLM runs with it on (drivers/prefix_layout.py cites where). These
replay two-request spec paths on the real Scheduler in the shared-prefix layout: request
2's prompt hits the block request 1 holds, so one physical block belongs to two held
requests. In the d-hit layout D asks for each request's own block only and NIXL moves P's
last block. The whole suite in these layouts is `pytest conformance --driver vllm --layout
shared-prefix[-d-hit]` (make test-full).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
from kvspec.conform import driver_factory, replay_retrying
from kvspec.drivers.prefix_layout import (
    SHARED_PREFIX,
    SHARED_PREFIX_D_HIT,
    UNSHARED_CONTROL,
    Layout,
    unsupported,
)
from kvspec.matrix import ModelRow, Topology
from kvspec.replay import (
    INCORRECT,
    ReplayResult,
    load_trace,
    replay,
    retry_timeouts,
    trace_from_actions,
)
from kvspec.traces import find_trace
from kvspec.vocab import Action

pytestmark = pytest.mark.vllm

PREFILL = ("schedule", "execute_model", "update_from_output")
# Both requests prefilled in one step, then the metadata that ships their leases.
BOTH_HELD = (*PREFILL, *PREFILL)
# The shipped design's untimed lease (pcp1-tp1-v0.30-shipped-nixl-untimed's counterexample
# of NoFreeWhileInFlight) with two requests: request 2's lease runs out under its READ.
FREE_2_UNDER_READ = (*BOTH_HELD, "consumer_start_load_kv(2, 0)", "lease_expire(2, 0)", *PREFILL)


def _row(**kw: Any) -> ModelRow:
    base = ModelRow(
        name="x-prefix-2req", variant="v0.30-shipped", composition="nixl",
        topology=Topology(1, 1, 1), requests=2, capacity=2, async_scheduling=False,
    )  # fmt: skip
    return replace(base, **kw)


def _replay(row: ModelRow, script: tuple[str, ...], layout: Layout) -> tuple[ReplayResult, Any]:
    """Replay the spec's path `script` on a fresh driver, retrying a timeout with longer
    waits (retry_timeouts); the driver of the last attempt stays open for the caller to
    read vLLM's block pool (closed by the `opened` fixture's teardown)."""
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

    trace = trace_from_actions(row, [Action.parse(a) for a in script], f"{row.name}/script")
    last: list[Any] = []

    def once(scale: float) -> ReplayResult:
        driver = VllmDriver(row, layout=layout, waits=DEFAULT_WAITS.scaled(scale))
        try:
            res = replay(driver, trace)
        except BaseException:
            driver.close()
            raise
        if res.timeout is not None:
            driver.close()
        else:
            last.append(driver)
        return res

    res = retry_timeouts(once)
    if res.timeout is not None:  # every attempt timed out: no verdict either way
        pytest.skip(f"inconclusive: {res.timeout.what} did not happen in {res.timeout.limit_s}s")
    return res, last[0]


@pytest.fixture
def opened() -> Any:
    drivers: list[Any] = []
    yield drivers
    for d in drivers:
        d.close()


def _refs(driver: Any) -> dict[int, int]:
    """P's real block pool: block id -> ref_cnt (0: in the free queue)."""
    pool = driver.sched.kv_cache_manager.block_pool
    return {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null}


def test_two_held_requests_share_a_block_and_conform(opened: list[Any]) -> None:
    res, d = _replay(_row(), (*BOTH_HELD, "consumer_start_load_kv(2, 0)",
                              "consumer_get_finished(2, 0)", *PREFILL), SHARED_PREFIX)  # fmt: skip
    opened.append(d)
    assert res.failure is None, res.failure
    assert d.sched.kv_cache_manager.enable_caching
    shared = d.blocks[1] & d.blocks[2]
    assert len(shared) == 1 and len(d.blocks[1] | d.blocks[2]) == 3
    (s,) = shared
    # D read both of request 2's blocks, the shared one first, and P freed request 2 on its
    # notification: its own block is free, the shared block is request 1's alone.
    assert d.reads[(2, 0)].remote == (s, *(d.blocks[2] - shared))
    refs = _refs(d)
    assert refs[s] == 1 and all(refs[b] == 0 for b in d.blocks[2] - shared)
    assert all(refs[b] == 1 for b in d.blocks[1])


def test_without_prefix_caching_the_same_path_diverges_at_the_schedule(opened: list[Any]) -> None:
    # The negative control: the same prompts and pool with prefix caching off. Request 2
    # needs two fresh blocks where one is left, so vLLM keeps it waiting where the spec
    # (Capacity 2) schedules it: the shared layout's conformance rests on the prefix hit.
    res, d = _replay(_row(), BOTH_HELD, UNSHARED_CONTROL)
    opened.append(d)
    assert res.failure is not None
    assert (res.failure.cls, res.failure.action, res.failure.step) == (INCORRECT, "schedule", 1)
    assert d.blocks == {1: d.blocks[1]} and len(d.blocks[1]) == 2


def test_a_free_under_read_frees_only_the_blocks_no_other_request_holds(
    opened: list[Any],
) -> None:
    # The shipped design frees request 2 under its READ (NoFreeWhileInFlight violated, as
    # the spec says and the replay reproduces); with the block shared, vLLM's ref counts
    # keep the shared block while request 1 holds it, and free it under the READ once
    # request 1's lease runs out too. The spec's per-request verdict is exact for a
    # request's own blocks and, for a shared block, exact once its last holder goes.
    row = _row(timing="untimed")
    res, d = _replay(row, FREE_2_UNDER_READ, SHARED_PREFIX)
    opened.append(d)
    assert res.failure is None, res.failure
    assert d.observe()["req"] == ("sending", "freed")
    assert d.reads[(2, 0)].state == "inflight"
    (s,) = d.blocks[1] & d.blocks[2]
    (own,) = d.blocks[2] - {s}
    assert (_refs(d)[own], _refs(d)[s]) == (0, 1)
    res2, d2 = _replay(row, (*FREE_2_UNDER_READ, "lease_expire(1, 0)", *PREFILL), SHARED_PREFIX)
    opened.append(d2)
    assert res2.failure is None, res2.failure
    assert d2.observe()["req"] == ("freed", "freed") and d2.reads[(2, 0)].state == "inflight"
    assert _refs(d2)[s] == 0


@dataclass(frozen=True)
class _FrontTrim(Layout):
    """A wrong reading of NIXL's trim, for the negative control: P's first blocks."""

    def moved(self, remote: tuple[int, ...]) -> tuple[int, ...]:
        return remote[: self.d_blocks]


FRONT_TRIM = _FrontTrim("front-trim-control", True, True, d_hit=True)
READ_2 = (*BOTH_HELD, "consumer_start_load_kv(2, 0)", "consumer_get_finished(2, 0)")


def test_d_hit_moves_p_last_block_only(opened: list[Any]) -> None:
    # The bytes check of consumer_get_finished compares D's one block with the block the
    # layout says moved: P's own block of request 2, not the shared one.
    res, d = _replay(_row(), READ_2, SHARED_PREFIX_D_HIT)
    opened.append(d)
    assert res.failure is None, res.failure
    (s,) = d.blocks[1] & d.blocks[2]
    assert d.reads[(2, 0)].local == (2,) and d.reads[(2, 0)].remote == tuple(d.blocks[2] - {s})


def test_d_hit_with_p_first_block_fails_the_bytes_check() -> None:
    # The negative control: had NIXL moved P's first (shared) block, D's block would not
    # equal the one the d-hit layout expects, and the READ's byte check says so.
    from kvspec.drivers.push_actions import TransferCorrupted

    with pytest.raises(TransferCorrupted, match="differs after the READ"):
        _replay(_row(), READ_2, FRONT_TRIM)[1].close()


@pytest.mark.parametrize("layout", [SHARED_PREFIX, SHARED_PREFIX_D_HIT], ids=lambda x: x.name)
@pytest.mark.parametrize(
    "name",
    [
        "conf-v0.30-shipped-nixl-2req/099",  # both held in one step
        "pcp2-v0.30-shipped-nixl/cex-NoStall",  # Capacity 1: request 2 waits for the pool
        "pcp2-v0.30-shipped-nixl/cex-DelayedEventuallyFreed",
        "conf-v0.30-shipped-nixl-push-pcp1/037",  # push: P WRITEs D's registered blocks
        "conf-v0.30-shipped-offload-upstream-reuse/001",  # the offloading child's fence
    ],
)
def test_committed_paths_conform_with_the_prefix_shared(name: str, layout: Layout) -> None:
    trace = load_trace(find_trace(name))
    assert unsupported(layout, trace.row) is None
    res = replay_retrying(driver_factory("vllm", "cpu", None, layout.name), trace)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout.what} did not happen in {res.timeout.limit_s}s")
    assert res.failure is None, res.failure


def test_the_layout_refuses_only_dcp_sharded_rows() -> None:
    for kw in ({}, {"composition": "multi-nixl-hf3fs"}, {"transfer": "push"},
               {"composition": "multi-nixl-offload-upstream"}):  # fmt: skip
        assert unsupported(SHARED_PREFIX, _row(**kw)) is None
    sharded = _row(topology=Topology(1, 1, 2), dcp=2)
    assert "DCP" in str(unsupported(SHARED_PREFIX, sharded))
    assert unsupported(Layout("one-block", False, False), sharded) is None
