"""Where vLLM 0.32's decode side can take a full local prefix hit (Decode.tla's FullHit:
nothing to READ, the request runs at once and P is only notified), decided on the real
decode Scheduler with the NIXL scheduler side, not read off the code alone.

A full hit needs D's local hit to cover every token D would load. D loads the prompt minus
`_prefill_backoff()` tokens (nixl/base_scheduler.py:379-403) and a local hit stops at
prompt - 1 (kv_cache_manager.py:295) on a block boundary, so a plain attention model with
no backoff never takes one. Multi-module MTP gives a backoff (num_speculative_tokens - 1,
config/vllm.py:644-664), but a drafter also drops the last matched block of every hit
(`use_eagle_block_drop`, single_type_kv_cache_manager.py:819), and prefix caching with MTP
needs num_speculative_tokens <= block size (kv_cache_coordinator.py:146-155): the hit then
stays a block short. Only vLLM's experimental `disable_eagle_block_drop` (and Mamba or a
bounded-replay window, not built here) leaves a full hit reachable.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

PROMPT = [(i * 7) % 500 + 3 for i in range(65)]  # 2 blocks of 32 + 1: backoff 1 -> 64


def _decode_scheduler(block_drop: bool) -> tuple[Any, Any]:
    """A real decode Scheduler (NIXL consumer) on the full-hit rows' fixture and config
    (drivers/full_hit.py: GLM-4.5 shape, plain GQA, two MTP modules; prefix caching on),
    with vLLM's default block drop or without it."""
    from kvspec.drivers.full_hit import MODEL, mtp_drafter
    from kvspec.drivers.vllm_caches import kv_cache_config
    from kvspec.drivers.vllm_env import BLOCK_SIZE, vllm_api, vllm_config
    from kvspec.matrix import Topology

    api = vllm_api()
    drafter = partial(mtp_drafter, block_drop=block_drop)
    cfg = vllm_config(api, "kv_consumer", "D", "nixl", Topology(1, 1, 1), 16, False, "cpu",
                      model=MODEL, speculative=drafter)  # fmt: skip
    assert cfg.cache_config.enable_prefix_caching and not cfg.model_config.use_mla
    kc = kv_cache_config(api, cfg)
    sched = api.Scheduler(vllm_config=cfg, kv_cache_config=kc,
                          structured_output_manager=api.StructuredOutputManager(cfg),
                          block_size=BLOCK_SIZE)  # fmt: skip
    hasher = api.get_request_block_hasher(
        BLOCK_SIZE, api.get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    )
    return sched, hasher


def _request(api: Any, hasher: Any, rid: str, params: dict[str, Any] | None) -> Any:
    rq = api.Request(request_id=rid, prompt_token_ids=list(PROMPT),
                     sampling_params=api.SamplingParams(max_tokens=1), pooling_params=None,
                     block_hasher=hasher)  # fmt: skip
    rq.kv_transfer_params = params
    return rq


def _second_request_after_a_local_one(block_drop: bool) -> tuple[str, int, Any]:
    """D runs the prompt locally (its blocks cached), then receives it P/D: R's status
    after D's next schedule, the tokens scheduled for it, and its receive entry."""
    from kvspec.drivers.vllm_env import runner_output, vllm_api

    api = vllm_api()
    sched, hasher = _decode_scheduler(block_drop)
    backoff = sched.connector.connector_scheduler._prefill_backoff()
    assert backoff == 1  # MTP, two speculative tokens: D loads 64 of the 65 tokens
    sched.add_request(_request(api, hasher, "L", None))
    so = sched.schedule()
    sched.update_from_output(so, runner_output(api, so, None))  # L finishes: blocks cached
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [1, 2, 3], "remote_engine_id": "P", "remote_request_id": "pR",
              "remote_host": "127.0.0.1", "remote_port": 5600}  # fmt: skip
    sched.add_request(_request(api, hasher, "R", params))
    so = sched.schedule()
    r = sched.requests["R"]
    recv = so.kv_connector_metadata.reqs_to_recv.get("R")
    return r.status.name, so.num_scheduled_tokens.get("R", 0), recv


def test_an_mtp_drafter_keeps_every_local_hit_a_block_short_of_a_full_hit() -> None:
    status, scheduled, recv = _second_request_after_a_local_one(block_drop=True)
    # a block (32 tokens) to READ: parked, waiting for the remote KV
    assert status == "WAITING_FOR_REMOTE_KVS" and scheduled == 0
    assert recv is not None and any(len(g) for g in recv.local_block_ids)


def test_negative_control_without_the_block_drop_the_same_request_is_a_full_hit() -> None:
    status, scheduled, recv = _second_request_after_a_local_one(block_drop=False)
    # the local hit covers all 64 tokens D would load: it runs at once, READs nothing and
    # only notifies P (a notify-only entry: no local block)
    assert status == "RUNNING" and scheduled > 0
    assert recv is not None and not any(len(g) for g in recv.local_block_ids)


def test_a_release_without_the_backoff_or_the_option_is_unavailable_not_a_verdict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 0.29 has neither _prefill_backoff nor disable_eagle_block_drop: its full-hit rows are
    # not driven there (`kvspec versions`), never replayed into a false divergence.
    from dataclasses import dataclass

    import vllm.config
    from kvspec.drivers import full_hit
    from kvspec.drivers.vllm_env import DriverUnavailable

    class Sched:
        def _prefill_backoff(self) -> int:
            return self.n

        def __init__(self, n: int) -> None:
            self.n = n

    full_hit.require_backoff(Sched(1))  # 0.32's D with the drafter
    for old in (object(), Sched(0)):
        with pytest.raises(DriverUnavailable, match="no prefill backoff"):
            full_hit.require_backoff(old)

    @dataclass
    class OldSpeculativeConfig:
        method: str = "mtp"

    monkeypatch.setattr(vllm.config, "SpeculativeConfig", OldSpeculativeConfig)
    with pytest.raises(DriverUnavailable, match="no disable_eagle_block_drop"):
        full_hit.mtp_drafter(None)
