"""The upstream OffloadingConnector's store-job state, read from the real objects as the
spec's `unsub`, `store`, `stored`, `jobs`, `fence` and the steps' `jobs`/`flush`/`ack`
(composition multi-nixl-offload-upstream; KVCompletion.tla's `Offload*` definitions).

vLLM 0.32 (paths under distributed/kv_transfer/kv_connector/v1/offloading/):
  jobs[r]   scheduler.py:1818 a store job starts with pending_count = num_workers
            (= parallel_config.world_size, scheduler.py:335); update_connector_output
            (1952-1965) subtracts each rank's ack and deletes the job at 0.
  fence     the requests whose jobs sit in _block_id_to_pending_jobs: request_finished
            (2033-2036) registers a finished request's blocks there, and a batch that is
            allocated one of them gets the job in jobs_to_flush (build_connector_meta,
            1866-1876).
  unsub[w]  worker.py:259-271 prepare_store_kv defers the step's store jobs to
            _unsubmitted_store_jobs; handle_preemptions (219-244) submits them at the
            start of the next step and waits for the flushed ones.
  store[w]  jobs submitted to the rank's OffloadingWorker and not complete
            (offload_upstream.HeldStoreWorker.pending).
  stored[w] jobs complete but not yet read by get_finished (HeldStoreWorker.finished):
            get_finished marks them in the worker metadata (worker.py:273-308), shipped
            by build_connector_worker_meta as completed_jobs: the step's `ack`.
Job ids are mapped back to requests through the metadata's TransferJob.req_id, recorded
when the step is scheduled (`JobMap.record`): the worker side never sees request ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def held_worker(child: Any) -> Any:
    """The rank's offload_upstream.HeldStoreWorker (not imported here: that module imports
    vLLM, and this one is imported by the driver before vLLM is)."""
    return child.connector_worker.worker


def spec_r(rid: str) -> int:
    return int(rid.split("-", 1)[1])


def scheduler_child(sched: Any) -> Any:
    """The OffloadingConnectorScheduler behind the MultiConnector's second child."""
    return sched.connector._connectors[1].connector_scheduler


def child_meta(so: Any) -> Any:
    """The offloading child's OffloadingConnectorMetadata in a SchedulerOutput."""
    return so.kv_connector_metadata.metadata[1]


@dataclass
class JobMap:
    """job id -> spec request id, for every store job the scheduler shipped."""

    req: dict[int, int] = field(default_factory=dict)

    def record(self, meta: Any) -> tuple[frozenset[int], frozenset[int]]:
        """The step's (jobs, flush) as requests; call before the workers run the step
        (handle_preemptions pops flushed jobs out of store_jobs)."""
        for jid, job in meta.store_jobs.items():
            self.req[jid] = spec_r(job.req_id)
        return self.of(meta.store_jobs), self.of(meta.jobs_to_flush or ())

    def of(self, job_ids: Any) -> frozenset[int]:
        return frozenset(self.req[j] for j in job_ids if j in self.req)


def pending_counts(osched: Any, n: int) -> tuple[int, ...]:
    """jobs[r]: the summed pending_count of r's live store jobs (r = 1..n)."""
    out = [0] * n
    for job in osched._jobs.values():
        if job.is_store:
            out[spec_r(job.req_id) - 1] += job.pending_count
    return tuple(out)


def fenced(osched: Any, jobs: JobMap) -> frozenset[int]:
    """fence: requests with a job registered against block reuse."""
    return jobs.of({j for ids in osched._block_id_to_pending_jobs.values() for j in ids})


def rank_sets(child: Any, jobs: JobMap) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """Rank w's (unsub, store, stored) from its worker-side OffloadingConnector."""
    held = held_worker(child)
    unsub = jobs.of(j for j, _, _ in child.connector_worker._unsubmitted_store_jobs)
    store = jobs.of(j for j, (kind, _, _) in held.pending.items() if kind == "store")
    stored = jobs.of(t.job_id for t in held.finished)
    return unsub, store, stored


def store_job_of(child: Any, jobs: JobMap, r: int) -> int | None:
    """A submitted, incomplete store job of request r on this rank, if any."""
    held = held_worker(child)
    for jid, (kind, _, _) in sorted(held.pending.items()):
        if kind == "store" and jobs.req.get(jid) == r:
            return int(jid)
    return None


def complete_store(child: Any, job_id: int) -> None:
    """The OffloadingWorker's transfer of job_id finishes (get_finished reports it)."""
    held_worker(child).complete(job_id)


def clobbers(child: Any, new_blocks: frozenset[int]) -> bool:
    """After handle_preemptions: a store still in flight reads a block the step's forward
    writes (a block newly allocated to its batch). The stock worker's copy stream would
    race the forward there; the flush fence exists to prevent exactly this."""
    held = held_worker(child)
    return any(
        kind == "store" and new_blocks & {int(b) for b in getattr(src, "block_ids", [])}
        for kind, src, _ in held.pending.values()
    )


def acks(output: Any, jobs: JobMap) -> frozenset[int]:
    """The requests of the completed_jobs a rank's ModelRunnerOutput acks."""
    meta = output.kv_connector_output.kv_connector_worker_meta
    if meta is None:
        return frozenset()
    child = meta.metadata[1] if len(meta.metadata) > 1 else None
    return jobs.of(child.completed_jobs) if child is not None else frozenset()
