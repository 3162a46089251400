"""The vLLM driver's device mode on the real classes (run with --device cuda on a GPU runner).

Where the KV lives is the point of the mode: these tests read back what vLLM's NIXL workers
registered and move real bytes with a real READ on whatever --device says.
"""

from __future__ import annotations

import pytest
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action

pytestmark = pytest.mark.vllm


def _row(comp: str, pcp: int) -> ModelRow:
    return ModelRow(
        name=f"device-{comp}-pcp{pcp}",
        variant="fixed",
        composition=comp,
        topology=Topology(1, 1, pcp),
        requests=1,
        capacity=1,
        async_scheduling=False,
    )


@pytest.mark.parametrize("comp", ["nixl", "multi-nixl-offload-upstream", "multi-nixl-hf3fs"])
def test_caches_live_and_are_registered_where_the_device_says(device: str, comp: str) -> None:
    from kvspec.drivers.vllm_consumers import _check_registration
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.drivers.vllm_env import DEVICES, device_plan
    from kvspec.drivers.vllm_inbox import ClusterError

    plan = device_plan(device)
    (other,) = set(DEVICES) - {device}
    with VllmDriver(_row(comp, 2), device=device, impl_patch="fix-53903") as d:
        c = d.c
        for w in range(c.world_size):
            assert set(c.nixl_worker(w).region_mem_types) == {plan.nixl_memory}
            assert not c.nixl_worker(w).use_host_buffer
            assert {t.device.type for t in c.caches[w].values()} == {device}
            # Negative control: the cluster's own check refuses this worker under the
            # other device's plan (so it would catch vLLM staging or mis-registering).
            with pytest.raises(
                ClusterError, match=f"registered its KV caches as {plan.nixl_memory}"
            ):
                _check_registration(c.nixl_worker(w), device_plan(other), f"rank {w}")
            if comp == "multi-nixl-hf3fs":
                # vLLM's HF3FS child read the same caches (_setup_kv_cache_config): its
                # save path gathers from this device.
                child = c.workers[w]._connectors[1]
                assert child._device.type == device
                assert child._kvcache_ptrs.device.type == device
                assert c.hf3fs(w)._device.type == device
        for t in range(len(c.consumers)):
            assert set(c.consumers[t].connector_worker.region_mem_types) == {plan.nixl_memory}
            assert {x.device.type for x in c.consumers_caches[t].values()} == {device}


def test_read_moves_the_producer_bytes_on_the_device(device: str) -> None:
    from kvspec.drivers.vllm_driver import VllmDriver

    with VllmDriver(_row("nixl", 1), device=device) as d:
        for a in ("schedule", "execute_model", "update_from_output") * 2:
            d.step(Action.parse(a))
        d.step(Action.parse("consumer_start_load_kv(1, 0)"))
        d.step(Action.parse("consumer_get_finished(1, 0)"))  # TransferCorrupted on mismatch
        rd = d.reads[(1, 0)]
        torch = d.c.api.torch
        for name, cache in d.c.consumers_caches[0].items():
            got, sent = cache[rd.local_block], d.c.caches[0][name][rd.remote_block]
            assert got.device.type == device and torch.equal(got, sent)
            assert bool(sent.abs().sum() > 0)  # a zero block would match an unread one
