"""The MLA fixture and PCP + DCP sharded mode on the real classes: vLLM computes each rank's
identity itself (pcp_dcp_sharded, transfer_tp_rank, dcp_rank), every sharded rank
publishes and serves, each decode rank reads exactly its own shard, and a READ of an MLA
block copies the producer's bytes, with either CPU MLA backend vLLM runs: CPU_MLA (two
kernel blocks per block, float32) and AMX_MLA (one, bfloat16: an AMX host's default).
Negative controls: the replicated PCP cluster keeps replicas silent; a cache viewed in
logical blocks is not what NIXL registered; without AMX tiles the AMX pin falls back."""

from __future__ import annotations

import pytest
from kvspec.matrix import ModelRow, Topology
from kvspec.model import Action
from vllm_tests import PREFILL, require_vllm_driver

pytestmark = pytest.mark.vllm

require_vllm_driver()

from kvspec.drivers import sharding, vllm_caches, vllm_env  # noqa: E402
from kvspec.drivers.vllm_driver import VllmDriver  # noqa: E402


def _row(dcp: int) -> ModelRow:
    return ModelRow(
        f"t-pcp2-dcp{dcp}", "v0.30-shipped", "nixl", Topology(1, 1, 2), 1, 1, False, dcp=dcp
    )


def test_pure_rank_layout() -> None:
    sharded, replicated = _row(2), _row(1)
    assert sharding.fixture_model(sharded, "kv2") == "mla"
    assert sharding.fixture_model(sharded, "mla-amx") == "mla-amx"
    assert sharding.fixture_model(replicated, "kv2") == "kv2"
    # On CUDA only MLA attention supports PCP (v1/attention/backend.py:341-342, 1025).
    assert sharding.fixture_model(replicated, "kv2", "cuda") == "mla"
    pcp1 = ModelRow("t-pcp1", "v0.30-shipped", "nixl", Topology(1, 1, 1), 1, 1, False)
    assert sharding.fixture_model(pcp1, "kv2", "cuda") == "kv2"
    assert sharding.sharded_decode_tp(sharded) == 2
    assert sharding.sharded_decode_tp(replicated) == 0
    assert [sharding.transfer_rank(Topology(1, 1, 2), 2, w) for w in (0, 1)] == [0, 1]
    assert [sharding.transfer_rank(Topology(1, 1, 2), 1, w) for w in (0, 1)] == [0, 0]


@pytest.mark.parametrize("fixture", ["mla", "mla-amx"])
def test_sharded_ranks_each_serve_the_reader_of_their_own_shard(fixture: str) -> None:
    with VllmDriver(_row(2), model=fixture) as d:
        c = d.c
        assert c.model == fixture and c.cfg.model_config.use_mla
        for w in (0, 1):
            nw = c.nixl_worker(w)
            # vLLM's own __init__ derived these from the PCP group identity.
            assert (nw.pcp_rank, nw.pcp_dcp_sharded, nw.transfer_tp_rank) == (w, True, w)
            assert c.workers[w].get_handshake_metadata() is not None  # published
            plan = c.consumer_nixl(w).connector_worker.tp_mappings[c.engine_id]
            assert plan.all_source_ranks == (w,) and plan.local_consumers == 1
        for a in PREFILL * 2:  # prefill, then the metadata carrying reqs_to_send
            d.step(Action.parse(a))
        assert d.params[1]["tp_size"] == 2 and d.params[1]["dcp_size"] == 2
        for w in (0, 1):
            d.post_read(1, w)
            d.await_read(1, w)  # raises TransferCorrupted unless the bytes are P rank w's


def test_negative_control_replicated_pcp_keeps_replicas_silent() -> None:
    with VllmDriver(_row(1)) as d:
        c = d.c
        assert c.model == "kv2" and len(c.consumers) == 1
        assert not c.nixl_worker(1).pcp_dcp_sharded
        assert c.workers[1].get_handshake_metadata() is None


def test_mla_caches_are_allocated_in_cpu_mla_kernel_blocks() -> None:
    with VllmDriver(_row(2)) as d:
        cache = next(iter(d.c.caches[0].values()))
        kernel = int(d.c.nixl_worker(0).block_size)
        # CPU_MLA's kernel block is 16 tokens (cpu_mla.py:67-72), the fixture's block 32.
        assert kernel == 16 and cache.shape[-2] == kernel
        assert vllm_caches.logical_block(cache, 1).shape[0] == vllm_env.BLOCK_SIZE // kernel
        # Negative control, on a known fill (kernel block i holds i; the pooled cluster's
        # bytes are put back after): logical block 1 is kernel blocks 2 and 3, while
        # indexing the cache as logical blocks would read kernel block 1, half of logical
        # block 0.
        saved = cache.clone()
        try:
            for i in range(cache.shape[0]):
                cache[i].fill_(i)
            logical = vllm_caches.logical_block(cache, 1)
            assert [float(x.unique()) for x in logical] == [2.0, 3.0]
            assert float(cache[1].unique()) == 1.0  # the wrong block: logical 0's half
        finally:
            cache.copy_(saved)


def test_mla_caches_are_allocated_in_amx_mla_kernel_blocks() -> None:
    """What an AMX host runs: AMX_MLA's kernel takes the fixture's 32-token block whole
    (amx_mla.py:133-134), in bfloat16 (amx_mla.py:125), so a logical block is one kernel
    block and NIXL's descriptors are the blocks themselves."""
    with VllmDriver(_row(2), model="mla-amx") as d:
        cache = next(iter(d.c.caches[0].values()))
        assert d.c.nixl_worker(0).backend_name == "AMX_MLA"
        # D's ranks too: the decode rows' AMX sample (test_decode_real) rests on them
        assert {d.c.consumer_nixl(t).connector_worker.backend_name
                for t in range(len(d.c.consumers))} == {"AMX_MLA"}  # fmt: skip
        assert int(d.c.nixl_worker(0).block_size) == vllm_env.BLOCK_SIZE
        assert cache.shape[-2] == vllm_env.BLOCK_SIZE and str(cache.dtype) == "torch.bfloat16"
        assert vllm_caches.logical_block(cache, 1).data_ptr() == cache[1].data_ptr()


def _mla_backend(
    fixture: str | None, amx: bool, monkeypatch: pytest.MonkeyPatch, tiles: bool = False
) -> str:
    """The MLA backend vLLM's selector picks for the fixture on a host with or without AMX
    tiles (the NIXL worker's fallback when no layer is registered, kv_connector/utils.py
    get_current_attn_backends), with the driver's pin for `fixture` or without one (None),
    inside the driver's `amx_tiles` or not."""
    import contextlib

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention import selector

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    selector._cached_get_attn_backend.cache_clear()  # keyed without the host's flags
    api = vllm_env.vllm_api()
    mcfg = api.ModelConfig(
        model=str(vllm_env.MODELS["mla"]),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=vllm_env.MAX_MODEL_LEN,
        seed=0,
    )
    kw = {} if fixture is None else vllm_caches.pinned_attention(fixture, True, "cpu")
    scope = vllm_caches.amx_tiles(fixture or "") if tiles else contextlib.nullcontext()
    try:
        with scope:
            cfg = api.VllmConfig(model_config=mcfg, device_config=api.DeviceConfig("cpu"), **kw)
            with set_current_vllm_config(cfg):
                backend = selector.get_attn_backend(
                    mcfg.get_head_size(), mcfg.dtype, cfg.cache_config.cache_dtype, use_mla=True
                )
    finally:
        selector._cached_get_attn_backend.cache_clear()
    return str(backend.get_name())


def test_mla_backend_is_the_fixtures_on_any_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver pins the backend, so the layouts above are what every CI machine
    replays: "mla" is CPU_MLA on any host, "mla-amx" AMX_MLA on any host inside
    `amx_tiles`. Negative controls: unpinned, an AMX host gets AMX_MLA (platforms/cpu.py:
    151-164; this file's CPU_MLA layout test failed that way on an AMX machine before the
    pin), and the AMX pin without `amx_tiles` on a host without tiles falls back to
    CPU_MLA."""
    for amx in (True, False):
        assert _mla_backend("mla", amx, monkeypatch) == "CPU_MLA"
        assert _mla_backend("mla-amx", amx, monkeypatch, tiles=True) == "AMX_MLA"
    assert _mla_backend(None, False, monkeypatch) == "CPU_MLA"
    assert _mla_backend(None, True, monkeypatch) == "AMX_MLA"
    assert _mla_backend("mla-amx", False, monkeypatch) == "CPU_MLA"
    assert vllm_caches.pinned_attention("mla", False, "cpu") == {}
    assert vllm_caches.pinned_attention("mla", True, "cuda") == {}
    assert vllm_caches.fixture_dtype("mla-amx", "float32") == "bfloat16"
    assert vllm_caches.fixture_dtype("mla", "float32") == "float32"
