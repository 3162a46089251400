"""The design verdicts on the installed vLLM, as tests.

These are the claims the README makes: vLLM 0.32.0 as shipped conforms to the spec variant
`v0.30-shipped` and therefore replays the stall counterexample to its end (the real
engine keeps a delayed request forever), while it diverges from `fixed` exactly at the
replica's report; with the fix-53903 patch it follows `fixed`, including the async-
scheduling counterexample in which blocks are freed while an offload store runs.
"""

from __future__ import annotations

import pytest
from kvspec.replay import INCORRECT, load_trace, replay
from kvspec.traces import find_trace

pytestmark = pytest.mark.vllm


def _replay(name: str, patch: str | None, device: str) -> object:
    from kvspec.drivers.vllm_driver import VllmDriver

    trace = load_trace(find_trace(name))
    with VllmDriver(trace.row, device=device, impl_patch=patch) as driver:
        res = replay(driver, trace)
    if res.timeout is not None:  # a wait expired: no verdict either way
        pytest.skip(f"inconclusive: {res.timeout.what} did not happen in {res.timeout.limit_s}s")
    return res


def test_shipped_vllm_replays_the_stall_counterexample(device: str) -> None:
    res = _replay("pcp2-v0.30-shipped-nixl/cex-DelayedEventuallyFreed", None, device)
    assert res.failure is None, res.failure  # type: ignore[attr-defined]


def test_shipped_vllm_diverges_from_fixed_at_the_replica_report(device: str) -> None:
    res = _replay("conf-fixed-nixl-pcp2/003", None, device)
    failure = res.failure  # type: ignore[attr-defined]
    assert failure is not None
    assert failure.cls == INCORRECT
    assert failure.action == "execute_model"
    assert "steps" in failure.diff


def test_patched_vllm_follows_fixed_on_the_same_trace(device: str) -> None:
    res = _replay("conf-fixed-nixl-pcp2/003", "fix-53903", device)
    assert res.failure is None, res.failure  # type: ignore[attr-defined]


def test_patched_vllm_frees_while_storing_under_async_scheduling(device: str) -> None:
    res = _replay(
        "regress-async-fixed-offload-delaying/cex-NoFreeWhileInFlight", "fix-53903", device
    )
    assert res.failure is None, res.failure  # type: ignore[attr-defined]
