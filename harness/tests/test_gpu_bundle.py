"""bench/gpu_bundle.py's packing rules, on a fake wheel (no download): every kernel extension
becomes an empty module of its name, the capability queries answer "unsupported", vLLM's
own Python under third_party/ stays (its pynvml picks the CUDA platform) and the rest of
what the drivers never import goes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_bundle.py"


def _bundle() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_bundle", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_kernels_become_empty_modules_and_third_party_python_stays(tmp_path: Path) -> None:
    gb = _bundle()
    wheel = tmp_path / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name in ("vllm/__init__.py", "vllm/_C_stable_libtorch.abi3.so",
                     "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm_flash_attn/x.py",
                     "vllm/third_party/pynvml.py", "vllm/third_party/deep_gemm/a.hpp",
                     "vllm/vllm-rs", "vllm/x/static/ui.js", "vllm/doc.jpg",
                     "vllm-0.32.0.dist-info/METADATA", "vllm-0.32.0.dist-info/RECORD"):
            z.writestr(name, "x")
    got = {name: data for name, data, _mode in gb.vllm_members(wheel)}
    assert set(got) == {
        "vllm/__init__.py", "vllm/_C_stable_libtorch.py", "vllm/vllm_flash_attn/_vllm_fa2_C.py",
        "vllm/vllm_flash_attn/x.py", "vllm/third_party/pynvml.py",
        "vllm-0.32.0.dist-info/METADATA",
    }  # fmt: skip
    # Only the module platforms/cuda.py imports first registers the capability queries.
    assert b"torch.library" in got["vllm/_C_stable_libtorch.py"]
    assert b"torch.library" not in got["vllm/vllm_flash_attn/_vllm_fa2_C.py"]


def test_the_capability_queries_answer_unsupported() -> None:
    gb = _bundle()
    probe = (
        "import torch\n"
        "try:\n"
        "    torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90)\n"
        "except (AttributeError, RuntimeError):\n"
        "    print('missing')\n"  # the negative control: no such op without the stub
        + gb.QUERY_STUB
        + "print(torch.ops._C.cutlass_scaled_mm_supports_block_fp8(90))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()  # fmt: skip
    assert out == ["missing", "False"]


def test_the_offloading_copy_op_is_registered_with_the_signature_vllm_calls() -> None:
    # _custom_ops.swap_blocks_batch calls torch.ops._C_cache_ops.swap_blocks_batch(src, dst,
    # sizes, is_src_access_order_any) positionally; an empty batch copies nothing, so no CUDA
    # runtime is needed to check the schema here.
    gb = _bundle()
    probe = (
        "import torch\n"
        "e = torch.zeros(0, dtype=torch.int64)\n"
        "try:\n"
        "    torch.ops._C_cache_ops.swap_blocks_batch(e, e, e, False)\n"
        "except (AttributeError, RuntimeError):\n"
        "    print('missing')\n"  # the negative control: no such op without the stub
        + gb.QUERY_STUB
        + gb.COPY_STUB
        + "print(torch.ops._C_cache_ops.swap_blocks_batch(e, e, e, False))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()  # fmt: skip
    assert out == ["missing", "None"]
