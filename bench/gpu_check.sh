#!/usr/bin/env bash
# GPU conformance check, run end to end on a GPU machine (cannot run on the CPU-only CI).
#   bash bench/gpu_check.sh WHEEL_DIR [OUT_DIR]      a runner with staged wheels: vLLM's CUDA
#                                                   wheel, nixl-cu12, nixl, their dependencies
#   bash bench/gpu_check.sh --bundle DIR [OUT_DIR]   a machine with a CUDA torch and no package
#                                                   registry: bench/gpu_bundle.py's bundle
#                                                   (vLLM's Python without its kernels)
# OUT_DIR (default $OUT, else ./out) receives gpu_check.log, doctor.json, conform-cuda.json,
# junit-cuda-verdicts.xml and vllm-cuda.log.gz: seven files at most, so that a device tool
# that brings back eight can bring them all. Exit status: `kvspec conform`'s, else the
# verdict tests'. GPU_PER_MODEL (default 3) traces of each model are replayed;
# GPU_TESTS_TIMEOUT_S and GPU_CONFORM_TIMEOUT_S bound the two stages (600 s, 1800 s).
set -euo pipefail
MODE=wheels
if [ "${1:-}" = "--bundle" ]; then MODE=bundle; shift; fi
SRC=${1:?usage: gpu_check.sh WHEEL_DIR|--bundle DIR [OUT_DIR]}
OUT_DIR=${2:-${OUT:-$PWD/out}}
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WORK=${GPU_WORK:-${TMPDIR:-/tmp}/kvspec-gpu}  # never under OUT_DIR: only results go back
PER_MODEL=${GPU_PER_MODEL:-3}
TESTS_S=${GPU_TESTS_TIMEOUT_S:-600}  # outer bounds: a device tool's lease may be shorter
CONFORM_S=${GPU_CONFORM_TIMEOUT_S:-1800}
echo "== $(date -u +%FT%TZ) gpu_check ($MODE): $SRC -> $OUT_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
rm -rf "$WORK" && mkdir -p "$WORK/bin"
if [ "$MODE" = wheels ]; then
  "$PY" -m venv --system-site-packages "$WORK/venv"
  # shellcheck disable=SC1091
  source "$WORK/venv/bin/activate"
  # As the CPU install (Makefile): the CUDA 12 NIXL build, then the `nixl` front package
  # without its dependencies (it would pick a build by itself).
  pip install --no-index --find-links "$SRC" vllm nixl-cu12 2>&1 | tail -5
  pip install --no-index --find-links "$SRC" --no-deps nixl 2>&1 | tail -2
  pip install --no-index --find-links "$SRC" --no-build-isolation -e "$ROOT" 2>&1 | tail -2 || \
    pip install --no-deps --no-build-isolation -e "$ROOT"
  PY=python
else
  # The image's own python and CUDA torch; the bundle beside them on PYTHONPATH.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
    "$SRC"/wheels/*.whl
  tar -xJf "$SRC/vllm-py.tar.xz" -C "$WORK/site"
  tar -xJf "$SRC/nixl.tar.xz" -C "$WORK/site"
  export PYTHONPATH="$WORK/site:$ROOT/harness${PYTHONPATH:+:$PYTHONPATH}"
  printf '#!/bin/sh\nexec %s -m kvspec.cli "$@"\n' "$PY" > "$WORK/bin/kvspec"
  chmod +x "$WORK/bin/kvspec"
  export PATH="$WORK/bin:$PATH"
fi
"$PY" - <<'PY' > "$OUT_DIR/doctor.json"
import json
from kvspec.doctor import doctor_report
print(json.dumps(doctor_report(), indent=2))
PY
"$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
"$PY" - <<'PY' || { echo "== the vllm driver cannot run on cuda here: stop"; exit 3; }
import sys
from kvspec.doctor import probe_driver
from vllm.platforms import current_platform
print("vLLM platform:", type(current_platform).__name__, current_platform.device_type)
why = probe_driver("cuda")
print("vllm driver on cuda:", why or "runs")
sys.exit(1 if why else 0)
PY
set +e
kvspec doctor --require vllm-cuda  # the reason, if CUDA cannot run; the steps below say more
echo "== doctor exit $?"
# VRAM registration and a READ on the GPU, then the design verdicts (stall replayed;
# fix-53903 follows `fixed`) on VRAM caches. Every device wait is bounded (WAIT_TIMEOUT_S);
# the outer timeouts only guard a wedged GPU.
(cd "$ROOT" && timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider \
  conformance/test_vllm_device.py conformance/test_vllm_verdicts.py --device cuda \
  -rs --junitxml="$OUT_DIR/junit-cuda-verdicts.xml")
vrc=$?
echo "== verdict tests exit $vrc"
# An even sample of each model's traces (kvspec.traces.sample_per_model, as `make test`) and
# every committed regression, replayed on VRAM caches: which designs the CUDA build follows.
"$PY" - "$WORK/traces" "$PER_MODEL" <<'PY'
import shutil, sys
from pathlib import Path
from kvspec.traces import sample_per_model, trace_files
from kvspec.tracestore import GENERATED, REGRESSIONS
out, n = Path(sys.argv[1]), int(sys.argv[2])
picked = sample_per_model(trace_files(), n)
for p in picked:
    root = GENERATED if p.is_relative_to(GENERATED) else REGRESSIONS
    dst = out / p.relative_to(root)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(p, dst)
print(f"== {len(picked)} traces sampled into {out}")
PY
timeout "$CONFORM_S" kvspec conform --driver vllm --device cuda --traces "$WORK/traces" \
  --json "$OUT_DIR/conform-cuda.json"
rc=$?
echo "== kvspec conform exit $rc"
if [ "$MODE" = wheels ]; then
  # Real engines on the GPU, recorded and validated against the spec (issue #16); written
  # without a GPU to try them on: their result is reported, not gating. The bundle carries
  # no model kernels, so no engine runs there.
  timeout 1800 "$PY" "$ROOT/bench/e2e.py" gpu-pd-basic gpu-offload \
    --out "$WORK/scenario" --json "$OUT_DIR/scenario-cuda.json"
  echo "== scenarios exit $?"
else
  echo "== scenarios skipped: the bundle carries no model kernels (bench/gpu_bundle.py)"
fi
set -e
cat "$ROOT"/build/logs/*.log 2>/dev/null | gzip -9 > "$OUT_DIR/vllm-cuda.log.gz" || true
[ "$rc" -ne 0 ] || rc=$vrc
if [ ! -s "$OUT_DIR/conform-cuda.json" ]; then
  printf '{"driver": "vllm", "device": "cuda", "exit": %d, "error": "no report written"}\n' \
    "$rc" > "$OUT_DIR/conform-cuda.json"
fi
exit "$rc"
