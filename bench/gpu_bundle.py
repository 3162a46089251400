"""Build the GPU bundle: what bench/gpu_check.sh --bundle installs on a GPU machine that has a
CUDA torch but no package registry and takes at most 64 MiB per call (the device tool here).

    python bench/gpu_bundle.py [--out .gpu] [--cache build/gpu-wheels]

Why a bundle and not the wheels: vLLM 0.32's CUDA wheel is 327 MB (657 MB of compiled
kernels, built for torch 2.13, while such an image ships its own CUDA torch), NIXL's CUDA 13
wheel 59 MB. The conformance drivers never run a model, so the bundle carries:
  vllm-py.tar.xz  vLLM's Python and metadata from the CUDA wheel, no compiled kernels: an
                  empty module stands in for each extension (platforms/cuda.py:23 imports
                  vllm._C_stable_libtorch at module level, vllm_flash_attn raises ImportError
                  without _vllm_fa2_C/_vllm_fa3_C), so the CUDA platform, the scheduler, the
                  connectors and the NIXL worker are vLLM's own code;
  nixl.tar.xz     NIXL's CUDA 13 build with only the UCX and POSIX plugins and the shared
                  libraries they load (ldd closure; the EP kernels and the cloud plugins out);
  wheels/         the pure-Python/abi3 dependencies the vLLM driver imports that the image
                  lacks (requirements/gpu-bundle.txt).
Deterministic: sorted members, fixed mtimes, owner 0.
"""

from __future__ import annotations

import argparse
import io
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQS = ROOT / "requirements" / "gpu-bundle.txt"
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in (17, 24, 26, 27, 28, 31, 34, 35))
PIP_TIMEOUT_S = 900
LDD_TIMEOUT_S = 60
KERNEL_STUB = '''"""kvspec GPU bundle: vLLM's CUDA kernels are left out (bench/gpu_bundle.py).

vLLM imports its kernel extensions at module level to register their ops
(platforms/cuda.py: vllm._C_stable_libtorch; vllm_flash_attn: _vllm_fa2_C / _vllm_fa3_C);
the conformance drivers build schedulers, connectors and NIXL workers but never run a
model, so no op of them is called. A driver path that needs one fails with AttributeError on
torch.ops, which the suite reports as an error, never as a verdict.
"""
'''
# vLLM evaluates some capability queries of its kernels at import (w8a8_utils.py:
# CUTLASS_BLOCK_FP8_SUPPORTED = cutlass_block_fp8_supported()); without the kernels the
# honest answer is "unsupported", registered under the kernels' own op names.
CAPABILITY_QUERIES = (
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
)
QUERY_STUB = f"""
import torch

_lib = torch.library.Library("_C", "FRAGMENT")
for _name in {CAPABILITY_QUERIES!r}:
    _lib.define(f"{{_name}}(int cuda_device_capability) -> bool")
    _lib.impl(_name, lambda cuda_device_capability: False, "CompositeExplicitAutograd")
"""
# The one kernel a driver path calls: the stock CPU offloading worker's GPU<->host copy
# (_custom_ops.swap_blocks_batch: "src_ptrs[i] -> dst_ptrs[i] of sizes[i] bytes ... on older
# CUDA it falls back to a loop of cudaMemcpyAsync"). That fallback, on the caller's current
# stream (the handler's transfer stream, gpu_worker.py: `with current_platform.stream`), through
# the CUDA runtime torch already loaded (vLLM's own CudaRTLibrary finds it). Ordering and
# completion stay the stream's and its events': what the offloading worker's reports rest on.
COPY_STUB = """
import ctypes

_cache = torch.library.Library("_C_cache_ops", "FRAGMENT")
_cache.define("swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
              "bool is_src_access_order_any=False) -> ()")
_memcpy = []


def _memcpy_async():
    if not _memcpy:
        from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

        fn = CudaRTLibrary().lib.cudaMemcpyAsync
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                       ctypes.c_void_p]
        _memcpy.append(fn)
    return _memcpy[0]


def _swap_blocks_batch(src_ptrs, dst_ptrs, sizes, is_src_access_order_any=False):
    triples = list(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))
    if not triples:
        return
    stream = torch.cuda.current_stream().cuda_stream
    for src, dst, n in triples:
        rc = _memcpy_async()(dst, src, n, 4, stream)  # 4: cudaMemcpyDefault (UVA)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {rc}")


_cache.impl("swap_blocks_batch", _swap_blocks_batch, "CompositeExplicitAutograd")
"""
# Parts of the vLLM wheel the drivers never import: model-kernel sources, the web UI, Rust.
# Their Python stays: vLLM imports its own pynvml from third_party/ to pick the CUDA platform.
VLLM_SKIP = re.compile(
    r"^vllm/(third_party|vllm_flash_attn)/.*(?<!\.py)$|^vllm/vllm-rs$|/static/|/configs/.*\.json$"
    r"|\.(jpg|png)$"
)
# NIXL parts no pull-mode KV transfer loads: expert-parallel kernels, tools, cloud plugins.
NIXL_SKIP = re.compile(r"^(nixl_ep[^/]*|nixl_cu13\.scripts|nixl_cu13-[^/]*\.data)/|ucx_perftest")
NIXL_PLUGINS_KEPT = ("UCX", "POSIX")


def download(cache: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(cache), "-r", str(REQS)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd, check=True, timeout=PIP_TIMEOUT_S)


def _info(name: str, size: int, mode: int = 0o644) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size, ti.mode, ti.mtime, ti.uid, ti.gid = size, mode, 0, 0, 0
    return ti


def write_tar_xz(out: Path, members: Iterable[tuple[str, bytes, int]]) -> None:
    with lzma.open(out, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, data, mode in sorted(members):
            tar.addfile(_info(name, len(data), mode), io.BytesIO(data))


def vllm_members(wheel: Path) -> list[tuple[str, bytes, int]]:
    out = []
    with zipfile.ZipFile(wheel) as z:
        for zi in z.infolist():
            n = zi.filename
            if n.endswith(".so"):  # a kernel extension: an empty module of its name
                head, _, leaf = n.rpartition("/")
                mod = f"{head}/{leaf.split('.')[0]}.py"
                stub = QUERY_STUB + COPY_STUB if mod == "vllm/_C_stable_libtorch.py" else ""
                text = KERNEL_STUB + stub
                out.append((mod, text.encode(), 0o644))
            elif not (zi.is_dir() or VLLM_SKIP.search(n) or n.endswith("/RECORD")):
                out.append((n, z.read(zi), 0o644))
    return out


def _ldd_closure(files: list[Path], libdirs: list[Path]) -> set[str]:
    """Basenames of the bundled libraries `files` load, transitively (ldd resolves them)."""
    env = {"LD_LIBRARY_PATH": ":".join(map(str, libdirs)), "PATH": "/usr/bin:/bin"}
    seen: set[str] = set()
    for f in files:
        res = subprocess.run(["ldd", str(f)], capture_output=True, text=True, env=env,
                             timeout=LDD_TIMEOUT_S, check=False)
        for line in res.stdout.splitlines():
            m = re.search(r"=> (\S+)", line)
            lib = Path(m.group(1)).resolve() if m else None  # RPATHs say $ORIGIN/../
            if lib is not None and any(lib.is_relative_to(d) for d in libdirs):
                seen.add(lib.name)
    return seen


def nixl_members(cu_wheel: Path, front_wheel: Path, work: Path) -> list[tuple[str, bytes, int]]:
    work = work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    for w in (cu_wheel, front_wheel):
        with zipfile.ZipFile(w) as z:
            z.extractall(work)
    files = [p for p in work.rglob("*") if p.is_file()]
    keep = [p for p in files if not NIXL_SKIP.search(p.relative_to(work).as_posix())]
    plugin = [p for p in keep if p.name.startswith("libplugin_")]
    keep = [p for p in keep if p not in plugin or any(k in p.name for k in NIXL_PLUGINS_KEPT)]
    libs = (work / "nixl_cu13.libs").resolve()
    roots = [p for p in keep if ".so" in p.name and not p.parent == libs]
    needed = _ldd_closure(roots, [libs, libs / "ucx"])
    keep = [p for p in keep if p.parent != libs or p.name in needed]
    return [(p.relative_to(work).as_posix(), p.read_bytes(), 0o755 if ".so" in p.name else 0o644)
            for p in keep]


def one(cache: Path, pattern: str) -> Path:
    (hit,) = sorted(cache.glob(pattern))
    return hit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".gpu")
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "gpu-wheels")
    a = p.parse_args()
    a.cache.mkdir(parents=True, exist_ok=True)
    download(a.cache)
    shutil.rmtree(a.out, ignore_errors=True)
    (a.out / "wheels").mkdir(parents=True)
    write_tar_xz(a.out / "vllm-py.tar.xz", vllm_members(one(a.cache, "vllm-*.whl")))
    nixl = nixl_members(one(a.cache, "nixl_cu13-*.whl"), one(a.cache, "nixl-*-none-any.whl"),
                        ROOT / "build" / "gpu-nixl")
    write_tar_xz(a.out / "nixl.tar.xz", nixl)
    skip = ("vllm-", "nixl-", "nixl_cu13-")
    for w in sorted(a.cache.glob("*.whl")):
        if not w.name.startswith(skip):
            shutil.copy2(w, a.out / "wheels" / w.name)
    total = sum(f.stat().st_size for f in a.out.rglob("*") if f.is_file())
    for f in sorted(a.out.glob("*.tar.xz")):
        print(f"{f.name:16} {f.stat().st_size / 2**20:6.1f} MiB")
    print(f"{'wheels/':16} {sum(1 for _ in (a.out / 'wheels').iterdir()):6d} files")
    print(f"{'total':16} {total / 2**20:6.1f} MiB (the device tool carries 64 MiB per call)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
