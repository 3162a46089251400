"""Mutation campaign: do the conformance traces catch small, named bugs in the real vLLM?

For each mutant (kvspec.mutations.catalogue), the campaign applies its base's impl patch,
then the mutant, replays the extension traces (conformance/extensions.toml: multi-request
and async-scheduling paths the one-request conformance traces cannot reach) and then the
base variant's conformance traces on the vLLM driver, then (on CPU) the LeaseClock
counterexamples of conformance/lease/ on the lease driver, stops at the first divergence,
and undoes both. A divergence or a crash of vLLM is a kill.

`kvspec mutants [--json FILE] [--only NAME] [--device cpu|cuda]` runs the campaign.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.decode_traces import DecodeRun, run_decode_regressions
from kvspec.drivers.base import WaitTimeout
from kvspec.drivers.vllm_env import check_device
from kvspec.drivers.vllm_logging import vllm_logs
from kvspec.extensions import extension_traces
from kvspec.itf import JSON
from kvspec.lease_replay import run_lease_regressions
from kvspec.mutations import Base, Mutant, patched
from kvspec.mutations.catalogue import MUTANTS
from kvspec.replay import INCORRECT, SpecTrace, load_trace, replay
from kvspec.traces import trace_files

DRIVER_COMPOSITIONS = ("nixl", "multi-nixl-hf3fs", "multi-nixl-offload-upstream")
# Per model, the shortest conformance traces only: traces are generated shortest-first to
# cover edges, and every kill seen so far came from within the first 15 of a model; the
# cap keeps an equivalent (surviving) mutant from replaying all ~1,700 traces.
MAX_TRACES_PER_MODEL = 25


def base_traces(variant: str) -> tuple[list[SpecTrace], list[str]]:
    """The extension traces, then the conformance traces of `variant` the vLLM driver can
    run (at most MAX_TRACES_PER_MODEL per model, shortest first, one model after the other:
    the driver pools one idle cluster, so interleaving models rebuilt a cluster for nearly
    every trace, 849 builds in 19 min of one campaign); and one reason line per skipped
    model."""
    found: dict[str, list[SpecTrace]] = defaultdict(list)
    for p in trace_files(variant):
        t = load_trace(p)
        found[t.row.name].append(t)
    per_model: list[list[SpecTrace]] = []
    skipped: list[str] = []
    for model, ts in sorted(found.items()):
        row = ts[0].row
        if row.composition not in DRIVER_COMPOSITIONS:
            skipped.append(f"{model}: composition {row.composition} not supported by the driver")
        elif row.topology.pp != 1:
            skipped.append(f"{model}: pp > 1 not supported by the driver")
        else:
            ts.sort(key=lambda t: (len(t.states), t.name))
            per_model.append(ts[:MAX_TRACES_PER_MODEL])
    return extension_traces(variant) + [t for group in per_model for t in group], skipped


@dataclass
class Outcome:
    mutant: Mutant
    killed: bool
    trace: str | None
    step: int | None
    failure_class: str | None
    seconds: float
    detail: str = ""

    def to_json(self) -> dict[str, JSON]:
        p = self.mutant.patch
        return {
            "name": p.name,
            "description": p.description,
            "target": p.target,
            "origin": p.origin,
            "base": self.mutant.base.name,
            "killed": self.killed,
            "trace": self.trace,
            "step": self.step,
            "failure_class": self.failure_class,
            "seconds": round(self.seconds, 3),
            "equivalent_because": self.mutant.equivalent_because,
            "detail": self.detail,
        }


INCONCLUSIVE = "inconclusive"


def run_traces(traces: list[SpecTrace], device: str = "cpu") -> tuple[str | None, Any, str]:
    """Replay until the first divergence: (trace name, Divergence | None, crash detail).
    A crash of the implementation (an exception other than MissingAction) is a kill. A wait
    that expired stops the run undecided: detail starts with INCONCLUSIVE, no divergence."""
    from kvspec.drivers.cluster_pool import shutdown_pool
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.drivers.vllm_env import DriverUnavailable

    for t in traces:
        try:
            driver = VllmDriver(t.row, device=device)
        except DriverUnavailable:
            continue
        except WaitTimeout as exc:  # a pooled cluster that did not reset: no verdict
            shutdown_pool()  # and the next mutant starts on fresh clusters
            return t.name, None, f"{INCONCLUSIVE}: setting up: {exc}"
        try:
            with driver:
                res = replay(driver, t)
        except Exception as exc:  # the mutant crashed vLLM: a kill; the cluster is suspect
            shutdown_pool()
            return t.name, None, f"{type(exc).__name__}: {exc}"
        if res.failure is not None:
            return t.name, res.failure, ""
        if res.timeout is not None:  # never a verdict: neither a kill nor a survival
            to = res.timeout
            why = f"{to.what} did not happen in {to.limit_s:g}s at step {to.step} ({to.action})"
            return t.name, None, f"{INCONCLUSIVE}: {why}"
    return None, None, ""


def run_mutant(
    mutant: Mutant, device: str = "cpu", traces: list[SpecTrace] | None = None
) -> Outcome:
    """Replay `traces` (default: base_traces of the mutant's base) under the mutant."""
    t0 = time.perf_counter()
    if traces is None and mutant.family == "producer":
        traces = base_traces(mutant.base.variant)[0]
    from kvspec.drivers.cluster_pool import discard_built_inside

    # Clusters are built lazily, under the mutant: its effect on set-up is part of what is
    # tested (pre-building every shape cost a minute per mutant even when the first trace
    # kills it), so they must not outlive it.
    with discard_built_inside(), patched(mutant.base, mutant.patch):
        if mutant.family == "decode":
            dec = run_decode_regressions(device, frozenset(mutant.decode_rows))
            return _decode_outcome(mutant, dec, t0)
        if mutant.family == "blocks":  # the decode scheduler's block frees (DecodeBlocks)
            from kvspec.blocks_traces import run_blocks_regressions

            return _decode_outcome(mutant, run_blocks_regressions(), t0)
        name, div, crash = run_traces(traces or [], device)
        if div is None and not crash and device == "cpu":
            lease = run_lease_regressions()
            if lease.trace is not None:
                name = lease.trace
                crash = lease.crash or (f"{INCONCLUSIVE}: {lease.timeout}" if lease.timeout else "")
                if lease.divergence:
                    secs = time.perf_counter() - t0
                    return Outcome(
                        mutant, True, name, lease.step, INCORRECT, secs, lease.divergence
                    )
        if div is None and not crash:
            dec = run_decode_regressions(device)
            if dec.trace is not None:
                return _decode_outcome(mutant, dec, t0)
    secs = time.perf_counter() - t0
    if crash.startswith(INCONCLUSIVE):
        return Outcome(mutant, False, name, None, INCONCLUSIVE, secs, crash)
    if crash:
        return Outcome(mutant, True, name, None, "crash", secs, crash)
    if div is None:
        return Outcome(mutant, False, None, None, None, secs)
    return Outcome(mutant, True, name, div.step, div.cls, secs, div.detail)


def _decode_outcome(mutant: Mutant, dec: DecodeRun, t0: float) -> Outcome:
    """The decode suite's verdict on `mutant`: a divergence or a crash kills it, a
    timeout is inconclusive, a clean run is a survival."""
    secs = time.perf_counter() - t0
    if dec.divergence is not None:
        return Outcome(mutant, True, dec.trace, dec.step, INCORRECT, secs, dec.divergence)
    if dec.crash is not None:
        return Outcome(mutant, True, dec.trace, None, "crash", secs, dec.crash)
    if dec.timeout is not None:
        return Outcome(mutant, False, dec.trace, None, INCONCLUSIVE, secs, dec.timeout)
    return Outcome(mutant, False, None, None, None, secs)


def unmutated(base: Base, device: str = "cpu") -> tuple[str | None, Any, str]:
    """The base without a mutant on the extension traces: must replay them all (no false
    kill). The conformance traces run unmutated in the conformance suite already."""
    with patched(base):
        return run_traces(extension_traces(base.variant), device)


def kill_rate(outcomes: list[Outcome]) -> float:
    return sum(o.killed for o in outcomes) / len(outcomes) if outcomes else 0.0


def _table(outcomes: list[Outcome]) -> None:
    from rich.console import Console
    from rich.table import Table

    tab = Table(title="kvspec mutants")
    for col in ("mutant", "base", "killed", "trace", "step", "class", "s"):
        tab.add_column(col)
    for o in outcomes:
        tab.add_row(
            o.mutant.name,
            o.mutant.base.name,
            "[green]killed[/]" if o.killed else "[red]survived[/]",
            o.trace or "-",
            "-" if o.step is None else str(o.step),
            o.failure_class or "-",
            f"{o.seconds:.1f}",
        )
    con = Console()
    con.print(tab)
    for o in outcomes:
        if not o.killed:
            why = o.mutant.equivalent_because or "no trace kills it (extend the suite)"
            con.print(f"survivor {o.mutant.name}: {why}")
    con.print(
        f"kill rate: {kill_rate(outcomes):.1%} ({sum(o.killed for o in outcomes)}/{len(outcomes)})"
    )


def run(args: argparse.Namespace) -> int:
    names = args.only or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        print(
            f"kvspec mutants: unknown mutant(s) {', '.join(unknown)}; known: {', '.join(MUTANTS)}",
            file=sys.stderr,
        )
        return 2
    with vllm_logs("mutants", args.verbose) as log:
        if log is not None:
            print(f"vLLM's log: {log}", file=sys.stderr)
        return _campaign(args, names)


def _campaign(args: argparse.Namespace, names: list[str]) -> int:
    try:
        check_device(args.device)
    except Exception as exc:  # DriverUnavailable, or vLLM/NIXL failing to import
        print(
            f"kvspec mutants: the vllm driver is unavailable on {args.device}: {exc}",
            file=sys.stderr,
        )
        return 2
    # base_traces reads a variant's traces: once per base variant, not per mutant.
    bases = {v: base_traces(v) for v in sorted({MUTANTS[n].base.variant for n in names})}
    skipped = sorted({s for _, why in bases.values() for s in why})
    for s in skipped:
        print(f"skipped {s}", file=sys.stderr)
    t0 = time.perf_counter()
    outcomes = [
        run_mutant(MUTANTS[n], args.device, bases[MUTANTS[n].base.variant][0]) for n in names
    ]
    _table(outcomes)
    print(f"total {time.perf_counter() - t0:.1f}s")
    if args.json:
        doc = {
            "mutants": [o.to_json() for o in outcomes],
            "kill_rate": kill_rate(outcomes),
            "skipped": skipped,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="mutant(s)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--verbose", action="store_true", help="vLLM's log on the terminal, not build/logs/"
    )
