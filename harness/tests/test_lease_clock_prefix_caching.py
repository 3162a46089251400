"""The lease clock's verdicts with vLLM's prefix caching on and a prompt block shared.

`kvspec lease/clock --conform --layout shared-prefix[-d-hit]` run the LeaseClock and KVClock
traces on a producer laid out as vLLM runs by default (drivers/prefix_layout.py): prefix
caching on, every prompt one shared block and one of its own, so two held leases hold one
physical block together, and D moves both blocks (or, d-hit, P's last; each READ's bytes
are compared with P's blocks, as in every replay). These replay one lease row with two
leases in full and a sample of a push clock row; the negative control shows the layout
is what the engine ran: with caching off the same pool cannot hold the second request,
whose lease is never installed. Every LeaseClock row runs in `make review`, every KVClock
row nightly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kvspec.clock import CLOCK
from kvspec.clock_traces import clock_driver_factory
from kvspec.clock_traces import conform_row as clock_conform_row
from kvspec.drivers.base import MissingAction
from kvspec.drivers.prefix_layout import LAYOUTS, SHARED_PREFIX, UNSHARED_CONTROL
from kvspec.lease import LEASE
from kvspec.lease_traces import LeaseConformance, lease_driver_factory
from kvspec.lease_traces import conform_row as lease_conform_row
from kvspec.sweep import Sweep, SweepRow, load_sweep_matrix

pytestmark = pytest.mark.vllm

PREFIX = ("shared-prefix", "shared-prefix-d-hit")
TWO_LEASES = "two-leases-full-scan"  # two leases on one rank, one of them abandoned
PUSH = "push-tp1-wait80s-hb-ok"
PUSH_SAMPLE = 6  # of its ~2,900 edge-covering traces (the whole row: kvspec clock --conform)


def _row(sweep: Sweep, name: str) -> SweepRow:
    return next(r for r in load_sweep_matrix(sweep) if r.name == name)


@pytest.fixture(autouse=True)
def _needs_java_and_nixl() -> None:
    if shutil.which("java") is None:
        pytest.skip("java not installed")
    pytest.importorskip("nixl")


def _verdict(res: LeaseConformance) -> tuple[int, list[str]]:
    if res.inconclusive:  # every retry of a wait expired (a loaded machine): no verdict
        pytest.skip(f"inconclusive: {res.inconclusive[0]}")
    return res.conforming, res.divergences


@pytest.mark.parametrize("layout", PREFIX)
def test_two_leases_sharing_a_block_conform_on_every_edge(layout: str, tmp_path: Path) -> None:
    res = lease_conform_row(
        LEASE, _row(LEASE, TWO_LEASES), tmp_path, lease_driver_factory(LAYOUTS[layout])
    )  # fmt: skip
    assert res.traces > 500
    assert _verdict(res) == (res.traces, [])


@pytest.mark.parametrize("layout", PREFIX)
def test_the_lease_driver_runs_p_laid_out(layout: str) -> None:
    """Both leased requests' blocks start with the one block they share (request 2's
    prefix hit on request 1's cached block): vLLM's block pool counts two holders of it."""
    with lease_driver_factory(LAYOUTS[layout])(2) as d:
        blocks = [tuple(d.vd.params[r]["remote_block_ids"][0]) for r in (1, 2)]
        assert len(blocks[0]) == len(blocks[1]) == 2 and blocks[0][0] == blocks[1][0]
        pool = d.vd.sched.kv_cache_manager.block_pool
        refs = {b.block_id: b.ref_cnt for b in pool.blocks if not b.is_null}
        assert [refs[b] for b in (blocks[0][0], blocks[0][1], blocks[1][1])] == [2, 1, 1]


def test_negative_control_without_prefix_caching_the_second_lease_never_starts() -> None:
    """The shared layout's prompts and pool with caching off: request 2 needs two fresh
    blocks of a pool sized for a shared one, waits, and is never leased."""
    with pytest.raises(MissingAction, match=r"no lease installed for \[2\]"):
        lease_driver_factory(UNSHARED_CONTROL)(2).close()


@pytest.mark.parametrize("layout", PREFIX)
def test_a_push_clock_sample_conforms(layout: str, tmp_path: Path) -> None:
    make = clock_driver_factory(LAYOUTS[layout])
    res = clock_conform_row(CLOCK, _row(CLOCK, PUSH), tmp_path, make, limit=PUSH_SAMPLE)
    assert _verdict(res) == (PUSH_SAMPLE, [])


TWO_REQ = "tp1-2req-wait30s-hb-ok"  # Capacity 2: both requests held at once


@pytest.mark.slow  # a 41,000-state graph (20 s of TLC) and replays: make test-full
def test_negative_control_a_clock_trace_holding_two_requests_needs_the_hit(
    tmp_path: Path,
) -> None:
    """The first KVClock traces of the two-request row conform with the shared block; with
    caching off one of them diverges where the spec schedules both requests at once and
    vLLM's pool (sized for the shared block) keeps request 2 waiting."""
    row = _row(CLOCK, TWO_REQ)
    shared = clock_conform_row(CLOCK, row, tmp_path / "s", clock_driver_factory(SHARED_PREFIX),
                               limit=3)  # fmt: skip
    assert _verdict(shared) == (3, [])

    uncached = clock_driver_factory(UNSHARED_CONTROL)
    bad = clock_conform_row(CLOCK, row, tmp_path / "u", uncached, limit=3)
    _verdict(bad)
    assert any("vLLM ('running', 'waiting')" in d for d in bad.divergences)
