"""A tiering offload connector that delays the free: the MultiConnector child that
creates `extra_async_saves` (composition `multi-nixl-offload-delaying`).

Upstream's OffloadingConnector (0.29-0.33) never delays the free, but older
OffloadingConnectors and out-of-tree tiering specs do: they keep a finished request's
blocks until every rank has stored them and then report finished_sending on every rank.
This module is that connector, written for the project (no such class ships in vLLM), as a
real `KVConnectorBase_V1` subclass that vLLM's MultiConnector instantiates through
`KVConnectorFactory` (registered under `CONNECTOR_NAME`).

Behaviour, per side:

* Scheduler (`request_finished` / `request_finished_all_groups`): a request that finished
  normally (length-capped or stopped) and holds blocks is delayed (`True` is returned) and a
  store job for it is started on every rank. An aborted request is not delayed.
  `get_finished_count()` is None, as for every offloading connector.
* Worker (`get_transfer_results`): the rank reports, as finished_sending, the stores that
  completed since its last call; nothing else.

Where a store job lives: one in-process `StoreEngine` per producer engine id with one job
table per rank. The scheduler side hands it the job at `request_finished`, which is the
moment the spec's update_from_output starts the stores (`store' = store \\cup finishing`);
a multi-process deployment would ship the job in the next connector metadata, a delay the
spec abstracts away. A job completes only when `StoreEngine.complete(req_id, rank)` is
called (the spec's `store_complete`), never by itself, so completion order is under the
conformance driver's control.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

CONNECTOR_NAME = "KvspecDelayingOffloadConnector"
MODULE_PATH = __name__
CLASS_NAME = "DelayingOffloadConnector"


@dataclass
class RankJobs:
    """Store jobs of one rank: in flight, and completed but not yet reported."""

    store: set[str] = field(default_factory=set)
    stored: set[str] = field(default_factory=set)


class StoreEngine:
    """The offload tier's job tables, one per rank of one producer engine."""

    def __init__(self, world_size: int) -> None:
        self.ranks = [RankJobs() for _ in range(world_size)]

    def start(self, req_id: str) -> None:
        for jobs in self.ranks:
            jobs.store.add(req_id)

    def complete(self, req_id: str, rank: int) -> None:
        jobs = self.ranks[rank]
        jobs.store.remove(req_id)
        jobs.stored.add(req_id)

    def take_stored(self, rank: int) -> set[str]:
        jobs = self.ranks[rank]
        done, jobs.stored = jobs.stored, set()
        return done

    def reset(self) -> None:
        for jobs in self.ranks:
            jobs.store.clear()
            jobs.stored.clear()


_ENGINES: dict[str, StoreEngine] = {}


def store_engine(engine_id: str, world_size: int) -> StoreEngine:
    """The StoreEngine of a producer engine (created on first use)."""
    eng = _ENGINES.get(engine_id)
    if eng is None or len(eng.ranks) != world_size:
        eng = _ENGINES[engine_id] = StoreEngine(world_size)
    return eng


def drop_store_engine(engine_id: str) -> None:
    _ENGINES.pop(engine_id, None)


class DelayingOffloadMetadata(KVConnectorMetadata):
    """Empty: stores are handed to the StoreEngine directly (see module docstring)."""


def _world_size(vllm_config: Any) -> int:
    pc = vllm_config.parallel_config
    return int(
        pc.tensor_parallel_size * pc.pipeline_parallel_size * pc.prefill_context_parallel_size
    )


class DelayingOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offload child that delays the free and reports per rank after its store."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.engine_id: str = str(ktc.engine_id)
        self.engine = store_engine(self.engine_id, _world_size(vllm_config))
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        # The worker's rank (0..W-1, spec layout); the cluster sets it after construction,
        # as vLLM derives it from the process group, which is one process here.
        self.rank = 0

    # ---- scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> DelayingOffloadMetadata:
        return DelayingOffloadMetadata()

    def get_finished_count(self) -> int | None:
        return None

    def _finished(self, request: Any, has_blocks: bool) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        normal = request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        )
        if not normal or not has_blocks:
            return False, None
        self.engine.start(request.request_id)
        return True, None

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, len(block_ids) > 0)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, any(len(g) > 0 for g in block_ids))

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        return None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(finished_sending=self.engine.take_stored(self.rank))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        done = self.engine.take_stored(self.rank)
        return done or None, None
