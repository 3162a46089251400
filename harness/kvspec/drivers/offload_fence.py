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
could not decide (never a design). `fixed` applies the impl patch fix-46951 (0.33's fix:
the child records the allocated blocks before its early return), the probe's negative
control. The replay of the whole counterexample (drivers.blocks_offload) covers one batch
with `offload_prompt_only` off; the probe also runs vLLM's defaults: async scheduling,
prefix caching on, prompt tokens only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from kvspec.drivers.blocks_driver import decode_request, decode_scheduler, request_blocks, rid
from kvspec.drivers.blocks_offload import offload_meta
from kvspec.drivers.patches import get_patch
from kvspec.drivers.vllm_env import (
    BLOCK_SIZE,
    D_OFFLOAD,
    DriverUnavailable,
    runner_output,
    vllm_api,
)


@dataclass(frozen=True)
class FenceProbe:
    store_blocks: frozenset[int]  # the finished request's pending store job reads these
    load_blocks: frozenset[int]  # the READ of the request admitted next fills these
    flushed: bool  # that schedule's jobs_to_flush holds the store job

    @property
    def design(self) -> str:
        """DecodeBlocks' Offload that the real child implements."""
        return "fence-all" if self.flushed else "fence-scheduled"

    def line(self, version: str, engine: str) -> str:
        shared = sorted(self.store_blocks & self.load_blocks)
        how = ("flushed before the READ" if self.flushed
               else "not flushed: the READ lands under it (#46951)")  # fmt: skip
        return (f"vLLM {version}, {engine}: {self.design}: a pending "
                f"store of block(s) {shared} is {how}")  # fmt: skip


def probe(
    fixed: bool = False, batches: int = 1, prefix_caching: bool = False, device: str = "cpu"
) -> FenceProbe:
    """Drive the race step (the table above) and read the real child's fence. `batches` 2:
    the AsyncScheduler of vLLM's default async scheduling (row offload-0.32-stop; the
    calls stay one at a time, an interleaving the async engine also runs).
    `prefix_caching`: vLLM's default, on (request 1's freed block keeps its hash and goes to
    the free queue's tail; it is still the only free block)."""
    api = vllm_api()
    undo = get_patch("fix-46951").apply() if fixed else None
    try:
        d, hasher = decode_scheduler(api, 1, batches, composition=D_OFFLOAD, device=device,
                                     prefix_caching=prefix_caching)  # fmt: skip
        try:
            return _race(api, hasher, d)
        finally:
            with contextlib.suppress(Exception):
                d.shutdown()
    finally:
        if undo is not None:
            undo()


def _race(api: Any, hasher: Any, d: Any) -> FenceProbe:
    d.add_request(decode_request(api, hasher, 1, BLOCK_SIZE, max_tokens=1))
    so = d.schedule()  # spec: schedule (1's prefill) ...
    jobs = {j: job for j, job in offload_meta(so).store_jobs.items() if job.req_id == rid(1)}
    if len(jobs) != 1:
        raise DriverUnavailable(f"request 1's prefill built {len(jobs)} store jobs, not one")
    (job_id, job), = jobs.items()
    store = frozenset(int(b) for b in job.src_spec.block_ids)
    d.update_from_output(so, runner_output(api, so, None))  # ... update: 1 stops
    if rid(1) in d.requests:
        raise DriverUnavailable("request 1 did not finish at max_tokens 1")
    d.add_request(decode_request(api, hasher, 2, BLOCK_SIZE, max_tokens=1, remote=True))
    so = d.schedule()  # spec: schedule (2 admitted, WAITING_FOR_REMOTE_KVS)
    load = request_blocks(d, rid(2))
    child = next(c for c in d.connector._connectors if hasattr(c, "connector_scheduler")
                 and hasattr(c.connector_scheduler, "_jobs"))  # fmt: skip
    pending = job_id in child.connector_scheduler._jobs
    if not (store & load) or not pending:
        raise DriverUnavailable(
            f"undecided: request 2's blocks {sorted(load)}, the store's {sorted(store)}, "
            f"store pending: {pending}"
        )
    return FenceProbe(store, load, job_id in offload_meta(so).jobs_to_flush)


__all__ = ["FenceProbe", "probe"]
