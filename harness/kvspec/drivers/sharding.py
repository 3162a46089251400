"""PCP + DCP sharded mode in the cluster (nixl/base_worker.py:667-675): which fixture a row
runs, the decode engine's TP, and each producer rank's key among the transfer ranks."""

from __future__ import annotations

from kvspec.matrix import ModelRow, Topology


def fixture_model(row: ModelRow, model: str, device: str = "cpu") -> str:
    """The fixture a row runs. DCP needs MLA: vLLM asserts "PD with
    decode_context_parallel_size > 1 is only supported for MLA models" (config/vllm.py:
    1473-1491) and compute_tp_mapping scopes DCP to MLA (tp_mapping.py). On CUDA PCP needs
    MLA too: the NIXL worker picks the attention backend when it is built (base_worker.py:
    854, get_current_attn_backends) and the selector drops any backend whose impl lacks
    supports_pcp (v1/attention/backend.py:341-342), which only MLAAttentionImpl has
    (backend.py:1025); an OPT fixture with PCP 2 raised "No valid attention backend"
    (platforms/cuda.py:470) on an H200. The CPU backend does not check it, and the
    producer verdicts are the same with either fixture there (test_vllm_mla_pcp.py)."""
    if row.dcp > 1 or (device == "cuda" and row.topology.pcp > 1):
        return model if model.startswith("mla") else "mla"  # "mla-amx" is MLA too
    return model


def sharded(dcp: int, topo: Topology) -> bool:
    """nixl/base_worker.py:667-668: pcp_dcp_sharded."""
    return topo.pcp > 1 and dcp > 1


def sharded_decode_tp(row: ModelRow) -> int:
    """D's TP for a sharded row (0 otherwise): TP = DCP = P's transfer ranks, DeepSeek's
    decode deployment. D rank t's DCP slice is P's shard t (dcp_source_ranks,
    kv_connector/utils.py:544-562: equal DCP sizes keep the remote rank r % 2 == t), one
    READ per (request, producer rank) as KVCompletion's consumer_start_load_kv(r, w), and
    each P rank waits for one notification (dcp_consumer_count: max(1, 2 // 2))."""
    return row.topology.pcp if sharded(row.dcp, row.topology) else 0


def transfer_rank(topo: Topology, dcp: int, w: int) -> int:
    """Rank w's key among P's transfer ranks: its tp rank, plus pcp_rank * TP when sharded
    (v1/worker/gpu_worker.py:826-835; base_worker.py:669-672 transfer_tp_rank)."""
    c = topo.rank_coords(w)
    return c.tp + c.pcp * topo.tp if sharded(dcp, topo) else c.tp
