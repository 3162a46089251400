"""The recorder's `start` event: the deployment as kvspec validate needs it to pick the
spec's constants (kvspec.record.connectors emits it at the scheduler's construction)."""

from __future__ import annotations

from typing import Any


def describe(connector: Any, vllm_config: Any) -> dict[str, Any]:
    """What kvspec validate needs to pick the spec's constants."""
    import vllm

    p = vllm_config.parallel_config
    return {
        "connector": type(connector).__name__,
        "children": [type(c).__name__ for c in getattr(connector, "_connectors", ())],
        "async_scheduling": bool(getattr(vllm_config.scheduler_config, "async_scheduling",
                                         False)),
        "tp": int(p.tensor_parallel_size), "pp": int(p.pipeline_parallel_size),
        "pcp": int(getattr(p, "prefill_context_parallel_size", 1) or 1),
        # Decode.tla's MLA: P TP > D TP reads one rank, notify-only to the rest
        "mla": bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False)),
        "vllm": str(getattr(vllm, "__version__", "?")),
        # the NIXL scheduler's kv_lease_duration (base_scheduler.py:82-86): the clock's tick
        "lease": _lease(connector),
        # Decode.tla's Policy (config/kv_transfer.py: "fail" unless "recompute")
        "kv_load_failure_policy": str(getattr(vllm_config.kv_transfer_config,
                                              "kv_load_failure_policy", "fail")),
        # whether a decode engine may hold part of a prompt already (a local hit: it then
        # receives only the blocks after it), and a producer's requests share blocks
        "prefix_caching": bool(getattr(getattr(vllm_config, "cache_config", None),
                                       "enable_prefix_caching", False)),
        # Decode.tla's LoadCap: vLLM 0.34's --max-num-inflight-kv-loads (None: unset, and
        # every release before 0.34)
        "max_num_inflight_kv_loads": getattr(vllm_config.scheduler_config,
                                             "max_num_inflight_kv_loads", None),
    }  # fmt: skip


def _lease(connector: Any) -> int | None:
    for c in [connector, *getattr(connector, "_connectors", ())]:
        sched = getattr(c, "connector_scheduler", None)
        if sched is not None and hasattr(sched, "_kv_lease_duration"):
            return int(sched._kv_lease_duration)
    return None
