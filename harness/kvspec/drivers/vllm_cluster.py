"""An in-process mini-cluster built from the real vLLM classes (the vLLM driver's engine room).

What is real: vLLM's v1 `Scheduler` (producer), W worker-side connector instances (NIXL pull
or, for Transfer = "push", NixlPushConnector producers, optionally inside vLLM's
`MultiConnector` next to vLLM's HF3FSKVConnector or its `OffloadingConnector`) over KV cache
tensors allocated by `vllm.v1.worker.utils.allocate_kv_cache` (each TP rank holds its share
of the KV heads) and registered with their own NIXL agents, the `KVOutputAggregator`, one
decode-side worker `NixlConnector` (kv_consumer) per TP rank that handshakes over the real
ZMQ side channel with the producer rank its transfer topology maps it to and issues real
NIXL READs (UCX), and NIXL's notifications. In push mode the decode workers are
NixlPushConnectors too, the decode engine has its own side channel and every producer rank
handshakes with it (push_side.py). What is replaced: the model forward (the driver builds a
synthetic `ModelRunnerOutput`), the process group (all workers live in one process: each
worker is built as TP rank t of T by `tp_identity`, and its `pcp_rank` is set by hand after
construction, as vLLM would derive both from its groups), HF3FS's metadata server, 3FS
mount, CUDA streams and I/O threads (hf3fs_child.py: its saves are held until the spec's
store_complete), and the upstream offloading spec's transfer engine (offload_upstream.py:
the stock CPU worker refuses CPU tensors, and on CUDA its copies end within the step, where
a trace may hold them). PP > 1 is unavailable (`PP_UNAVAILABLE` says why).

Devices (`device_plan`): on `cpu` the KV caches are host tensors that NIXL registers as
DRAM; on `cuda` (the CUDA build of vLLM) they are allocated in VRAM, the connectors run with
kv_buffer_device = "cuda" so vLLM's NIXL worker registers them as VRAM and READs go
GPU-to-GPU through UCX. `build_cluster` checks after construction that vLLM chose
the memory type the plan expects, so a silently host-staged run cannot pass as a VRAM one.

Cost: vLLM is imported once per process (`vllm_api()`), and clusters are pooled by shape
(kvspec.drivers.cluster_pool).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvspec.drivers import push_side
from kvspec.drivers.prefix_layout import ONE_BLOCK, Layout
from kvspec.drivers.push_side import PushSide
from kvspec.drivers.sharding import fixture_model, sharded_decode_tp, transfer_rank
from kvspec.drivers.vllm_adapters import transfer_results
from kvspec.drivers.vllm_caches import allocate_caches, kv_cache_config
from kvspec.drivers.vllm_consumers import (
    _check_registration,
    build_consumers,
    handshake,
    nixl_of,
)
from kvspec.drivers.vllm_env import (
    DEFAULT_MODEL,
    PP_UNAVAILABLE,
    DevicePlan,
    DriverUnavailable,
    check_device,
    device_plan,
    free_port,
    keep_affinity,
    tp_identity,
    vllm_config,
    vllm_refusal,
)
from kvspec.drivers.vllm_inbox import NotifInbox, SentToProducer, Waits, serve_handshake_metadata
from kvspec.matrix import ModelRow, Topology
from kvspec.model import HF3FS

PoolKey = tuple[str, str, Topology, int, int, bool, str, str, int, str, int, Layout]
# The decode engine's connector: NIXL, or MultiConnector(NIXL, ExampleConnector) (a child
# that never loads, delays or reports here: MultiConnector's own code is what it adds).
DECODE_COMPOSITIONS = ("nixl", "multi-nixl-example")


def pool_key(
    row: ModelRow, device: str, decode: str = "nixl", decode_tp: int = 0,
    model: str = DEFAULT_MODEL, layout: Layout = ONE_BLOCK,
) -> PoolKey:  # fmt: skip
    """What a cluster is built from: the row's constants except its variant (the variant is
    vLLM's code, shipped or patched, not the cluster's shape), the device, D's connector
    and TP (0: the producer's), the fixture model, the producer's DCP and the layout."""
    return (
        row.composition,
        row.transfer,
        row.topology,
        row.requests,
        row.capacity,
        row.async_scheduling,
        device,
        decode,
        decode_tp or row.topology.tp,
        fixture_model(row, model, device),
        row.dcp,
        layout,
    )


_SEQ = itertools.count()


@dataclass
class Cluster:
    """Built once per pool key and reused (see module docstring)."""

    key: PoolKey
    composition: str
    topology: Topology
    api: SimpleNamespace
    engine_id: str
    cfg: Any
    kv_cache_config: Any
    workers: list[Any]  # worker-role connector per rank (NixlConnector or MultiConnector)
    caches: list[dict[str, Any]]
    inboxes: list[NotifInbox]
    # Decode side: one worker-role NixlConnector (kv_consumer) per TP rank, each with its
    # own agent and caches, reading from the producer rank of the same tp rank.
    consumers: list[Any]
    consumers_caches: list[dict[str, Any]]
    listener: Any  # scheduler-role NixlConnector that served the handshake
    push: PushSide | None = None  # push mode: D's side channel, the producers' held WRITEs
    closed: bool = False
    decode_composition: str = "nixl"
    dcp: int = 1  # the producer's decode_context_parallel_size (> 1 with PCP: sharded)
    model: str = DEFAULT_MODEL  # the fixture both engines run (vllm_env.MODELS)
    to_producer: SentToProducer = field(default_factory=SentToProducer)

    def consumer_nixl(self, t: int) -> Any:
        """Decode worker t's NIXL connector (a MultiConnector's first child)."""
        return nixl_of(self.consumers[t], self.decode_composition)

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def consumer_of(self, w: int) -> int:
        """The consumer (its index, = its TP rank) that reads from producer rank w: the
        one of w's tp rank, or of w's transfer rank when sharded (sharded_decode_tp)."""
        return transfer_rank(self.topology, self.dcp, w)

    @property
    def transfer_tp(self) -> int:
        """P's transfer TP size, the tp_size its kv_transfer_params carry
        (base_scheduler.py:69-72: max(TP, DCP))."""
        return max(self.topology.tp, self.dcp)

    def nixl(self, w: int) -> Any:
        """The NIXL connector (the MultiConnector's first child) of rank w."""
        return nixl_of(self.workers[w], self.composition)

    def nixl_worker(self, w: int) -> Any:
        return self.nixl(w).connector_worker

    def hf3fs(self, w: int) -> Any:
        """Rank w's HF3FS AsyncOperationManager (hf3fs_child.HeldAsyncOperationManager);
        composition multi-nixl-hf3fs only."""
        from kvspec.drivers import hf3fs_child

        return hf3fs_child.manager(self.workers[w]._connectors[1])

    def reset(self, waits: Waits) -> None:
        """Clear every connector's request state; WaitTimeout if a READ a trace left in
        flight is not reported done within `waits`."""
        for w in range(self.world_size):
            nw = self.nixl_worker(w)
            nw._reqs_to_process.clear()
            nw._reqs_to_send.clear()
            getattr(nw, "_replicated_pcp_done_sending", set()).clear()  # 0.30+
            nw.consumer_notification_counts_by_req.clear()
            nw.expected_consumer_notifications_by_req.clear()
            self.inboxes[w].reset()
            if self.composition != "nixl":
                self.workers[w]._extra_async_saves.clear()
            if self.composition == "multi-nixl-offload-upstream":
                from kvspec.drivers import offload_upstream

                offload_upstream.reset_worker(self.workers[w]._connectors[1])
            if self.composition == HF3FS:
                self.hf3fs(w).reset()
            self.workers[w].clear_connector_metadata()
        if self.push is not None:
            push_side.reset(self, waits)
        for t in range(len(self.consumers)):
            cw = self.consumer_nixl(t).connector_worker

            def drained(t: int = t, cw: Any = cw) -> bool:
                # A READ the trace left in flight: vLLM releases its handle when it is
                # reported done (get_transfer_results), so the next trace starts clean.
                self.consumer_poll(t)
                return not cw._recving_transfers

            waits.until(drained, f"consumer {t}'s READs in flight to complete")
            cw._recving_metadata.clear()
            getattr(cw, "_recv_failures", set()).clear()  # 0.30+
            # A failed receive the drain reported queued its blocks as invalid
            # (base_worker.py:2914); the next trace's D would fail its request with them.
            drain = getattr(self.consumer_nixl(t), "get_block_ids_with_load_errors", None)
            if drain is not None:
                drain()
        self.to_producer.wait_landed(self.inboxes, waits)
        for ib in self.inboxes:
            ib.reset()

    def consumer_poll(self, t: int = 0) -> Any:
        """One get_transfer_results of consumer t (as its model runner calls it)."""
        c = self.consumer_nixl(t)
        c.bind_connector_metadata(self.api.NixlConnectorMetadata())
        try:
            return transfer_results(c, set())
        finally:
            c.clear_connector_metadata()

    def shutdown(self) -> None:
        if self.closed:
            return
        self.closed = True
        for ib in self.inboxes:
            ib.restore()
        if self.push is not None:
            self.push.shutdown()
        for c in [*self.workers, *self.consumers]:
            with contextlib.suppress(Exception):
                c.shutdown()
        self.listener.shutdown()
        # Drop the agents (their destructors release UCX workers) and the caches.
        self.workers.clear()
        self.inboxes.clear()
        self.caches.clear()
        self.consumers.clear()
        self.consumers_caches.clear()


def build_cluster(
    row: ModelRow, device: str, waits: Waits, decode: str = "nixl", decode_tp: int = 0,
    model: str = DEFAULT_MODEL, layout: Layout = ONE_BLOCK,
) -> Cluster:  # fmt: skip
    """`decode_tp`: D's TP (0: the producer's); each D rank handshakes the producer ranks
    vLLM's read plan gives it (hetero TP: nixl/tp_mapping.py). PCP + DCP sharded mode
    (row.dcp > 1) runs the MLA fixture and a D of TP = DCP = P's transfer ranks, so that
    D rank t reads exactly P's shard t (see `sharded_decode_tp`)."""
    plan = device_plan(device)
    api = check_device(device)
    topo = row.topology
    model = fixture_model(row, model, device)
    dtp = decode_tp or sharded_decode_tp(row) or topo.tp
    if topo.pp != 1:
        raise DriverUnavailable(PP_UNAVAILABLE)
    n = next(_SEQ)
    engine_id = f"kvspec-P-{os.getpid()}-{n}"
    port = free_port()
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port)
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    blocks = layout.producer_blocks(row)
    cfg = vllm_config(
        api,
        "kv_producer",
        engine_id,
        row.composition,
        topo,
        blocks,
        row.async_scheduling,
        device,
        # MultiConnector on D refuses the hybrid KV manager unless every child supports it
        # (factory.py:57; ExampleConnector does not), and NIXL's handshake refuses peers
        # whose setting differs: both engines run without it.
        disable_hma=True if decode != "nixl" else None,
        transfer=row.transfer,
        model=model,
        dcp=row.dcp,
        prefix_caching=layout.prefix_caching,
    )
    kc = kv_cache_config(api, cfg)
    gen = api.torch.Generator().manual_seed(1234 + n)
    workers, caches = _build_producers(api, cfg, kc, row.composition, topo, plan, gen)
    inboxes = [
        NotifInbox(nixl_of(c, row.composition).connector_worker.nixl_wrapper) for c in workers
    ]
    cfg.parallel_config.rank = 0
    listener = _serve_handshakes(
        api, kc, engine_id, workers, topo, blocks, device, row, waits, model
    )
    # The decode engine runs with the producer's hybrid-KV-manager setting, as a deployment
    # must: NIXL's handshake refuses a peer whose compatibility hash differs, and the hash
    # includes is_hma_enabled (nixl/metadata.py:145-196).
    dcfg = vllm_config(
        api,
        "kv_consumer",
        f"kvspec-D-{os.getpid()}-{n}",
        decode,
        Topology(dtp, 1, 1),
        layout.consumer_blocks(row),
        False,
        device,
        disable_hma=bool(cfg.scheduler_config.disable_hybrid_kv_cache_manager),
        transfer=row.transfer,
        model=model,
        dcp=sharded_decode_tp(row) or 1,
    )
    consumers, consumers_caches = build_consumers(api, dcfg, plan, dtp, decode)
    cluster = Cluster(
        key=pool_key(row, device, decode, decode_tp, model, layout),
        composition=row.composition,
        topology=topo,
        api=api,
        engine_id=engine_id,
        cfg=cfg,
        kv_cache_config=kc,
        workers=workers,
        caches=caches,
        inboxes=inboxes,
        consumers=consumers,
        consumers_caches=consumers_caches,
        listener=listener,
        decode_composition=decode,
        dcp=row.dcp,
        model=model,
    )
    for t in range(dtp):
        cluster.to_producer.watch(cluster.consumer_nixl(t).connector_worker.nixl_wrapper)
    try:
        for t in range(dtp):
            cw = cluster.consumer_nixl(t).connector_worker
            handshake(cw, engine_id, port, cluster.transfer_tp, waits, row.dcp)
        if row.transfer == "push":
            cluster.push = push_side.build(api, dcfg, cluster.nixl_worker, cluster, waits)
    except BaseException:  # e.g. a handshake that timed out: a retry builds a new cluster
        cluster.shutdown()
        raise
    # The handshake is done; the listener thread may stop (it exits within 1 s).
    listener.connector_scheduler._stop_event.set()
    return cluster


def _build_producers(
    api: SimpleNamespace,
    cfg: Any,
    kc: Any,
    composition: str,
    topo: Topology,
    plan: DevicePlan,
    gen: Any,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """One worker-role connector per rank over its own KV caches, filled with seeded noise
    (a READ of a zero block would match an unread one) and registered with its NIXL agent."""
    device = api.torch.device(plan.device)
    layout = cfg.cache_config.get_resolved_kv_cache_layout()
    workers: list[Any] = []
    caches: list[dict[str, Any]] = []
    for w in range(topo.world_size):
        coords = topo.rank_coords(w)
        cfg.parallel_config.rank = w  # read once, by the offloading spec's config
        ident = tp_identity(coords.tp, topo.tp, coords.pcp)
        with api.set_current_vllm_config(cfg), keep_affinity(), ident, vllm_refusal(plan.device):
            conn = api.KVConnectorFactory.create_connector(
                config=cfg, role=api.KVConnectorRole.WORKER, kv_cache_config=kc
            )
        nw = nixl_of(conn, composition).connector_worker
        kv = allocate_caches(api, kc, device, layout, nw)
        for t in kv.values():
            # Drawn on the host (one seeded generator for every device), copied in.
            t.copy_(api.torch.randn(t.shape, generator=gen, dtype=t.dtype))
        _settle(api, plan)  # NIXL must not READ a cache whose fill is still queued
        with api.set_current_vllm_config(cfg), tp_identity(coords.tp, topo.tp, coords.pcp):
            conn.register_kv_caches(kv)
        _check_registration(nw, plan, f"producer rank {w}")
        workers.append(conn)
        caches.append(kv)
    return workers, caches


def _serve_handshakes(
    api: SimpleNamespace, kc: Any, engine_id: str, workers: list[Any], topo: Topology,
    blocks: int, device: str, row: ModelRow, waits: Waits, model: str = DEFAULT_MODEL,
) -> Any:  # fmt: skip
    """The producer engine's side channel: a scheduler-role NixlConnector serving every
    published rank's handshake metadata, keyed by (pp, tp) as the engine collects it."""
    lcfg = vllm_config(
        api, "kv_producer", engine_id, "nixl", topo, blocks, False, device,
        transfer=row.transfer, model=model, dcp=row.dcp,
    )  # fmt: skip
    kv_cache_config(api, lcfg)
    with api.set_current_vllm_config(lcfg):
        listener = api.KVConnectorFactory.create_connector(
            config=lcfg, role=api.KVConnectorRole.SCHEDULER, kv_cache_config=kc
        )
    md: dict[tuple[int, int], Any] = {}
    for w, conn in enumerate(workers):
        h = conn.get_handshake_metadata()
        if h is not None:
            coords = topo.rank_coords(w)
            md[(coords.pp, transfer_rank(topo, row.dcp, w))] = h
    serve_handshake_metadata(listener, md, waits)
    return listener


def _settle(api: SimpleNamespace, plan: DevicePlan) -> None:
    if plan.device == "cuda":
        api.torch.cuda.synchronize()

