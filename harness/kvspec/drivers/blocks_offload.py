"""DecodeBlocks' offload child (`Offload`, vLLM #46951) replayed on the real classes: the
blocks driver's real decode `Scheduler` with a real MultiConnector(NixlConnector,
OffloadingConnector) as its connector (the child over offload_upstream's held spec). The
store jobs are the real child's (read off each step's metadata); only its worker is
replaced, by a ledger here: a job is pending from the step that carries it until the
trace's `store_done` or a flush completes it, and completions reach the scheduler as the
worker's would, in the next processed step's kv_connector_worker_meta.

Spec action -> real:
- `schedule`: `Scheduler.schedule()`; the child's new store jobs and its `jobs_to_flush`
  (`fl`: their requests) are read off the step's metadata.
- `execute`: handle_preemptions' wait completes the step's flushed jobs; then its READs
  are posted and its forward writes its blocks: `clob` if one is read by a pending store
  of another request.
- `store_done(r)`: r's pending store jobs complete on the worker.
- `update`: `update_from_output`, the completed jobs in the worker metadata.

Observed, beside the blocks driver's: which finished requests have a pending store
(`sto`), the requests whose pending stores each step in flight flushes (`fl`), and `clob`.

Driven: one batch in flight, no Grow. The real child stores full blocks only, so a
request's prompt is chosen from the trace (`finish_plan`) to fill its block exactly at the
step whose output finishes it; the spec's child stores every finished request's blocks.
With more batches a finished request's full block would already need a second one for the
step in flight (a grow the row does not have). `impl_patch="fix-46951"` applies 0.33's fence in
memory (drivers.patches): the installed 0.32 then runs the "fence-all" rows.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.blocks_driver import BlocksDriver, project, spec_fn
from kvspec.drivers.patches import Undo, get_patch
from kvspec.drivers.vllm_env import D_OFFLOAD, DriverUnavailable
from kvspec.tlcvalue import Value


def offload_meta(so: Any) -> Any:
    """The offload child's OffloadingConnectorMetadata in a step's MultiConnector metadata."""
    meta = so.kv_connector_metadata.metadata
    found = [m for m in meta if hasattr(m, "jobs_to_flush")]
    if len(found) != 1:
        raise DriverUnavailable(f"no offload child in the step's metadata ({meta!r})")
    return found[0]


def _req(req_id: str) -> int:
    return int(req_id.split("-")[1])


@dataclass
class OffloadBlocksDriver(BlocksDriver):
    # an impl patch applied for the driver's lifetime (fix-46951: 0.33's fence on 0.32)
    impl_patch: str | None = None
    undo: Undo | None = None
    # job id -> (request, the GPU blocks it reads), pending on the worker
    jobs: dict[int, tuple[int, frozenset[int]]] = field(default_factory=dict)
    completed: set[int] = field(default_factory=set)  # done on the worker, not yet reported
    # each step in flight: its jobs_to_flush still pending when it was scheduled, and `fl`
    # (their requests)
    flq: deque[tuple[frozenset[int], frozenset[int]]] = field(default_factory=deque)
    clob: bool = False
    # finished since the last schedule: the child builds their final store at the next
    # one (finished_req_ids, offloading/scheduler.py:1575-1578); the spec's `built`
    unbuilt: set[int] = field(default_factory=set)
    composition = D_OFFLOAD

    def __post_init__(self) -> None:
        if int(self.row.consts["Batches"]) != 1 or self.row.consts["Grow"]:
            raise DriverUnavailable("the offload child is driven at one batch without Grow")
        if self.impl_patch is not None:
            self.undo = get_patch(self.impl_patch).apply()
        try:
            super().__post_init__()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        super().close()
        if self.undo is not None:
            self.undo()
            self.undo = None

    def _tune(self, cfg: Any) -> None:
        """Rows with a local request: the child stores decode tokens too
        (`offload_prompt_only` off; blocks_traces.prompt_only_stores says why); P/D-only
        rows keep vLLM's default."""
        from kvspec.blocks_traces import prompt_only_stores

        if prompt_only_stores(self.row):
            return
        for child in cfg.kv_transfer_config.kv_connector_extra_config["connectors"]:
            if child["kv_connector"] == "OffloadingConnector":
                child["kv_connector_extra_config"]["offload_prompt_only"] = False

    def schedule(self) -> None:
        """DecodeBlocks `schedule`: Scheduler.schedule; the real child's new store jobs
        (offloading/scheduler.py:1570-1844) and its jobs_to_flush (1865-1877)."""
        super().schedule()
        self.unbuilt.clear()
        so = self.steps[-1].so
        meta = offload_meta(so)
        for jid, job in meta.store_jobs.items():
            self.jobs[jid] = (_req(job.req_id), frozenset(int(b) for b in job.src_spec.block_ids))
        flush = frozenset(j for j in meta.jobs_to_flush if j in self.jobs)
        self.flq.append((flush, frozenset(self.jobs[j][0] for j in flush)))

    def execute(self) -> None:
        """DecodeBlocks `execute`: handle_preemptions waits for the step's flushed jobs
        (offloading/worker.py:219-244), then start_load_kv posts its READs and the forward
        writes its blocks."""
        i = next((i for i, s in enumerate(self.steps) if not s.ran), None)
        if i is None:
            raise MissingAction("execute: no scheduled step")
        st = self.steps[i]
        for j in self.flq[i][0] & set(self.jobs):
            self._complete(j)
        writes = {r: self.dst[r] for r in st.recv} | dict(st.tbl)
        self.clob = self.clob or any(
            q != r and blocks & reads
            for r, blocks in writes.items() for q, reads in self.jobs.values()
        )  # fmt: skip
        super().execute()

    def store_done(self, r: int) -> None:
        """DecodeBlocks `store_done(r)`: r's store jobs complete on the worker."""
        mine = [j for j, (q, _) in self.jobs.items() if q == r and r not in self.unbuilt]
        if not mine:
            raise MissingAction(f"store_done({r}): the child has no store of request {r}")
        for j in mine:
            self._complete(j)

    def _complete(self, job: int) -> None:
        del self.jobs[job]
        self.completed.add(job)

    def update(self, fin: frozenset[int]) -> None:
        """DecodeBlocks `update`: update_from_output, the worker's completed jobs in its
        metadata (update_connector_output, offloading/scheduler.py:1956-1988)."""
        super().update(fin)
        self.flq.popleft()
        self.unbuilt |= fin

    def _worker_meta(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
            MultiKVConnectorWorkerMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        done = OffloadingWorkerMetadata()
        for j in sorted(self.completed):
            done.mark_completed(j)
        self.completed.clear()
        return MultiKVConnectorWorkerMetadata(metadata=(None, done))

    def spec_view(self, state: dict[str, Any]) -> dict[str, Value]:
        return project_offload(state)

    def observe(self) -> dict[str, Value]:
        pending = {q for q, _ in self.jobs.values()}
        return super().observe() | {
            "sto": tuple(r in self.done and r not in self.unbuilt and r in pending
                         for r in range(1, self.N + 1)),
            "fl": tuple(reqs for _, reqs in self.flq),
            "clob": self.clob,
        }


def project_offload(state: dict[str, Any]) -> dict[str, Value]:
    """The spec state as OffloadBlocksDriver.observe sees it."""
    sto, built = spec_fn(state["sto"]), frozenset(state["built"])
    return project(state) | {
        "sto": tuple(bool(sto[r]) and r in built for r in sorted(sto)),
        "fl": tuple(frozenset(s["fl"]) for s in state["steps"]),
        "clob": bool(state["clob"]),
    }


__all__ = ["OffloadBlocksDriver", "project_offload"]
