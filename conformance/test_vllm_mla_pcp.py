"""The producer verdicts of the PCP rows do not depend on the fixture's attention.

vLLM 0.32 runs PCP only with MLA models on CUDA (sharding.fixture_model: the selector drops
every backend without supports_pcp, and only MLAAttentionImpl has it), while the CPU suite
drives PCP rows with the OPT fixture. These replay the PCP verdicts of test_vllm_verdicts.py
with the DeepSeek-shaped MLA fixture on CPU: the same traces conform and the shipped code
diverges from `fixed` at the same action, so the OPT fixture's verdicts are the ones vLLM's
production configuration (PCP + MLA) gets.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvspec.replay import INCORRECT, load_trace, replay
from kvspec.traces import find_trace

pytestmark = pytest.mark.vllm


# CPU_MLA, and AMX_MLA in bfloat16: what vLLM runs on an AMX host (vllm_caches.amx_tiles
# lays it out so on any host).
FIXTURES = ["mla", "mla-amx"]


def _replay_mla(name: str, patch: str | None, fixture: str = "mla") -> Any:
    from kvspec.drivers.vllm_driver import VllmDriver

    trace = load_trace(find_trace(name))
    assert trace.row.topology.pcp == 2
    with VllmDriver(trace.row, impl_patch=patch, model=fixture) as driver:
        assert all(driver.c.nixl_worker(w).use_mla for w in range(driver.c.world_size))
        res = replay(driver, trace)
    if res.timeout is not None:  # a wait expired: no verdict either way
        pytest.skip(f"inconclusive: {res.timeout.what} did not happen in {res.timeout.limit_s}s")
    return res


@pytest.mark.parametrize("fixture", FIXTURES)
def test_shipped_vllm_with_mla_replays_the_stall_counterexample(fixture: str) -> None:
    res = _replay_mla("pcp2-v0.30-shipped-nixl/cex-DelayedEventuallyFreed", None, fixture)
    assert res.failure is None, res.failure


@pytest.mark.parametrize("fixture", FIXTURES)
def test_shipped_vllm_with_mla_diverges_from_fixed_at_the_replica_report(fixture: str) -> None:
    # The negative control of the next test: the same trace, the unpatched code.
    res = _replay_mla("conf-fixed-nixl-pcp2/003", None, fixture)
    assert res.failure is not None
    assert (res.failure.cls, res.failure.action) == (INCORRECT, "execute_model")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_patched_vllm_with_mla_follows_fixed(fixture: str) -> None:
    res = _replay_mla("conf-fixed-nixl-pcp2/003", "fix-53903", fixture)
    assert res.failure is None, res.failure
