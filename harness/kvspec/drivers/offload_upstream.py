"""A CPU offloading spec for vLLM's real upstream OffloadingConnector, on every device
(composition `multi-nixl-offload-upstream`). On CPU the stock worker cannot run at all (below).
On CUDA it can, but a replay could not drive it: its `CPUOffloadingWorker` copies GPU blocks
to pinned host memory on CUDA streams and a job completes when the GPU is done, within the
step that submitted it, while a spec trace may keep a store in flight across steps (the
`store` -> `stored` step is the spec's, not the GPU's). So replays hold the store here on
CUDA too, and `conformance/test_vllm_device.py` runs the stock worker on the same VRAM
caches: a store copies the block's bytes to host and is reported once by get_finished. The
stock spec's host
tier is a `SharedOffloadRegion` under /dev/shm that the ranks of an engine share through a
barrier on the world group; here every rank lives in one process whose world group has one
member, so each rank's barrier releases at once, the creator unlinks the name, and the next
rank creates a region of its own. Each rank only ever touches its own slot of a region, so
this differs from a deployment in memory use, not in what a store or load does.

The connector (`vllm...v1.offloading_connector.OffloadingConnector`) runs as shipped on both
sides: scheduler (`OffloadingConnectorScheduler` over the stock `CPUOffloadingManager`, via
`CPUOffloadingSpec.get_manager`) and worker (`OffloadingConnectorWorker`: store/load job
plumbing, `kv_connector_worker_meta` completion reports). Only the spec's transfer engine
is replaced: the stock `CPUOffloadingSpec.get_worker` refuses non-CUDA/XPU tensors ("only
supported on CUDA-alike and XPU"), so `HeldCPUOffloadingSpec.get_worker` returns a
`HeldStoreWorker` instead, an `OffloadingWorker` that copies the blocks into a CPU tier
and completes a job only when asked (`complete`) or when the connector flushes it
(`wait`, the fence vLLM raises before a block with a pending store is reused: the stock
worker blocks there until the copy is done, so completing it there is the same).

What the spec says of this child, and what the driver checks against the real objects:
its `request_finished` never delays the free (so the MultiConnector never creates
`extra_async_saves`), its finished_sending is always empty (stores complete through
`kv_connector_worker_meta`), and its `get_finished_count()` is None, so the MultiConnector's
is None and the aggregator expects world_size reports. The spec's `store`/`stored` are the
delaying child's; for this composition they stay empty.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

SPEC_NAME = "KvspecHeldCPUOffloadingSpec"
MODULE_PATH = __name__
CLASS_NAME = "HeldCPUOffloadingSpec"
# Room for a few one-block chunks of the fixture model (the exact count is immaterial).
CPU_BYTES_TO_USE = 1 << 22


class HeldStoreWorker(OffloadingWorker):  # type: ignore[misc]
    """Transfers of one rank: submitted jobs wait until `complete` (or `wait`) runs them."""

    def __init__(self, kv_caches: CanonicalKVCaches) -> None:
        self.kv_caches = kv_caches
        self.pending: dict[int, tuple[str, Any, Any]] = {}  # job id -> (kind, src, dst)
        self.finished: list[TransferResult] = []
        self.tier: dict[tuple[int, int], Any] = {}  # (tier block, tensor idx) -> bytes

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.pending[job_id] = ("store", src_spec, dst_spec)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self.pending[job_id] = ("load", src_spec, dst_spec)
        return True

    def complete(self, job_id: int) -> None:
        kind, src, dst = self.pending.pop(job_id)
        tensors = [t.tensor for t in self.kv_caches.tensors]
        src_ids = [int(b) for b in getattr(src, "block_ids", [])]
        dst_ids = [int(b) for b in getattr(dst, "block_ids", [])]
        for s, d in zip(src_ids, dst_ids, strict=False):
            for i, t in enumerate(tensors):
                if kind == "store":
                    self.tier[(d, i)] = t[s].clone()
                elif (s, i) in self.tier:
                    t[d].copy_(self.tier[(s, i)])
        self.finished.append(TransferResult(job_id=job_id, success=True))

    def get_finished(self) -> list[TransferResult]:
        done, self.finished = self.finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job_id in sorted(job_ids & set(self.pending)):
            self.complete(job_id)

    def reset(self) -> None:
        self.pending.clear()
        self.finished.clear()
        self.tier.clear()

    def shutdown(self) -> None:
        self.reset()


class HeldCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """The stock CPU spec (scheduler-side manager and sizing), with a CPU-tensor worker."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker = getattr(self, "_held_worker", None)
        if worker is None:
            worker = self._held_worker = HeldStoreWorker(kv_caches)
        return worker


def child_config(role: str) -> dict[str, Any]:
    """The MultiConnector child entry for the upstream OffloadingConnector over the held
    spec."""
    extra: dict[str, Any] = {
        "cpu_bytes_to_use": CPU_BYTES_TO_USE,
        "spec_name": SPEC_NAME,
        "spec_module_path": MODULE_PATH,
    }
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def register() -> None:
    """Register the spec with vLLM's OffloadingSpecFactory (once per process)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    try:
        OffloadingSpecFactory.register_spec(SPEC_NAME, MODULE_PATH, CLASS_NAME)
    except ValueError:  # already registered in this process
        pass


def held_worker(connector: Any) -> HeldStoreWorker:
    """The HeldStoreWorker behind one rank's worker-side OffloadingConnector."""
    w = connector.connector_worker.worker
    assert isinstance(w, HeldStoreWorker), type(w)
    return w


def reset_worker(connector: Any) -> None:
    """Clear one rank's OffloadingConnectorWorker job state (pooled cluster reuse)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    cw = connector.connector_worker
    if isinstance(cw.worker, HeldStoreWorker):
        cw.worker.reset()
    cw._unsubmitted_store_jobs.clear()
    cw._load_jobs.clear()
    cw._connector_worker_meta = OffloadingWorkerMetadata()
