"""The catalogue: every mutant, its target, the bug or rule it is about, and its base."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvspec.drivers.patches import CONNECTOR, NIXL, Patch
from kvspec.mutations import FIXED, SHIPPED, Base, Mutant
from kvspec.mutations import decode as de
from kvspec.mutations import engine as e
from kvspec.mutations import nixl as n
from kvspec.mutations import push as pu

BASE_WORKER = f"{NIXL}.base_worker:NixlBaseConnectorWorker"
PULL_WORKER = f"{NIXL}.pull_worker:NixlPullConnectorWorker"
PUSH_WORKER = f"{NIXL}.push_worker:NixlPushConnectorWorker"
BASE_SCHED = f"{NIXL}.base_scheduler:NixlBaseConnectorScheduler"
PULL_SCHED = f"{NIXL}.pull_scheduler:NixlPullConnectorScheduler"
MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector:MultiConnector"
AGG = "vllm.distributed.kv_transfer.kv_connector.utils:KVOutputAggregator"
SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
OFFLOADING = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"


def _m(
    name: str,
    description: str,
    target: str,
    origin: str,
    make: Callable[[Any], Any],
    base: Base = SHIPPED,
    equivalent_because: str | None = None,
    family: str = "producer",
    decode_rows: tuple[str, ...] = (),
) -> Mutant:
    return Mutant(
        Patch(name, description, target, origin, make), base, equivalent_because, family,
        decode_rows,
    )  # fmt: skip


_ALL = [
    _m(
        "reaper-early-break",
        "lease reaper walks _reqs_to_send from its head and stops at the first live lease",
        f"{BASE_WORKER}._reap_expired_send_leases",
        "#58222/#50789",
        n.reaper_early_break,
    ),
    _m(
        "lease-never-expires",
        "expired send leases are never reaped (blocks held until a consumer reads)",
        f"{BASE_WORKER}._reap_expired_send_leases",
        "rule: leases are finite (lease_expire)",
        n.lease_never_expires,
    ),
    _m(
        "expired-lease-not-reported",
        "expired leases are reclaimed on the worker but not reported as finished_sending",
        f"{BASE_WORKER}._reap_expired_send_leases",
        "rule: reaped => done_sending",
        n.expired_not_reported,
    ),
    _m(
        "heartbeat-not-extending",
        "an HB: notification no longer extends the request's lease",
        f"{BASE_WORKER}._handle_heartbeat",
        "rule: heartbeat re-arms the lease",
        n.heartbeat_not_extending,
    ),
    _m(
        "heartbeat-full-lease",
        "a heartbeat extends the lease to now + kv_lease_duration, not 2/3 of it",
        f"{BASE_WORKER}._handle_heartbeat",
        "rule: extension = kv_lease_duration * 2 // 3 (base_worker.py:532)",
        n.heartbeat_full_lease,
    ),
    _m(
        "heartbeat-installs-lease",
        "a heartbeat for a request with no lease (already reaped or notified) installs one",
        f"{BASE_WORKER}._handle_heartbeat",
        "rule: a heartbeat only extends (base_worker.py:3052); #21570",
        n.heartbeat_installs_lease,
    ),
    _m(
        "notif-wrong-request",
        "a consumer notification is counted for the oldest tracked request, not its own",
        f"{PULL_WORKER}._get_new_notifs",
        "rule: 'r:n' completes r",
        n.notifs(req_of=n.oldest),
    ),
    _m(
        "notif-before-metadata-dropped",
        "a notification for a request in _reqs_to_process but without a lease yet is dropped",
        f"{PULL_WORKER}._get_new_notifs",
        "#25808",
        n.notifs(recognised=n.leased),
    ),
    _m(
        "notif-count-off-by-one",
        "a request needs one more consumer notification than the 'r:n' count says",
        f"{PULL_WORKER}._get_new_notifs",
        "rule: n consumer reads complete r",
        n.notifs(consumers=lambda k: k + 1),
    ),
    _m(
        "lease-armed-after-read",
        "start_load_kv arms a lease even for a request not in _reqs_to_process (already read)",
        f"{PULL_WORKER}.start_load_kv",
        "#25808 (async scheduling misalignment)",
        n.lease_armed_after_read,
    ),
    _m(
        "replica-serves",
        "replicated PCP ranks > 0 track leases and wait for reads instead of queueing",
        f"{PULL_WORKER}.start_load_kv",
        "#52779 (naive replicas)",
        n.as_pcp_rank(lambda rank: 0),
    ),
    _m(
        "rank0-reports-on-metadata",
        "PCP rank 0 queues reqs_to_send as done at metadata arrival, before any read",
        f"{PULL_WORKER}.start_load_kv",
        "#53903 (rank 0 only after the consumer read)",
        n.as_pcp_rank(lambda rank: 1 if rank == 0 else rank),
    ),
    _m(
        "handshake-published-by-replicas",
        "replicated PCP ranks > 0 publish handshake metadata (duplicate (tp, pp) identity)",
        f"{CONNECTOR}.get_handshake_metadata",
        "#52779",
        n.handshake_by_replicas,
    ),
    _m(
        "finished-count-tp-pp",
        "NIXL get_finished_count returns TP x PP again (0.29), so expected < world_size",
        f"{CONNECTOR}.get_finished_count",
        "#52779 (0.29 regression)",
        n.finished_count_tp_pp,
    ),
    _m(
        "abort-not-recorded",
        "an aborted request is not added to _reqs_not_processed",
        f"{PULL_SCHED}.request_finished",
        "rule: abort -> reqs_not_processed",
        n.abort_not_recorded,
    ),
    _m(
        "abort-meta-dropped",
        "reqs_not_processed never reaches the workers (dropped from the connector metadata)",
        f"{BASE_SCHED}.build_connector_meta",
        "rule: abort reaches the worker",
        n.abort_meta_dropped,
    ),
    _m(
        "free-before-emit",
        "the scheduler frees a finished request's blocks at once, ignoring delay_free",
        f"{SCHED}._connector_finished",
        "rule: NoFreeWhileInFlight",
        e.free_before_emit,
    ),
    _m(
        "agg-expected-minus-one",
        "the aggregator's expected finished count is one less",
        f"{AGG}.from_connector",
        "rule: expected = get_finished_count() or world_size",
        e.agg_expected(-1),
    ),
    _m(
        "agg-expected-plus-one",
        "the aggregator's expected finished count is one more",
        f"{AGG}.from_connector",
        "rule: expected = get_finished_count() or world_size",
        e.agg_expected(+1),
    ),
    _m(
        "agg-dedup-across-workers",
        "the aggregator counts a request once per step however many workers report it",
        f"{AGG}.aggregate",
        "rule: one count per worker report",
        e.agg_filter(e.dedup_across),
        base=FIXED,
    ),
    _m(
        "agg-dedup-per-worker",
        "the aggregator ignores a second report of a request from the same worker",
        f"{AGG}.aggregate",
        "rule: no per-worker de-duplication",
        e.agg_filter(e.dedup_per_worker),
        base=FIXED,
        equivalent_because=(
            "in every spec behaviour (all variants, compositions) a rank reports a request "
            "at most once (serve: notif or expiry; queue: once at metadata; MultiConnector: "
            "the extra save swallows one of two), so de-duplication never changes a count; "
            "killing it needs a variant where a rank reports twice (e.g. MultiConnector "
            "without extra_async_saves) as a base"
        ),
    ),
    _m(
        "agg-skips-last-worker",
        "the aggregator loops over all outputs but the last rank's",
        f"{AGG}.aggregate",
        "rule: all world_size outputs counted",
        e.agg_skips_last,
        base=FIXED,
    ),
    _m(
        "replica-reports-cleared",
        "the shipped filter is back: replicated PCP ranks > 0 have finished_sending cleared",
        f"{CONNECTOR}.get_transfer_results",
        "#53903 (shipped 0.30-0.33 bug)",
        n.replica_reports_cleared,
        base=FIXED,
    ),
    _m(
        "replica-reports-twice",
        "replicated PCP ranks > 0 report each queued request again one step later",
        f"{CONNECTOR}.get_transfer_results",
        "#53903 (report exactly once)",
        n.replica_reports_twice,
        base=FIXED,
    ),
    _m(
        "extra-async-saves-ignored",
        "the worker MultiConnector does not merge extra_async_saves from the metadata",
        f"{MULTI}.bind_connector_metadata",
        "rule: extra_async_saves swallow n - 1 reports",
        e.extra_ignored,
        base=FIXED,
    ),
    _m(
        "swallow-wrong-child",
        "the extra-save swallow only applies to the first child's (NIXL's) reports",
        f"{MULTI}.get_transfer_results",
        "rule: first report of any child swallowed",
        e.multi_results(swallows=lambda i: i == 0, recv_twice=False),
        base=FIXED,
    ),
    _m(
        "multi-first-child-only",
        "MultiConnector.request_finished_all_groups asks only its first child",
        f"{MULTI}.request_finished_all_groups",
        "#36549",
        e.multi_first_child_only,
        base=FIXED,
    ),
    _m(
        "multi-extra-off-by-one",
        "the scheduler MultiConnector records n instead of n - 1 extra async saves",
        f"{MULTI}._aggregate_request_finished",
        "rule: extra_async_saves = delaying children - 1",
        e.multi_extra_off_by_one,
        base=FIXED,
    ),
    _m(
        "offload-fence-dropped",
        "the offloading scheduler's request_finished registers no deferred fence: a reused "
        "block's store is not flushed before the forward",
        f"{OFFLOADING}.scheduler:OffloadingConnectorScheduler.request_finished",
        "#46951 (its outcome: a block reused under its store)",
        e.offload_fence_dropped,
    ),
    _m(
        "offload-replica-never-acks",
        "offloading workers on ranks > 0 ship no completed_jobs: pending_count never reaches 0",
        f"{OFFLOADING}.worker:OffloadingConnectorWorker.build_connector_worker_meta",
        "#46019",
        e.offload_replica_never_acks,
    ),
    _m(
        "push-reports-on-post",
        "push mode: a request's WRITEs count as done once posted, not once DONE",
        f"{BASE_WORKER}._pop_done_transfers",  # defined there; only push's sends change
        "rule: push frees after every WRITE handle is DONE (push_worker.py:826-829)",
        pu.reports_on_post,
    ),
    _m(
        "push-replica-queues",
        "push mode: replicated PCP ranks no longer return first from start_load_kv",
        f"{PUSH_WORKER}.start_load_kv",
        "rule: push replicas are silent (push_worker.py:173-174)",
        pu.replica_queues,
    ),
    _m(
        "push-expired-write-reported",
        "push mode: a WRITE that completes after its lease expired is reported again",
        f"{PUSH_WORKER}.get_transfer_results",
        "rule: push reaper (push_worker.py:831-833, 'Expired requests were already reported')",
        # Killed by the extension push-write-outlives-lease (Timing = "untimed": the
        # lease passes under the WRITE); under the timing guards no WRITE outlives its lease.
        pu.expired_write_reported,
    ),
    _m(
        "push-success-unreported",
        "push mode: a request whose WRITEs all succeeded is not reported until its lease",
        f"{PUSH_WORKER}.get_transfer_results",
        "#58188 (the regression of #56104: successful WRITEs filtered by _recving_metadata)",
        pu.success_unreported,
    ),
    _m(
        "multi-recv-reported-twice",
        "the worker MultiConnector reports each finished_recving again at the next call",
        f"{MULTI}.get_transfer_results",
        "#51786/#51864",
        e.multi_results(swallows=lambda i: True, recv_twice=True),
        base=FIXED,
        # A receive: only the decode side's traces see it (D = MultiConnector(NIXL,
        # ExampleConnector), conformance/decode.toml's conf-decode-d1-multi).
        family="decode",
    ),
    _m(
        "decode-abort-frees-at-once",
        "finish_requests frees an aborted WAITING_FOR_REMOTE_KVS request's blocks at once",
        f"{SCHED}.finish_requests",
        "#32255",
        de.abort_frees_at_once,
        family="decode",
    ),
    _m(
        "decode-failure-only-logged",
        "a failed READ is only logged: never in finished_recving or failed_recving",
        f"{BASE_WORKER}.get_transfer_results",
        "#35943",
        de.failure_only_logged,
        family="decode",
    ),
    _m(
        "decode-recv-before-reads-end",
        "a receive is reported done while one of its READs is still in progress",
        f"{BASE_WORKER}._pop_done_transfers",
        "rule: done once no handle is left (base_worker.py:3109-3113)",
        de.recv_reported_before_reads_end,
        family="decode",
    ),
    _m(
        "decode-notif-count-one",
        "a producer rank frees r at the first notification, whatever D reads (n = 1)",
        "vllm.distributed.kv_transfer.kv_connector.utils:TransferTopology.dcp_consumer_count",
        "#56033's class: n = local_consumers (utils.py:589-606)",
        de.notif_count_one,
        family="decode",
        decode_rows=("conf-decode-p1-d2-fail",),  # two D ranks read one P rank: n = 2
    ),
    _m(
        "notif-before-read-done",
        "D's READ notification reaches the producer before the READ completes (sent at "
        "post, not with the transfer)",
        f"{PULL_WORKER}._read_blocks",
        "ai-dynamo/nixl#252 (#13: notification counted before READ completion)",
        de.notif_before_read_done,
        family="decode",
    ),
    _m(
        "decode-mla-notify-local-id",
        "MLA, P TP > D TP: the notify-only message to each unread producer rank carries D's "
        "request id, which P does not recognise (its blocks wait for the lease)",
        f"{PULL_WORKER}._read_blocks_for_req",
        "#36958 (pull_worker.py:369-391 sends meta.remote.request_id)",
        de.notify_local_id,
        family="decode",
        decode_rows=("conf-decode-p2-d1-mla",),  # MLA: read P rank 0, notify-only rank 1
    ),
    _m(
        "decode-full-hit-parked",
        "a full local prefix hit is parked in WAITING_FOR_REMOTE_KVS as if it had KV to load: "
        "nothing is read or reported, it never runs",
        f"{PULL_SCHED}.get_num_new_matched_tokens",
        "#56640/#54714 (pull_scheduler.py:58-65)",
        de.full_hit_parked,
        family="decode",
        decode_rows=("conf-decode-d1-full-hit-sync",),  # the deployment with full hits
    ),
    _m(
        "handshake-failure-only-logged",
        "a failed background handshake is only logged: its deferred entries never reach "
        "_failed_recv_reqs, so their requests stay in WAITING_FOR_REMOTE_KVS",
        f"{BASE_WORKER}._background_nixl_handshake",
        "#35943's class on the handshake path (base_worker.py:1353-1360)",
        de.handshake_failure_only_logged,
        family="decode",
        decode_rows=("conf-decode-d1-first-contact-hs-fails",),
    ),
    _m(
        "blocks-freed-at-once",
        "a finished or preempted request's blocks go back to the pool at once while a step "
        "in flight still writes them; a READ for the next request may fill them",
        f"{SCHED}._request_blocks_can_be_freed",
        "#45357 (scheduler.py:2759-2776)",
        de.blocks_freed_at_once,
        family="blocks",
    ),
    _m(
        "offload-scheduled-unseen",
        "D's offload child does not see the blocks a step's scheduled requests get: a "
        "pending store on a reused block is not flushed (the scheduled twin of #46951)",
        f"{OFFLOADING}.scheduler:OffloadingConnectorScheduler._update_req_states",
        "#46951's sibling (offloading/scheduler.py:1281-1310)",
        de.offload_scheduled_unseen,
        family="blocks",
    ),
]

MUTANTS: dict[str, Mutant] = {m.name: m for m in _ALL}
