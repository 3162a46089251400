"""Mutated push-mode code (vllm 0.32 `nixl/push_worker.py`, NixlPushConnectorWorker). Each
function takes the original attribute and returns its replacement (`Patch.make`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def reports_on_post(orig: Any) -> Any:
    def pop_done(self: Any, transfers: dict[str, list[int]]) -> tuple[set[str], set[str]]:
        # A request's WRITEs count as done once posted (state not checked): the producer
        # frees blocks its WRITE still reads.
        if transfers is getattr(self, "_sending_transfers", None):
            done = set(transfers)
            transfers.clear()
            return done, set()
        done_ids, failed_ids = orig(self, transfers)
        return set(done_ids), set(failed_ids)

    return pop_done


def replica_queues(orig: Any) -> Any:
    def start_load_kv(self: Any, metadata: Any) -> None:
        # Replicated PCP ranks no longer return first (push_worker.py:173-174): they track
        # the request, install its lease and queue its blocks for a WRITE no D asks them for.
        rank = self.pcp_rank
        self.pcp_rank = 0
        try:
            orig(self, metadata)
        finally:
            self.pcp_rank = rank

    return start_load_kv


def _results_reporting(keep: Callable[[Any, str], bool]) -> Callable[[Any], Any]:
    """0.32's push get_transfer_results (push_worker.py:810-850) with the filter that picks
    which successful pushes are reported replaced by `keep(worker, req_id)` (as shipped:
    the request is still tracked, in _reqs_to_send or _reqs_to_process)."""

    def get_transfer_results(self: Any) -> Any:
        self._push_writer_wake.set()
        results = super(type(self), self).get_transfer_results()
        with self._sending_transfers_lock:
            done_pushing, failed = self._pop_done_transfers(self._sending_transfers)
            self._send_failures.update(failed)
            successful = {r for r in done_pushing - self._send_failures if keep(self, r)}
            self._send_failures.difference_update(done_pushing | results.finished_sending)
        for req_id in successful:
            self._reqs_to_send.pop(req_id, None)
            self._reqs_to_process.discard(req_id)
            self.consumer_notification_counts_by_req.pop(req_id, None)
            results.finished_sending.add(req_id)
        for req_id in results.finished_sending:
            self._evict_finished_inbox.put(req_id)
        if results.finished_sending:
            self._push_writer_wake.set()
        return results

    return get_transfer_results


def expired_write_reported(orig: Any) -> Any:
    # As shipped minus the filter "Expired requests were already reported, even if their
    # WRITEs finish later": a WRITE that completes after its lease expired is reported a
    # second time.
    return _results_reporting(lambda _self, _req_id: True)


def success_unreported(orig: Any) -> Any:
    # #58188's regression (after #56104): a successful WRITE is reported only for a
    # request with a _recving_metadata entry (one D receives), which a producer's request
    # never has; so P keeps the request and its blocks until the lease reaps it.
    return _results_reporting(lambda self, req_id: req_id in self._recving_metadata)
