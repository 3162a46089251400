"""The decode engine's worker connectors of a cluster (kvspec.drivers.vllm_cluster): built
over their own KV caches, checked for the memory type vLLM registered, and handshaken with
the producer over the real side channel; and the NIXL connector inside a composition."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvspec.drivers.base import WaitTimeout
from kvspec.drivers.vllm_caches import allocate_caches, kv_cache_config
from kvspec.drivers.vllm_env import DevicePlan, keep_affinity, tp_identity
from kvspec.drivers.vllm_inbox import ClusterError, Waits

# base_worker.py: `sock.setsockopt(zmq.RCVTIMEO, 5000)` around the handshake's metadata query.
VLLM_HANDSHAKE_S = 5.0


def nixl_of(conn: Any, composition: str) -> Any:
    """The NIXL connector of a worker (a MultiConnector's first child)."""
    return conn if composition == "nixl" else conn._connectors[0]


def build_consumers(
    api: SimpleNamespace, dcfg: Any, plan: DevicePlan, tp: int, decode: str = "nixl"
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Decode side: one consumer worker per TP rank (D has tp = P's tp, pp = 1, pcp = 1),
    each with its own agent and caches."""
    dkc = kv_cache_config(api, dcfg)
    device = api.torch.device(plan.device)
    layout = dcfg.cache_config.get_resolved_kv_cache_layout()
    consumers: list[Any] = []
    consumers_caches: list[dict[str, Any]] = []
    for t in range(tp):
        with api.set_current_vllm_config(dcfg), keep_affinity(), tp_identity(t, tp):
            consumer = api.KVConnectorFactory.create_connector(
                config=dcfg, role=api.KVConnectorRole.WORKER, kv_cache_config=dkc
            )
        dkv = allocate_caches(api, dkc, device, layout, nixl_of(consumer, decode).connector_worker)
        with api.set_current_vllm_config(dcfg), tp_identity(t, tp):
            consumer.register_kv_caches(dkv)
        _check_registration(nixl_of(consumer, decode).connector_worker, plan, f"consumer {t}")
        consumers.append(consumer)
        consumers_caches.append(dkv)
    return consumers, consumers_caches


def handshake(cw: Any, engine_id: str, port: int, tp: int, waits: Waits, dcp: int = 1) -> None:
    """A consumer's real handshake over the side channel, with the producer rank(s) its
    transfer topology maps it to (with equal TP: the producer of the same tp rank).
    `tp`, `dcp`: the producer's transfer TP and DCP sizes (its kv_transfer_params')."""
    import zmq

    fut = (cw._ensure_handshake(engine_id, "127.0.0.1", port, tp, dcp) if dcp > 1
           else cw._ensure_handshake(engine_id, "127.0.0.1", port, tp))  # fmt: skip

    def done() -> bool:
        if fut is not None and fut.done() and fut.exception() is not None:
            exc = fut.exception()
            if isinstance(exc, zmq.Again):
                # vLLM's own bound on the side channel's reply (RCVTIMEO, 5 s) expired: a
                # timeout on a loaded machine, not a broken producer.
                raise WaitTimeout("the NIXL handshake's side-channel reply", VLLM_HANDSHAKE_S)
            raise ClusterError(f"NIXL handshake with the producer failed: {exc}")
        return fut is None or engine_id in cw._remote_agents

    waits.until(done, "the NIXL handshake with the producer")


def _check_registration(nixl_worker: Any, plan: DevicePlan, who: str) -> None:
    """vLLM decides the NIXL memory type and host staging itself; refuse a cluster where
    it did not do what the plan says (e.g. a CUDA run that silently staged through DRAM)."""
    # region_mem_types: what register_kv_caches actually registered, region by region
    # (base_worker.py: DRAM for a host tensor, nixl_memory_type for a device one).
    # 0.29 does not record it: its nixl_memory_type is the one it registered with
    mem = getattr(nixl_worker, "region_mem_types", None)
    if mem is None:
        mem = [nixl_worker.nixl_memory_type]
    kinds = sorted(set(mem)) or ["nothing"]
    host = nixl_worker.use_host_buffer
    if kinds != [plan.nixl_memory] or host:
        raise ClusterError(
            f"{who}: vLLM registered its KV caches as {'+'.join(kinds)} (host buffer {host}); "
            f"device {plan.device} expects {plan.nixl_memory} without a host buffer"
        )
