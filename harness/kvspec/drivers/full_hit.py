"""Full local prefix hits on the real decode engine (Decode.tla's FullHit): the deployment in
which vLLM 0.32 can take one, and how the decode driver makes the spec's chosen requests
full hits.

0.32 takes a full hit only with a prefill backoff and no drafter block drop
(harness/tests/test_full_hit_reach.py). The rows run a GLM-4.5-shaped fixture (plain GQA,
MODELS["glm-mtp"]) whose decode engine has two MTP modules, num_speculative_tokens 2
(backoff 1: base_scheduler.py:379-394, config/vllm.py:644-664), vLLM's experimental
disable_eagle_block_drop and prefix caching on. D's prompt is P's 32 tokens plus the one
token of the backoff, so D asks P for 32 tokens (base_scheduler.py:396-403). In a deployment
P runs the same drafter and truncates its copy of the prompt by the backoff
(_truncate_request_for_prefill); here P's prompt is those 32 tokens and P runs no drafter
(the producer is the vLLM driver's), which computes the same KV.

Which requests are full hits is the spec's choice at `schedule`; a deployment's is its
prefix cache. The driver reads the choice off the trace (`full_hits`) and, before any
trace request reaches D, runs each chosen prompt once on D as a local request (`seed`):
its first block is then in D's prefix cache, and vLLM's own lookup
(kv_cache_manager.get_computed_blocks, pull_scheduler.py:58-65) makes the request a full
hit when D schedules it. The other requests' prompts are not cached: they READ.
"""

from __future__ import annotations

from typing import Any

MODEL = "glm-mtp"
NUM_SPECULATIVE_TOKENS = 2  # lookahead 2: backoff 1, and <= the block (coordinator:146-155)
BACKOFF_TOKEN = 5  # the prompt's last token, which D computes itself


def mtp_drafter(model_config: Any, block_drop: bool = False) -> Any:
    """vllm_env.vllm_config's `speculative` hook: the fixture's own MTP modules as drafter,
    the trailing-block drop off (the only way 0.32 leaves a full hit reachable here;
    `block_drop` True is vLLM's default, test_full_hit_reach.py's control)."""
    from vllm.config import ParallelConfig, SpeculativeConfig

    from kvspec.drivers.vllm_env import DriverUnavailable

    if "disable_eagle_block_drop" not in getattr(SpeculativeConfig, "__dataclass_fields__", {}):
        raise DriverUnavailable("this vLLM has no disable_eagle_block_drop (0.32 has): "
                                "no deployment of it takes a full hit here")  # fmt: skip
    return SpeculativeConfig(
        method="mtp",
        num_speculative_tokens=NUM_SPECULATIVE_TOKENS,
        disable_eagle_block_drop=not block_drop,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )


def require_backoff(nixl_scheduler: Any) -> None:
    """D's NIXL scheduler must leave the backoff token to D (0.32's _prefill_backoff; a
    release without one asks P for the whole prompt, so no local hit covers it)."""
    from kvspec.drivers.vllm_env import DriverUnavailable

    backoff = getattr(nixl_scheduler, "_prefill_backoff", None)
    if backoff is None or backoff() < 1:
        raise DriverUnavailable("this vLLM's NIXL scheduler has no prefill backoff here: "
                                "no full hit is reachable (base_scheduler.py:379-403)")  # fmt: skip


def decode_prompt(producer_prompt: list[int]) -> list[int]:
    """D's prompt: P's (what P computes) and the backoff token."""
    return [*producer_prompt, BACKOFF_TOKEN]


def full_hits(trace: list[tuple[str, dict[str, Any]]]) -> frozenset[int]:
    """The requests the trace's `schedule` steps admit as full hits: newly admitted (st
    leaves "new") and not awaited by the step they are admitted in (Decode.tla schedule:
    aw = news \\ full)."""
    out: set[int] = set()
    for (_, before), (act, after) in zip(trace, trace[1:], strict=False):
        if act != "schedule":
            continue
        news = {r for r, s in before["st"].items() if s == "new" and after["st"][r] != "new"}
        steps = after["steps"]
        out |= news - set(steps[max(steps)]["aw"])
    return frozenset(out)


def seed(api: Any, sched: Any, hasher: Any, prompts: dict[int, list[int]]) -> None:
    """Run each prompt once on D as a local request (one step, one sampled token), so that
    its full blocks stay in D's prefix cache after it finishes (freed, evictable: the
    driver's D has room for every trace request without evicting them)."""
    from kvspec.drivers.vllm_env import runner_output

    if not prompts:
        return
    for r, prompt in sorted(prompts.items()):
        sched.add_request(api.Request(
            request_id=f"seed{r}", prompt_token_ids=prompt,
            sampling_params=api.SamplingParams(max_tokens=1), pooling_params=None,
            block_hasher=hasher,
        ))  # fmt: skip
    so = sched.schedule()
    sched.update_from_output(so, runner_output(api, so, None))
    left = [f"seed{r}" for r in prompts if f"seed{r}" in sched.requests]
    if left:  # a harness fault, not a configuration vLLM refuses: an error, not "unavailable"
        raise RuntimeError(f"D's prefix cache was not seeded: {left} did not finish in a step")
