"""DecodeBlocks traces (spec/DecodeBlocks.tla) replayed on a real decode scheduler
(drivers.blocks_driver): TLC dumps a row's state graph, `cover_edges` paths cover every edge
(kvspec.lease_traces' machinery), and each path is driven step by step, comparing after
every step what the driver sees (blocks_driver.project). TLC's action labels carry no
parameters: `step_of` reads them off the state change.

`kvspec blocks --conform [--tier fast|full] [--only ROW]`: per row, edges, traces,
conforming / diverging / inconclusive / not driven; exit 1 on a divergence. The kept
counterexample of the at-once design (conformance/blocks/) must diverge on 0.32: it defers.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.drivers.base import MissingAction
from kvspec.drivers.vllm_env import BLOCK_SIZE, DriverUnavailable
from kvspec.itf import JSON, value_from_itf
from kvspec.lease_conform import run_conform_rows
from kvspec.lease_traces import TRACES, LeaseConformance, _edges, edge_traces, lease_graph
from kvspec.sweep import Sweep, SweepRow
from kvspec.tlcvalue import Value

REGRESSIONS = Path(__file__).resolve().parents[2] / "conformance" / "blocks"
DEFAULT_PROMPT = 8  # tokens: a request that never grows stays well inside its block


def self_preempt_of(version: str) -> str:
    """DecodeBlocks' SelfPreempt of a vLLM release: under the priority policy a running
    request that preempts itself ends the running loop up to 0.32 ("stop", S:845-847);
    0.33.0 goes on to the requests after it ("continue", scheduler.py:985-995)."""
    from kvspec.versions import before

    return "stop" if before(version, (0, 33)) else "continue"


def offload_fence_of(version: str) -> str:
    """DecodeBlocks' Offload of a vLLM release with D's MultiConnector(NIXL, Offloading):
    0.32's child returns from update_state_after_alloc at 0 external tokens before it
    records the allocation (offloading/scheduler.py:1149-1150, #46951); 0.33.0 records it
    first (1354-1359). `kvspec blocks --offload-probe` reads it off the real class."""
    from kvspec.versions import before

    return "fence-scheduled" if before(version, (0, 33)) else "fence-all"


def why_not_driven(row: SweepRow, version: str | None = None) -> str | None:
    """Why the installed vLLM (or `version`; 0.29+: deferred frees) cannot be driven as
    this row."""
    c = row.consts
    if c["Offload"] != "none":
        # The real child stores full blocks only: a request's prompt fills its block at the
        # step that finishes it (finish_plan), which more batches in flight or a grow would
        # turn into a second block. Those rows' race step runs in --offload-probe.
        if int(c["Batches"]) != 1 or c["Grow"]:
            return ("the offload child is replayed at one batch without grow; "
                    "--offload-probe drives this row's race step")  # fmt: skip
        if version is None:
            from kvspec.conform import installed_vllm

            version = installed_vllm()
        if c["Offload"] != offload_fence_of(version):
            return (f"vLLM {version}'s offload child is {offload_fence_of(version)!r}, "
                    f"the row's {c['Offload']!r}")  # fmt: skip
    if int(c["Batches"]) > 2 and int(c["Stagger"]) != 2:
        return "three batches without the decode stagger (XPU without PP microbatching)"
    if c["Design"] == "at-once" and int(c["Batches"]) > 1:
        return "design at-once is not the installed vLLM's (it defers frees, #45357)"
    if c["Policy"] == "priority":
        if version is None:
            from kvspec.conform import installed_vllm

            version = installed_vllm()
        mine = self_preempt_of(version)
        if c["SelfPreempt"] != mine:
            return (f"vLLM {version}'s self-preempting request does "
                    f"{'not ' if mine == 'stop' else ''}go on to the next "
                    f"(SelfPreempt {mine!r}, the row's {c['SelfPreempt']!r})")  # fmt: skip
    return None


def _decode(state: dict[str, JSON]) -> dict[str, Value]:
    return {k: value_from_itf(v) for k, v in state.items() if not k.startswith("#")}


def _seq(v: Any) -> list[Any]:
    return list(v.as_dict().values()) if hasattr(v, "as_dict") else list(v)


def step_of(a: dict[str, Any], b: dict[str, Any], action: str) -> tuple[str, tuple[Any, ...]]:
    """(driver method, args) for the spec step a -> b labelled `action`."""
    if action in ("schedule", "execute"):
        return action, ()
    if action == "Done":  # the end: the engine has nothing left
        return "idle", ()
    if action == "read_done":
        r = next(i for i, (x, y) in enumerate(zip(_seq(a["rd"]), _seq(b["rd"]), strict=True), 1)
                 if x != y)  # fmt: skip
        return action, (r,)
    if action == "grow":
        r = next(iter(frozenset(b["want"]) - frozenset(a["want"])))
        return action, (r,)
    if action == "store_done":  # the offload child's rows (drivers.blocks_offload)
        r = next(i for i, (x, y) in enumerate(zip(_seq(a["sto"]), _seq(b["sto"]), strict=True), 1)
                 if x != y)  # fmt: skip
        return action, (r,)
    if action == "update":
        fin = frozenset(i for i, (x, y) in enumerate(zip(_seq(a["st"]), _seq(b["st"]),
                                                         strict=True), 1)
                        if x != "done" and y == "done")  # fmt: skip
        return action, (fin,)
    raise MissingAction(f"action {action!r} is not driven")


def _in_batch_counts(doc: dict[str, JSON]) -> tuple[dict[int, int], dict[int, int]]:
    """Per request: how many schedules put it in a step (its tokens) in the whole trace,
    and before its grow (if it grows)."""
    raw: Any = doc["states"]
    states = [_decode(s) for s in raw]
    total: dict[int, int] = {}
    at_grow: dict[int, int] = {}
    for i in range(1, len(states)):
        action = str(raw[i]["#meta"]["action"])
        if action == "schedule":
            for r in _seq(states[i]["steps"])[-1]["batch"]:
                total[int(r)] = total.get(int(r), 0) + 1
        elif action == "grow":
            (r,) = step_of(states[i - 1], states[i], action)[1]
            at_grow[int(r)] = total.get(int(r), 0)
    return total, at_grow


def prompt_plan(doc: dict[str, JSON], nlocal: int, nreq: int) -> dict[int, int]:
    """Each request's prompt length, so that its token count crosses a block boundary
    exactly at its first schedule after the trace's grow(r), and never if it does not
    grow: the spec's Grow, steered by construction (the forward makes one token per
    scheduled request; nothing of vLLM's state is edited).

    Each schedule that puts r in a step computes one position more (a preempted request's
    recompute included: with deferred frees a victim has no step in flight, so none of
    its outputs is dropped). A local request (set up by a prefill and a decode step)
    computes position P + j at its j-th schedule of the trace, a remote one P - 1 + (j -
    1) (its first is the promotion, which recomputes the prompt's last token, S:3171); a
    position of BLOCK_SIZE or more needs a second block. Default prompt: 8 tokens."""
    total, at_grow = _in_batch_counts(doc)
    plan: dict[int, int] = {}
    for r in range(1, nreq + 1):
        local = r <= nlocal
        if r in at_grow:
            d = at_grow[r]
            p = BLOCK_SIZE - d - 1 if local else BLOCK_SIZE + 1 - d
        else:
            d = total.get(r, 0)
            p = min(DEFAULT_PROMPT, BLOCK_SIZE - d - 1 if local else BLOCK_SIZE + 1 - d)
        if not 1 <= p <= BLOCK_SIZE:  # the trace is longer than a block: not steerable
            raise DriverUnavailable(f"request {r}: no prompt length puts its block boundary "
                                f"at the trace's step (prompt {p})")  # fmt: skip
        plan[r] = p
    return plan


def prompt_only_stores(row: SweepRow) -> bool:
    """Whether an offload row is replayed with the child's default, prompt-only stores
    (`offload_prompt_only`, v1/kv_offload/base.py:620-621): when every request is P/D. A
    local request's block can only be filled by decoding (the set-up's decode step needs
    room in it), so rows with one turn the default off."""
    return int(row.consts["NLocal"]) == 0


def finish_plan(
    doc: dict[str, JSON], nlocal: int, nreq: int, prompt_only: bool = False
) -> dict[int, int]:
    """Offload rows (one batch, no grow): each request that the trace finishes gets the
    prompt that fills its block exactly at the step whose output finishes it, so the real
    child (which stores full blocks only, offloading/scheduler.py:1570-1844) has a store of
    it, as the spec's child has; the others keep prompt_plan's. Positions as in
    prompt_plan: the j-th schedule computes P + j (local), P - 1 + (j - 1) (remote); the
    block is full when that is BLOCK_SIZE - 1. With `prompt_only` the block must be full
    of prompt (a request finishing at its first schedule), else the trace is not
    steerable."""
    raw: Any = doc["states"]
    states = [_decode(s) for s in raw]
    plan = prompt_plan(doc, nlocal, nreq)
    total, _ = _in_batch_counts(doc)
    last = _seq(states[-1]["st"])
    for r in range(1, nreq + 1):
        if last[r - 1] != "done":
            continue
        j = total.get(r, 0)
        p = BLOCK_SIZE - 1 - j if r <= nlocal else BLOCK_SIZE + 1 - j
        if not 1 <= p <= BLOCK_SIZE:
            raise DriverUnavailable(f"request {r}: no prompt fills its block at its finish")
        if prompt_only and p != BLOCK_SIZE:
            raise DriverUnavailable(f"request {r}: prompt-only stores, and decoding fills "
                                    "its block")  # fmt: skip
        plan[r] = p
    return plan


@dataclass(frozen=True)
class BlocksReplay:
    steps: int
    divergence: str | None


def replay_blocks(doc: dict[str, JSON], driver: Any) -> BlocksReplay:
    raw: Any = doc["states"]
    states = [_decode(s) for s in raw]

    def check(i: int) -> str | None:
        got, want = driver.observe(), driver.spec_view(states[i])
        bad = sorted(k for k in want if got[k] != want[k])
        return None if not bad else f"step {i}: " + "; ".join(
            f"{k}: spec {want[k]!r}, vLLM {got[k]!r}" for k in bad)  # fmt: skip

    if (bad := check(0)) is not None:
        return BlocksReplay(0, bad)
    for i in range(1, len(states)):
        action = str(raw[i]["#meta"]["action"])
        try:
            name, args = step_of(states[i - 1], states[i], action)
            getattr(driver, name)(*args)
        except MissingAction as exc:
            return BlocksReplay(i - 1, f"step {i} ({action}): vLLM cannot: {exc}")
        if (bad := check(i)) is not None:
            return BlocksReplay(i, bad)
    return BlocksReplay(len(states) - 1, None)


@dataclass(frozen=True)
class Plan:
    """What a trace fixes before its first step: each request's prompt length (Grow) and
    priority (the spec's prio, chosen at Init)."""

    prompts: dict[int, int]
    priorities: dict[int, int]


# (row, plan) -> a driver
DriverFactory = Callable[[SweepRow, Plan], Any]
# Rows with more edge-covering traces replay an even sample of this many.
MAX_TRACES = 2000


def _vllm_blocks_driver(row: SweepRow, plan: Plan, prefix_caching: bool = False) -> Any:
    """The real decode scheduler for a trace's plan; `prefix_caching`: vLLM's default, on;
    with the offload child on the rows that have one."""
    from kvspec.drivers.blocks_driver import BlocksDriver

    if row.consts["Offload"] != "none":
        from kvspec.drivers.blocks_offload import OffloadBlocksDriver

        return OffloadBlocksDriver(row, prompts=plan.prompts, prefix_caching=prefix_caching)
    return BlocksDriver(
        row, prompts=plan.prompts, priorities=plan.priorities, prefix_caching=prefix_caching
    )


def cached_blocks_driver(row: SweepRow, plan: Plan) -> Any:
    return _vllm_blocks_driver(row, plan, prefix_caching=True)


def hit_counting_driver(prefix_caching: bool, hits: list[int]) -> DriverFactory:
    """A driver factory that appends to `hits`, per driver it builds, how many of vLLM's
    prefix lookups (`KVCacheManager.get_computed_blocks`) hit: what the prefix-caching
    runs measure (bench/blocks_prefix_hits.py, test_decode_prefix_caching.py)."""

    def make(row: SweepRow, plan: Plan) -> Any:
        d = _vllm_blocks_driver(row, plan, prefix_caching)
        m = d.d.kv_cache_manager
        real = m.get_computed_blocks
        slot = len(hits)
        hits.append(0)

        def counted(request: Any) -> Any:
            out = real(request)
            hits[slot] += int(out[1] > 0)
            return out

        m.get_computed_blocks = counted
        return d

    return make


def _plan(doc: dict[str, JSON], row: SweepRow) -> Plan:
    prio = _seq(_decode(doc["states"][0])["prio"])
    nlocal = int(row.consts["NLocal"])
    if row.consts["Offload"] != "none":
        prompts = finish_plan(doc, nlocal, row.requests, prompt_only_stores(row))
    else:
        prompts = prompt_plan(doc, nlocal, row.requests)
    return Plan(
        prompts,
        {r: int(p) for r, p in enumerate(prio, 1)},
    )


def conform_row(
    sweep: Sweep, row: SweepRow, work: Path, make_driver: DriverFactory = _vllm_blocks_driver
) -> LeaseConformance:
    """Replay every edge-covering trace of `row` (no waits: nothing here is timed)."""
    g = lease_graph(sweep, row, work / row.name)
    docs = edge_traces(g, row)
    (work / row.name / TRACES).write_text(json.dumps(docs) + "\n")
    return replay_row(row, docs, len(_edges(g)), make_driver)


def replay_row(
    row: SweepRow, docs: list[dict[str, JSON]], edges: int, make_driver: DriverFactory
) -> LeaseConformance:
    """conform_row's replay of a row's traces (`docs`, from `edges` edges) on a driver: one
    TLC run can serve several drivers (a shipped and a patched vLLM)."""
    res = LeaseConformance(row.name, edges, len(docs))
    step = max(1, -(-len(docs) // MAX_TRACES))
    for doc in docs[::step]:
        name = f"{row.name}/{doc['#meta']['trace']}"
        try:
            plan = _plan(doc, row)
        except DriverUnavailable as exc:  # this trace cannot be steered; the others can
            res.not_driven.append(f"{name}: {exc}")
            continue
        with make_driver(row, plan) as driver:
            got = replay_blocks(doc, driver)
        res.record(name, got.divergence)
    return res


def run_blocks_conform(sweep: Sweep, args: argparse.Namespace) -> int:
    caching = bool(args.prefix_caching)
    make = cached_blocks_driver if caching else _vllm_blocks_driver
    return run_conform_rows(
        sweep, args, lambda s, r, w: conform_row(s, r, w, make),
        "DecodeBlocks traces on vLLM's real decode scheduler"
        + (", prefix caching on" if caching else ""),
        why_not_driven,
    )  # fmt: skip


def replay_regression(
    path: Path, rows: dict[str, SweepRow], make_driver: DriverFactory = _vllm_blocks_driver
) -> BlocksReplay:
    """Replay one kept counterexample `<row>-<Property>.itf.json` on the real scheduler,
    driven as the row's (the design and pipeline depth the trace was found in)."""
    stem = path.name.removesuffix(".itf.json")
    name = next((n for n in sorted(rows, key=len, reverse=True) if stem.startswith(n + "-")), None)
    if name is None:
        raise ValueError(f"{path}: names no row of spec/blocks-matrix.toml; rename it <row>-<prop>")
    doc = json.loads(path.read_text())
    with make_driver(rows[name], _plan(doc, rows[name])) as driver:
        return replay_blocks(doc, driver)


def run_blocks_regressions(work: Path | None = None) -> Any:
    """The driven rows' traces on the installed (or mutated) vLLM, up to the first that
    does not replay: a kvspec.decode_traces.DecodeRun (the mutation campaign's verdict)."""
    import tempfile

    from kvspec.blocks import BLOCKS
    from kvspec.decode_traces import DecodeRun
    from kvspec.sweep import load_sweep_matrix

    with tempfile.TemporaryDirectory(prefix="kvspec-blocks-") as tmp:
        for row in load_sweep_matrix(BLOCKS):
            if row.tier != "fast" or why_not_driven(row) is not None:
                continue
            g = lease_graph(BLOCKS, row, (work or Path(tmp)) / row.name)
            for doc in edge_traces(g, row):
                name = f"{row.name}/{doc['#meta']['trace']}"
                try:
                    with _vllm_blocks_driver(row, _plan(doc, row)) as driver:
                        got = replay_blocks(doc, driver)
                except Exception as exc:  # vLLM raised out of an action: a crash
                    return DecodeRun(name, crash=f"{type(exc).__name__}: {exc}")
                if got.divergence is not None:
                    return DecodeRun(name, got.steps + 1, got.divergence)
    return DecodeRun()
