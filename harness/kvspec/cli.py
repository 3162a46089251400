"""``kvspec`` command line: a registry of subcommands, each added by ``add_<name>_parser``.

Each ``add_*_parser`` registers its arguments and a handler; handlers import their
implementation module lazily so ``kvspec doctor`` never pays for vLLM imports.
Exit codes: 0 ok/holds, 1 violated/deadlock, 2 error/timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvspec.tlc import TLCResult

Handler = Callable[[argparse.Namespace], int]


def _err(msg: str) -> None:
    print(f"kvspec: {' '.join(msg.split())}", file=sys.stderr)


# ---------------------------------------------------------------- kvspec tlc


def add_tlc_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tlc", help="model-check one spec with TLC and summarise the result")
    p.add_argument("spec", type=Path, help="SPEC.tla")
    p.add_argument("--config", type=Path, help="TLC config (default: SPEC.cfg)")
    p.add_argument("--json", type=Path, dest="json_out", help="write the result as JSON here")
    p.add_argument("--itf", type=Path, help="write the counterexample as ITF JSON here")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--no-deadlock", action="store_true", help="do not check for deadlock")
    p.set_defaults(handler=_tlc_cmd)


def result_to_json(result: TLCResult) -> dict[str, Any]:
    """The JSON summary of a TLC run (values in ITF encoding)."""
    from kvspec.itf import value_to_itf

    cex = None
    if result.counterexample is not None:
        cex = [
            {
                "action": st.action,
                "location": st.action_location,
                "values": {k: value_to_itf(v) for k, v in sorted(st.values.items())},
            }
            for st in result.counterexample.states
        ]
    trace = result.counterexample
    return {
        "verdict": result.verdict,
        "property": result.violated_property,
        "counterexample": cex,
        "loop_index": trace.loop_index if trace else None,
        "stuttering": trace.stuttering if trace else False,
        "distinct_states": result.distinct_states,
        "generated_states": result.generated_states,
        "seconds": round(result.seconds, 3),
        "tlc_version": result.tlc_version,
        "log_path": str(result.log_path),
        "exit_code": result.exit_code,
        "error": result.error,
    }


def _tlc_cmd(args: argparse.Namespace) -> int:
    from kvspec.itf import dumps, trace_to_itf
    from kvspec.tlc import run_tlc

    if not args.spec.is_file():
        _err(f"no such spec: {args.spec}")
        return 2
    result = run_tlc(args.spec, args.config, timeout_s=args.timeout, deadlock=not args.no_deadlock)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(dumps(result_to_json(result)))
    if args.itf and result.counterexample is not None:
        args.itf.parent.mkdir(parents=True, exist_ok=True)
        args.itf.write_text(dumps(trace_to_itf(result.counterexample, source=str(args.spec))))
    counts = f"{result.distinct_states} distinct states, {result.seconds:.1f}s"
    if result.verdict == "holds":
        print(f"{args.spec}: holds ({counts})")
        return 0
    if result.verdict in ("violated", "deadlock"):
        what = result.violated_property or result.verdict
        n = len(result.counterexample.states) if result.counterexample else 0
        print(f"{args.spec}: {result.verdict}: {what} ({n}-state counterexample, {counts})")
        if result.error:  # violated, but the counterexample could not be parsed
            _err(result.error)
        return 1
    _err(result.error or f"TLC {result.verdict}; raw log: {result.log_path}")
    return 2


# ---------------------------------------------------------------- kvspec doctor


def add_doctor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor", help="java, TLC, python, torch, vllm, nixl, UCX, device; which drivers run"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--jar-only", action="store_true", help="only verify/install the TLC jar")
    p.add_argument(
        "--require",
        metavar="DRIVER",
        action="append",
        default=[],
        help="exit 1 unless DRIVER (e.g. vllm-cuda) runs here; repeatable",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="import vLLM as the driver does (version adapters, device): 'runs' only if it can",
    )
    p.set_defaults(handler=_doctor_cmd)


def _doctor_cmd(args: argparse.Namespace) -> int:
    from kvspec.jar import JAR_SHA256, JarError, jar_path

    report: dict[str, Any] = {"python": platform.python_version(), "ok": True}
    try:
        report["tla2tools_jar"] = str(jar_path())
        report["tla2tools_sha256"] = JAR_SHA256
    except JarError as exc:
        report["ok"] = False
        report["tla2tools_error"] = str(exc)
    if args.jar_only:
        if not report["ok"]:
            _err(report["tla2tools_error"])
            return 2
        print(f"tla2tools.jar ok: {report['tla2tools_jar']}")
        return 0
    from kvspec.doctor import doctor_report, format_report

    full = {**report, **doctor_report()}
    full["ok"] = report["ok"] and "version" in full.get("java", {})
    if args.probe:
        from kvspec.doctor import probe_driver
        from kvspec.drivers.vllm_adapters import installed_version

        for name, d in full["drivers"].items():
            if name.startswith("vllm-") and d.get("runs"):
                why = probe_driver(name.removeprefix("vllm-"))
                if why is not None:
                    d.update(runs=False, why=f"probe: {why}")
        if full.get("vllm"):  # the one Python imports, which a second install may shadow
            full["vllm"] = f"{full['vllm']}; imports {installed_version()}"
    if args.json:
        print(json.dumps(full, sort_keys=True, indent=2))
    else:
        print(format_report(full))
    if not full["ok"] and not args.require:
        return 2
    # --require asks about drivers alone: java and the jar serve TLC, which a GPU machine
    # running only the drivers (bench/gpu_check.sh) need not have (it printed exit 2 there).
    drivers: dict[str, dict[str, Any]] = full["drivers"]
    for name in args.require:
        if name not in drivers:
            _err(f"doctor --require {name}: no such driver; known: {', '.join(sorted(drivers))}")
            return 2
        if not drivers[name]["runs"]:
            # A GPU job must stop here, not skip its way to green.
            _err(f"doctor --require {name}: cannot run here: {drivers[name]['why']}")
            return 1
    return 0


# ---------------------------------------------------------------- kvspec review


def add_review_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "review", help="run check (and conform where vLLM is installed), write report/"
    )
    p.add_argument("--out", type=Path, default=Path("report"), help="report dir (report/)")
    p.add_argument("--matrix", type=Path, help="matrix TOML (default spec/matrix.toml)")
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="model(s)")
    p.add_argument("--check-json", type=Path, default=Path("build/check/results.json"))
    p.add_argument("--reuse-check", action="store_true", help="read --check-json, skip TLC")
    p.add_argument("--conform-json", type=Path, default=Path("build/conform.json"))
    p.add_argument("--reuse-conform", action="store_true", help="read --conform-json if present")
    p.add_argument("--no-conform", action="store_true", help="skip the conformance stage")
    p.add_argument("--device", default="cpu", help="conformance device: cpu or cuda")
    p.add_argument("--traces-json", type=Path, default=Path("build/traces.json"))
    p.add_argument("--mutants-json", type=Path, default=Path("build/mutants.json"))
    p.add_argument("--lease-json", type=Path, default=Path("build/lease.json"))
    p.add_argument("--decode-json", type=Path, default=Path("build/decode.json"))
    p.add_argument("--clock-json", type=Path, default=Path("build/clock.json"))
    p.add_argument("--blocks-json", type=Path, default=Path("build/blocks.json"))
    p.add_argument("--offload-json", type=Path, default=Path("build/offload-probe.json"))
    p.add_argument(
        "--versions-json",
        type=Path,
        default=Path("build/versions.json"),
        help="`make versions` results (the report's release table)",
    )
    p.add_argument("--decode-dir", type=Path, default=Path("build/decode"),
                   help="kvspec decode --out: its counterexamples")  # fmt: skip
    p.add_argument(
        "--verbose", action="store_true", help="vLLM's log on the terminal, not build/logs/"
    )
    p.set_defaults(handler=_review_cmd)


def _review_cmd(args: argparse.Namespace) -> int:
    from kvspec.review import run_review

    return run_review(args)


# ---------------------------------------------------------------- registry
# A subcommand plugs in here: write add_<name>_parser(sub) (lazy imports inside the
# handler) and append it to PARSERS.


def add_check_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvspec.check import add_check_parser as add

    add(sub)


def _stage_parser(name: str, help_text: str, module_name: str = "") -> Callable[[Any], None]:
    """A subcommand whose module `kvspec.<module_name or name>` provides add_arguments(p)
    and run(args).

    The module is imported only when the subcommand runs or its parser is built, so
    `kvspec --help` does not pay for vLLM or TLC imports.
    """
    import importlib

    def add(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        p = sub.add_parser(name, help=help_text)
        module = importlib.import_module(f"kvspec.{module_name or name}")
        module.add_arguments(p)

        def handler(args: argparse.Namespace) -> int:
            result: int = module.run(args)
            return result

        p.set_defaults(handler=handler)

    return add


add_traces_parser = _stage_parser(
    "traces", "conformance traces covering every spec edge", "traces_cmd"
)
add_conform_parser = _stage_parser("conform", "replay traces on a driver: which variants conform")
add_mutants_parser = _stage_parser("mutants", "mutation campaign against the installed vLLM")
add_lease_parser = _stage_parser("lease", "the lease-clock sweep (spec/LeaseClock.tla)")
add_clock_parser = _stage_parser(
    "clock", "the producer engine against a lease clock (spec/KVClock.tla)"
)
add_decode_parser = _stage_parser("decode", "the decode-side round trip (spec/Decode.tla)")
add_blocks_parser = _stage_parser(
    "blocks", "a decode engine's KV blocks under async scheduling (spec/DecodeBlocks.tla)"
)
add_validate_parser = _stage_parser(
    "validate", "is a recorded real run (kvspec record) a behaviour of the spec, per design"
)
add_versions_parser = _stage_parser(
    "versions", "conform every supported vLLM release (one layered venv each)"
)
add_record_parser = _stage_parser(
    "record", "how to record a real engine's connector calls", "record_cmd"
)
add_scenario_parser = _stage_parser(
    "scenario", "run real vLLM engines, record, validate, check the end state"
)
add_bugs_parser = _stage_parser(
    "bugs", "the public completion bugs and what in kvspec catches each (spec/bugs.toml)"
)


PARSERS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_tlc_parser,
    add_doctor_parser,
    add_check_parser,
    add_traces_parser,
    add_conform_parser,
    add_review_parser,
    add_mutants_parser,
    add_lease_parser,
    add_clock_parser,
    add_decode_parser,
    add_blocks_parser,
    add_validate_parser,
    add_record_parser,
    add_scenario_parser,
    add_versions_parser,
    add_bugs_parser,
]


def build_parser() -> argparse.ArgumentParser:
    from kvspec import __version__

    parser = argparse.ArgumentParser(prog="kvspec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvspec {__version__}")
    parser.add_argument(
        "--vllm-src",
        type=Path,
        default=os.environ.get("KVSPEC_VLLM_SRC") or None,
        metavar="PATH",
        help="run against the vLLM source checkout at PATH (env KVSPEC_VLLM_SRC); an "
        "editable install needs nothing",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in PARSERS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.vllm_src is not None:
        from kvspec.vllm_source import SourceError, use_source

        try:
            use_source(args.vllm_src)
        except SourceError as exc:
            print(f"kvspec: {exc}", file=sys.stderr)
            return 2
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
