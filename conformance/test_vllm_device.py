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
            got, sent = cache[rd.local[0]], d.c.caches[0][name][rd.remote[0]]
            assert got.device.type == device and torch.equal(got, sent)
            assert bool(sent.abs().sum() > 0)  # a zero block would match an unread one


def test_vllms_own_offloading_worker_copies_a_stored_block_to_host(device: str) -> None:
    """vLLM's stock CPUOffloadingWorker (gpu_worker.py) on the cluster's own VRAM caches:
    a store job copies the block's bytes to its host tier on a CUDA stream and get_finished
    reports the job once, successful. The replays hold stores instead (offload_upstream.py);
    this is the transfer engine they stand in for, on the caches vLLM canonicalised."""
    if device != "cuda":
        pytest.skip("vLLM's CPU offloading worker refuses CPU caches (cpu/spec.py:199-203)")
    from kvspec.drivers.vllm_driver import VllmDriver
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

    with VllmDriver(_row("multi-nixl-offload-upstream", 1), device=device) as d:
        kv = d.c.workers[0]._connectors[1].connector_worker.worker.kv_caches
        torch = d.c.api.torch
        block = 1  # block 0 is vLLM's null block
        # Each tensor as the worker sees it: one row of page_size_bytes per block.
        pages = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv.tensors]
        for i, page in enumerate(pages):
            page[block].fill_(i + 7)
        stock = CPUOffloadingWorker(kv_caches=kv, blocks_per_chunk=1, num_cpu_chunks=2)
        try:
            host = stock._store_handler.dst_tensors
            assert all(h.device.type == "cpu" and not bool(h.any()) for h in host)
            groups = len(kv.group_data_refs)
            src = GPULoadStoreSpec([block] * groups, [1] * groups, [0] * groups)
            assert stock.submit_store(7, src, CPULoadStoreSpec([0] * groups))
            stock.wait({7})  # the job's CUDA event: blocks until the copy is done
            got = stock.get_finished()
            assert [(r.job_id, r.success) for r in got] == [(7, True)]
            assert stock.get_finished() == []  # reported once
            for i, page in enumerate(pages):
                sent = page[block].cpu()
                assert torch.equal(host[i][0], sent)
                assert bool((sent == i + 7).all())  # a zero host chunk would not match
        finally:
            stock.shutdown()
