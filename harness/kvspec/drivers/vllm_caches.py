"""A rank's KV cache as its model runner has it: the cache spec of the fixture model (full
attention with its share of the KV heads, or MLA's one latent vector), the caches allocated
in the attention backend's kernel block size, and a logical block's view of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

from kvspec.drivers.vllm_env import BLOCK_SIZE, HEAD_SIZE, NUM_LAYERS, DriverUnavailable


def kv_cache_config(api: SimpleNamespace, cfg: Any) -> Any:
    """One rank's KV cache: its share of the model's KV heads (vLLM shards heads over TP
    and replicates them once TP exceeds them: max(1, heads // tp), as TransferTopology's
    local_physical_heads)."""
    layers = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    if cfg.model_config.use_mla:
        spec = _mla_spec(api, cfg)
    else:
        tp = int(cfg.parallel_config.tensor_parallel_size)
        heads = int(cfg.model_config.get_total_num_kv_heads())
        if heads % tp if heads >= tp else tp % heads:
            raise DriverUnavailable(f"tp={tp} and the fixture's {heads} KV heads do not divide")
        spec = api.FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=max(1, heads // tp),
            head_size=HEAD_SIZE,
            dtype=cfg.model_config.dtype,  # the fixture's (DevicePlan.dtype)
        )
    kc = api.get_kv_cache_config_from_groups(cfg, [api.KVCacheGroupSpec(layers, spec)], 1 << 30)
    cfg.cache_config.num_gpu_blocks = kc.num_blocks
    return kc


def allocate_caches(api: SimpleNamespace, kc: Any, device: Any, layout: Any, nw: Any) -> Any:
    """A rank's KV caches as its model runner allocates them: in the kernel block size its
    NIXL worker synced to (`nw.block_size` after base_worker.py _sync_block_size_with_kernel,
    the model runner's prepare_kernel_block_sizes: select_common_block_size). CPU_ATTN takes
    BLOCK_SIZE; CPU_MLA's kernel is 16 (cpu_mla.py:67-72), so an MLA logical block is two
    kernel blocks, and a cache viewed in logical blocks would misplace NIXL's descriptors."""
    kernel = int(nw.block_size)
    if kernel == BLOCK_SIZE:
        return api.allocate_kv_cache(kc, device, layout)
    return api.allocate_kv_cache(kc, device, layout, [kernel])


def logical_block(cache: Any, b: int) -> Any:
    """Logical block b of a cache allocated in kernel blocks (allocate_caches): its
    BLOCK_SIZE // kernel consecutive kernel blocks."""
    k = BLOCK_SIZE // int(cache.shape[-2])  # [B, H, N, C] views (allocate_kv_cache)
    return cache[b] if k == 1 else cache[b * k : (b + 1) * k]


def zero_blocks(caches: dict[str, Any], blocks: tuple[int, ...]) -> None:
    """Zero logical `blocks` of every layer's cache (a transfer's destination, so that a
    block nothing wrote cannot pass the byte check)."""
    for cache in caches.values():
        for b in blocks:
            logical_block(cache, b).zero_()


def differing_layer(
    torch: Any,
    got: dict[str, Any],
    local: tuple[int, ...],
    sent: dict[str, Any],
    remote: tuple[int, ...],
) -> str | None:
    """The first layer whose logical blocks `local` of caches `got` differ from blocks
    `remote` of caches `sent`, pairwise (None: every block equal)."""
    for name, cache in got.items():
        for lb, rb in zip(local, remote, strict=True):
            if not torch.equal(logical_block(cache, lb), logical_block(sent[name], rb)):
                return name
    return None


def _mla_spec(api: SimpleNamespace, cfg: Any) -> Any:
    """MLA's cache: one latent vector per token (kv_lora_rank + qk_rope_head_dim, the
    model config's head size), the same on every TP rank; as the model's MLAAttention
    layer declares it (model_executor/layers/attention/mla_attention.py get_kv_cache_spec)."""
    if api.MLAAttentionSpec is None:
        raise DriverUnavailable("this vLLM has no MLAAttentionSpec: MLA rows are not driven")
    fields = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 1,
        "head_size": int(cfg.model_config.get_head_size()),
        "dtype": cfg.model_config.dtype,
        "cache_dtype_str": "auto",
        "max_tp_shards": 1,  # 0.32: not split over TP (a release without it has no field)
    }
    names = {f.name for f in dataclasses.fields(api.MLAAttentionSpec)}
    return api.MLAAttentionSpec(**{k: v for k, v in fields.items() if k in names})


# The fixtures that run vLLM's AMX MLA backend: what vLLM picks on an AMX host.
AMX_FIXTURES = frozenset({"mla-amx"})


def pinned_attention(model: str, use_mla: bool, device: str) -> dict[str, Any]:
    """VllmConfig keyword arguments that pin an MLA fixture's backend on CPU. vLLM picks
    the MLA backend by the host's CPU flags: AMX_MLA where torch sees AMX tiles, whose kernel
    block is any multiple of 32 (amx_mla.py:133-134), else CPU_MLA, whose kernel is 16
    (cpu_mla.py:67-72) (platforms/cpu.py:151-176, "Prefer AMX when available, unless
    CPU_MLA was explicitly requested"). Pinned, every CI machine lays an MLA rank's cache
    out the same way and a verdict cannot change with the machine that replayed it: "mla"
    runs CPU_MLA (two kernel blocks per logical block: NIXL's kernel-split path), "mla-amx"
    AMX_MLA (one), on any host (`amx_tiles`). A release without AttentionConfig or AMX_MLA
    has CPU_MLA as its only CPU MLA backend: nothing to pin."""
    if not use_mla or device != "cpu":
        return {}
    try:
        from vllm.config import AttentionConfig
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        return {}
    if "AMX_MLA" not in AttentionBackendEnum.__members__:
        if model in AMX_FIXTURES:
            raise DriverUnavailable("this vLLM has no AMX_MLA backend")
        return {}
    name = "AMX_MLA" if model in AMX_FIXTURES else "CPU_MLA"
    return {"attention_config": AttentionConfig(backend=AttentionBackendEnum[name])}


def fixture_dtype(model: str, plan_dtype: str) -> str:
    """The fixture's dtype: the device plan's, except AMX_MLA's only one, bfloat16
    (amx_mla.py:125 supported_dtypes; a real engine with float32 weights fails at load:
    "expect weight to be bfloat16, float16, ..."), which is what an AMX host runs."""
    return "bfloat16" if model in AMX_FIXTURES else plan_dtype


@contextmanager
def amx_tiles(model: str) -> Iterator[None]:
    """While an AMX fixture's cluster is built: torch reports AMX tiles, as on an AMX host,
    so vLLM's CPU platform keeps the AMX_MLA pin (without tiles it falls back to CPU_MLA,
    platforms/cpu.py:151-176) and leaves the block size alone (:250-280). The backend the
    NIXL worker picks at construction is cached by the selector under the pinned backend
    (selector.py _cached_get_attn_backend), so nothing after the build reads the flag. The
    driver runs no attention kernel, so no AMX instruction runs on a host without it."""
    if model not in AMX_FIXTURES:
        yield
        return
    import torch

    real = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: True
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = real
