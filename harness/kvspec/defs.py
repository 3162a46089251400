"""The spec's definitions derived from a row's constants (W, Expected, RankMode,
PipelineDepth, ReadSources, ...), computed once per row: KVCompletion.tla's operators over
CONSTANTS only, as Python."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvspec.matrix import ModelRow
from kvspec.vocab import RankResult, State, Step

RankStepFn = Callable[["Defs", State, int, Step], RankResult]

# Composition names (KVCompletion.tla's Compositions).
HF3FS = "multi-nixl-hf3fs"
OFFLOAD = "multi-nixl-offload-upstream"


def sharded(row: ModelRow) -> bool:
    """Sharded: PCP + DCP mode, every PCP rank a transfer rank (base_worker.py:667-672)."""
    return row.topology.pcp > 1 and row.dcp > 1


def rank_mode(row: ModelRow, w: int) -> str:
    """RankMode(w): what rank w's NIXL worker does with reqs_to_send."""
    pcp = row.topology.rank_coords(w).pcp
    if pcp == 0 or sharded(row) or row.variant == "naive-replicas":
        return "serve"
    if row.transfer == "push":
        return "silent"
    if row.variant == "v0.29":
        return "silent"
    if row.variant == "v0.30-shipped":
        return "queue-cleared"
    return "queue"


def expected_count(row: ModelRow) -> int:
    """Expected: nixl get_finished_count is TP x PP in 0.29, None (0) since; a
    MultiConnector's is None; the aggregator then waits for world_size reports."""
    t = row.topology
    nixl = t.tp * t.pp if row.variant == "v0.29" else 0
    finished = nixl if row.composition == "nixl" else 0
    return t.world_size if finished == 0 else finished


def pipeline_depth(row: ModelRow) -> int:
    """PipelineDepth: config/vllm.py max_concurrent_batches (PP; async: PP + 1 on the V2
    runner, 2 on V1 at PP = 1)."""
    pp = row.topology.pp
    if not row.async_scheduling:
        return pp
    if row.runner == "v2":
        return pp + 1
    return 2 if pp <= 1 else pp


def read_sources(row: ModelRow) -> frozenset[int]:
    """ReadSources: PCP rank 0, the last publisher of a (tp, pp) key (naive replicas), or
    every rank (sharded)."""
    t = row.topology
    if sharded(row):
        return frozenset(range(t.world_size))
    want = t.pcp - 1 if row.variant == "naive-replicas" else 0
    return frozenset(w for w in range(t.world_size) if t.rank_coords(w).pcp == want)


@dataclass(frozen=True)
class Defs:
    """A row's derived definitions. `rank_step` and `expected` are the two hooks negative
    controls bend (kvspec.drivers.broken)."""

    row: ModelRow
    w: int
    reqs: range
    multi: bool
    delaying: bool
    offload: bool
    early_break: bool
    push: bool
    guarded: bool  # Timing = "guarded": KVCompletion.tla's two timing guards apply
    expected: int
    depth: int
    modes: tuple[str, ...]
    read_sources: frozenset[int]
    rank_step: RankStepFn = field(compare=False)

    @staticmethod
    def of(row: ModelRow, rank_step_fn: RankStepFn | None = None) -> Defs:
        if rank_step_fn is None:
            # The spec's RankStep lives with the other actions in kvspec.model, which
            # imports this module: import it at call time.
            from kvspec.model import rank_step

            rank_step_fn = rank_step
        w = row.topology.world_size
        return Defs(
            row=row,
            w=w,
            reqs=range(1, row.requests + 1),
            multi=row.composition != "nixl",
            delaying=row.composition == HF3FS,
            offload=row.composition == OFFLOAD,
            early_break=row.reaper == "early-break",
            push=row.transfer == "push",
            guarded=row.timing == "guarded",
            expected=expected_count(row),
            depth=pipeline_depth(row),
            modes=tuple(rank_mode(row, x) for x in range(w)),
            read_sources=read_sources(row),
            rank_step=rank_step_fn,
        )

    @property
    def ranks(self) -> range:
        return range(self.w)
