"""The design verdicts on the installed vLLM, as tests.

These are the claims the README makes: vLLM 0.32.0 as shipped conforms to the spec variant
`v0.30-shipped` and therefore replays the stall counterexample to its end (the real
engine keeps a delayed request forever), while it diverges from `fixed` exactly at the
replica's report; with the fix-53903 patch it follows `fixed`, including the async-
scheduling counterexample in which MultiConnector(NixlConnector, HF3FSKVConnector) frees a
request's blocks while its HF3FS save is still running.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kvspec.drivers.vllm_view import req_id
from kvspec.replay import INCORRECT, load_trace, replay
from kvspec.traces import find_trace

pytestmark = pytest.mark.vllm


def _replay(
    name: str, patch: str | None, device: str, after: Callable[[Any], None] | None = None
) -> Any:
    """Replay a trace; `after(driver)` runs on the driver at the end of a conforming one."""
    from kvspec.drivers.vllm_driver import VllmDriver

    trace = load_trace(find_trace(name))
    with VllmDriver(trace.row, device=device, impl_patch=patch) as driver:
        res = replay(driver, trace)
        if res.timeout is not None:  # a wait expired: no verdict either way
            what, limit = res.timeout.what, res.timeout.limit_s
            pytest.skip(f"inconclusive: {what} did not happen in {limit}s")
        if res.failure is None and after is not None:
            after(driver)
    return res


def test_shipped_vllm_replays_the_stall_counterexample(device: str) -> None:
    res = _replay("pcp2-v0.30-shipped-nixl/cex-DelayedEventuallyFreed", None, device)
    assert res.failure is None, res.failure


def test_shipped_vllm_diverges_from_fixed_at_the_replica_report(device: str) -> None:
    res = _replay("conf-fixed-nixl-pcp2/003", None, device)
    failure = res.failure
    assert failure is not None
    assert failure.cls == INCORRECT
    assert failure.action == "execute_model"
    assert "steps" in failure.diff


def test_patched_vllm_follows_fixed_on_the_same_trace(device: str) -> None:
    res = _replay("conf-fixed-nixl-pcp2/003", "fix-53903", device)
    assert res.failure is None, res.failure


def test_patched_vllm_frees_while_storing_under_async_scheduling(device: str) -> None:
    def freed_mid_save(driver: Any) -> None:
        # The trace ends in the violation: a request the scheduler no longer holds whose
        # save Future on some rank's AsyncOperationManager is not done.
        in_flight = {
            rid
            for w in range(driver.W)
            for rid, futures in driver.c.hf3fs(w)._save_futures.items()
            if not all(f.done() for f in futures)
        }
        assert in_flight and not in_flight & set(driver.sched.requests)

    res = _replay(
        "regress-async-fixed-hf3fs/cex-NoFreeWhileInFlight", "fix-53903", device, freed_mid_save
    )
    assert res.failure is None, res.failure


@pytest.mark.parametrize(
    ("model", "transfer"),
    [
        ("pcp1-tp1-v0.30-shipped-nixl-untimed", "READ"),
        ("pcp1-tp1-v0.30-shipped-nixl-push-untimed", "WRITE"),
    ],
)
def test_shipped_vllm_frees_under_a_transfer_once_the_lease_passes(
    model: str, transfer: str, device: str
) -> None:
    """Timing = "untimed" (KVCompletion.tla): the lease passes under a running READ (pull)
    or WRITE (push); vLLM's reaper reports the request and the scheduler frees its blocks
    while the transfer still runs (#21570; push_worker.py:833)."""

    def freed_mid_transfer(driver: Any) -> None:
        running = {r for (r, _w), rd in driver.reads.items() if rd.state == "inflight"}
        assert running == {1}, f"no {transfer} in flight at the end: {driver.reads}"
        assert req_id(1) not in driver.sched.requests  # freed: its blocks are back in the pool

    res = _replay(f"{model}/cex-NoFreeWhileInFlight", None, device, freed_mid_transfer)
    assert res.failure is None, res.failure


def test_shipped_vllm_writes_from_freed_blocks_after_a_late_handshake(device: str) -> None:
    """KVCompletion.tla push_match / push_deferred (untimed): P's writer parks r on its
    lazy handshake with D, r's lease passes, the scheduler frees r's blocks, and then the
    writer posts the parked WRITE from them (push_worker.py:247-252, 457-481). The
    hand-picked regression replays to its end on vLLM 0.32 as shipped; real engines did
    the same (conformance/recorded/pd-push-p-handshake-late)."""

    def wrote_after_free(driver: Any) -> None:
        assert driver.reads[(1, 0)].state == "inflight"
        assert req_id(1) not in driver.sched.requests  # freed before the WRITE was posted

    name = "pcp1-tp1-v0.30-shipped-nixl-push-untimed/cex-late-write-NoFreeWhileInFlight"
    res = _replay(name, None, device, wrote_after_free)
    assert res.failure is None, res.failure


def test_push_lease_check_drops_the_late_write(device: str) -> None:
    """Negative control: with the proposed fix (patches push-lease-check: the writer drops
    a parked request its rank's reaper reported) the same trace diverges at the WRITE."""
    name = "pcp1-tp1-v0.30-shipped-nixl-push-untimed/cex-late-write-NoFreeWhileInFlight"
    res = _replay(name, "push-lease-check", device)
    assert res.failure is not None
    assert res.failure.action == "push_deferred(1, 0)"
