"""The vLLM driver's pool of clusters: built once per shape, reset between traces.

Clusters (kvspec.drivers.vllm_cluster) are pooled by shape (`acquire` / `release`), as vLLM
is imported once per process (`vllm_api()`) and a cluster takes seconds to build: a released
cluster keeps its NIXL agents, registered KV caches and the consumer's completed handshake,
and is reset (every connector's request state cleared, notifications drained) before reuse.
`shutdown_pool()` (also run at exit) tears every pooled cluster down: connector shutdown,
memory deregistration, agents dropped, threads joined. At most `POOL_IDLE_MAX` clusters wait
idle (the least recently released is torn down first): an idle cluster's NIXL agents keep
their progress threads polling (measured: one idle PCP 1 cluster keeps 2 cores busy, 0.02
after shutdown_pool), and a pool of every shape a test session touched (~66 running threads,
load average 67) starved 2 cores so badly that make test's unit stage took 22 minutes.
"""

from __future__ import annotations

import atexit
import contextlib
from collections.abc import Iterator

from kvspec.drivers.import_pins import unpin_import_tracebacks
from kvspec.drivers.native_threads import native_threads_niced
from kvspec.drivers.prefix_layout import ONE_BLOCK, Layout
from kvspec.drivers.sharding import fixture_model
from kvspec.drivers.vllm_caches import amx_tiles
from kvspec.drivers.vllm_cluster import Cluster, PoolKey, build_cluster, pool_key
from kvspec.drivers.vllm_env import DEFAULT_MODEL
from kvspec.drivers.vllm_inbox import Waits
from kvspec.matrix import ModelRow

_POOL: dict[PoolKey, list[Cluster]] = {}
_LIVE: list[Cluster] = []
_IDLE_ORDER: list[Cluster] = []  # idle clusters, least recently released first
POOL_IDLE_MAX = 1
# The pool's own bound for a reset (the previous trace's READs and notifications to land),
# on the real clock: housekeeping between traces, not a wait of any trace, so a trace's
# Waits (an injected clock, a scaled retry) never decide it. Healthy resets end in ms.
POOL_WAITS = Waits()


def acquire(
    row: ModelRow, device: str, waits: Waits, decode: str = "nixl", decode_tp: int = 0,
    model: str = DEFAULT_MODEL, layout: Layout = ONE_BLOCK,
) -> Cluster:  # fmt: skip
    """A reset cluster for `row` on `device` (D's connector `decode`, D's TP, the model's
    KV heads, the prompts' `layout`): a pooled one of its key, or a new one."""
    idle = _POOL.setdefault(pool_key(row, device, decode, decode_tp, model, layout), [])
    if idle:
        c = idle.pop()
        if c in _IDLE_ORDER:
            _IDLE_ORDER.remove(c)
        try:
            c.reset(POOL_WAITS)
        except Exception:  # a READ still in flight (WaitTimeout): the cluster is suspect
            discard(c)
            raise
        return c
    # NIXL's progress threads spin (native_threads); an AMX fixture's backend (vllm_caches)
    with native_threads_niced(), amx_tiles(fixture_model(row, model, device)):
        c = build_cluster(row, device, waits, decode, decode_tp, model, layout)
    _LIVE.append(c)
    return c


def release(cluster: Cluster) -> None:
    if cluster.closed:
        return
    try:
        cluster.reset(POOL_WAITS)
    except Exception:
        discard(cluster)
        raise
    _POOL.setdefault(cluster.key, []).append(cluster)
    _IDLE_ORDER.append(cluster)
    while len(_IDLE_ORDER) > POOL_IDLE_MAX:
        discard(_IDLE_ORDER[0])


def discard(cluster: Cluster) -> None:
    """Tear `cluster` down and forget it, whether in use or idle in the pool."""
    cluster.shutdown()
    if cluster in _LIVE:
        _LIVE.remove(cluster)
    idle = _POOL.get(cluster.key, [])
    if cluster in idle:
        idle.remove(cluster)
    if cluster in _IDLE_ORDER:
        _IDLE_ORDER.remove(cluster)


@contextlib.contextmanager
def discard_built_inside() -> Iterator[None]:
    """Discard, on leaving, every cluster built inside the block: one built while vLLM was
    patched (a mutant) may carry the patch in its set-up, e.g. a cached handshake."""
    before = list(_LIVE)
    try:
        yield
    finally:
        for c in [c for c in _LIVE if c not in before]:
            discard(c)


def shutdown_pool() -> None:
    """Tear down every cluster this process built (pooled or not)."""
    unpin_import_tracebacks()  # a lazy vLLM import since vllm_api() may have pinned frames
    for c in list(_LIVE):
        discard(c)
    _POOL.clear()
    _IDLE_ORDER.clear()


atexit.register(shutdown_pool)
