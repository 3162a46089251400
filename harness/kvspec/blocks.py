"""`kvspec blocks`: a decode engine's KV blocks under asynchronous scheduling
(spec/DecodeBlocks.tla, issue #14: preemption; vLLM #45357) over spec/blocks-matrix.toml.
When may a finished or preempted request's blocks go back to the pool while a step that
writes them is in flight and a READ may fill them for the next request? TLC decides the
invariants (one run, -continue) and the liveness property (a second run); the machinery is
kvspec.sweep's.

The offload child (Offload: MultiConnector(NIXL, OffloadingConnector) on D, vLLM #46951)
asks the same of its store jobs: may a READ fill a block a finished request's store still
reads?

`kvspec blocks [--tier fast|full] [--only NAME] [--json F] [--out DIR]`; exit 1 when a
verdict differs from its expectation or TLC did not decide it, 2 on a bad matrix.
`kvspec blocks --conform` replays the rows' edge-covering traces on the installed vLLM's
decode scheduler (kvspec.blocks_traces): which design it implements; `--prefix-caching`
with vLLM's default prefix caching on.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvspec.sweep import Const, Sweep, conform_command

REPO = Path(__file__).resolve().parents[2]
BLOCKS = Sweep(
    command="blocks",
    spec=REPO / "spec" / "DecodeBlocks.tla",
    matrix=REPO / "spec" / "blocks-matrix.toml",
    consts=(
        Const("NLocal", "n_local", "int"),
        Const("NBlocks", "blocks", "int"),
        Const("Batches", "batches", "int"),
        Const("Grow", "grow", "bool"),
        Const("Stop", "stop", "bool"),
        Const("Policy", "policy", "str", ("fcfs", "priority")),
        Const("Design", "design", "str", ("defer", "at-once")),
        Const("Stagger", "stagger", "int"),
        Const("SelfPreempt", "self_preempt", "str", ("stop", "continue")),
        Const("Offload", "offload", "str", ("none", "fence-scheduled", "fence-all")),
    ),
    invariants=("NoStaleWriteUnderRead", "BlocksAccounted", "NoStoreOfReusedBlock"),
    reach=("ReachReuseByRead", "ReachPreempt", "ReachStoreReuse", "ReachFlush"),
    liveness=("DeferredReturn",),
    columns=("NLocal", "NBlocks", "Batches", "Grow", "Stop", "Policy", "Design", "Stagger",
             "Offload"),
    title="decode blocks under async scheduling (spec/DecodeBlocks.tla)",
    max_requests=3,
)


_add_arguments, _run = conform_command(
    BLOCKS, "replay every row's edge-covering traces on the installed vLLM's decode scheduler",
    "kvspec.blocks_traces:run_blocks_conform",
)  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_arguments(p)
    caching = "--conform: D's scheduler runs vLLM's default, prefix caching on"
    p.add_argument("--prefix-caching", action="store_true", help=caching)
    probe = ("drive the offload child's race step (#46951) on the installed vLLM's real "
             "MultiConnector(NIXL, OffloadingConnector) and say which Offload design it is")
    p.add_argument("--offload-probe", action="store_true", help=probe)


def run(args: argparse.Namespace) -> int:
    if not args.offload_probe:
        return _run(args)
    from kvspec.offload_probe import run_offload_probe

    return run_offload_probe(args)
