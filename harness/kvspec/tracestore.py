"""Where conformance traces live, when they are regenerated, and the lock that pins them.

Why generated, not committed: the model (kvspec.model, proven graph-equal to TLC) writes
every trace of the conformance matrix in seconds, so committing ~1,800 files of ITF only
made spec changes into diffs nobody reviews. What is committed instead:

* `conformance/locks/<model>.json`: edges, traces, steps and the sha256 of the model's
  trace set. `kvspec traces --check` (part of `make test`) fails when a regeneration no
  longer matches, so a change of the generator or the spec shows up as a small lock diff.
* `conformance/regressions/<variant>/<model>/cex-*.itf.json`: hand-picked counterexamples,
  replayed like generated traces and checked to still be spec paths.

Generated traces go to `build/traces/<design>/<model>/<stem>.itf.json` (kvspec.matrix.design:
the variant, "+early-break" for a 0.30 reaper row): one folder per
design, so a run for one design reads only its own traces. The folder is reused while the
digest of the generator's inputs (`STAMP`) is unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvspec.matrix import DEFAULT_MATRIX, DEFAULT_TIERS, ModelRow, design, load_matrix

REPO = DEFAULT_MATRIX.parents[1]
CONFORMANCE_MATRIX = REPO / "conformance" / "matrix.toml"
GENERATED = REPO / "build" / "traces"
REGRESSIONS = REPO / "conformance" / "regressions"
LOCKS = REPO / "conformance" / "locks"
STAMP = "STAMP"
SUFFIX = ".itf.json"
# Everything the generated trace set is a function of: the conformance rows and the code
# that turns them into traces (the spec enters through the model, which tests pin to TLC).
_PKG = Path(__file__).resolve().parent
GENERATOR_INPUTS = (
    _PKG / "model.py",
    _PKG / "codec.py",
    _PKG / "traces.py",
    _PKG / "tracestore.py",
    _PKG / "itf.py",
    _PKG / "tlcvalue.py",
    _PKG / "matrix.py",
)


class TraceStoreError(RuntimeError):
    """Generated traces cannot be produced or do not match their lock."""


@dataclass(frozen=True)
class Lock:
    """What a model's trace set must be: the committed `conformance/locks/<model>.json`."""

    model: str
    variant: str
    edges: int
    covered: int
    traces: int
    steps: int
    sha256: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"


def digest(matrix: Path, inputs: Iterable[Path] = GENERATOR_INPUTS) -> str:
    """sha256 over the matrix file and the generator's sources (the cache key)."""
    h = hashlib.sha256()
    for p in (matrix, *inputs):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def set_digest(files: Mapping[str, str]) -> str:
    """sha256 of one model's trace set: file names and texts, in name order."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name].encode() + b"\0")
    return h.hexdigest()


def model_dir(root: Path, row: ModelRow) -> Path:
    return root / design(row) / row.name


def is_fresh(out: Path, key: str) -> bool:
    stamp = out / STAMP
    return stamp.is_file() and stamp.read_text().strip() == key


TraceSets = Sequence[tuple[ModelRow, Mapping[str, str]]]


def write_generated(out: Path, key: str, sets: TraceSets) -> None:
    """Replace `out` with the trace sets. They are written beside it and renamed into
    place, the stamp last, so that an interrupted write is regenerated next time rather
    than trusted, and a process reading `out` (make test runs pytest in two workers) never
    sees a half-written set; if another process put the same set in place meanwhile, its
    set stays."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.new-", dir=out.parent))
    for row, files in sets:
        d = model_dir(tmp, row)
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    (tmp / STAMP).write_text(key + "\n")
    if is_fresh(out, key):
        shutil.rmtree(tmp)
        return
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def ensure_generated(
    generate: Callable[[list[ModelRow]], TraceSets],
    matrix: Path = CONFORMANCE_MATRIX,
    out: Path = GENERATED,
) -> Path:
    """Regenerate `out` from `matrix` unless its stamp matches the inputs' digest."""
    key = digest(matrix)
    if not is_fresh(out, key):
        rows = [r for r in load_matrix(matrix) if r.tier in DEFAULT_TIERS]
        write_generated(out, key, generate(rows))
    return out


def trace_paths(root: Path, variant: str | None = None) -> list[Path]:
    """`<root>/<variant>/<model>/*.itf.json`, sorted; one variant's folder when given."""
    pattern = f"{variant or '*'}/*/*{SUFFIX}"
    return sorted(root.glob(pattern))


def read_locks(locks: Path = LOCKS) -> dict[str, Lock]:
    out: dict[str, Lock] = {}
    for p in sorted(locks.glob("*.json")):
        try:
            lock = Lock(**json.loads(p.read_text()))
        except (TypeError, ValueError) as exc:
            raise TraceStoreError(f"{p}:1: malformed lock ({exc}); run `kvspec traces --lock`") \
                from exc  # fmt: skip
        out[lock.model] = lock
    return out


def write_locks(locks: Iterable[Lock], out: Path = LOCKS) -> None:
    """Write one lock per model; locks of models no longer generated are removed."""
    out.mkdir(parents=True, exist_ok=True)
    keep = {f"{lk.model}.json": lk for lk in locks}
    for p in out.glob("*.json"):
        if p.name not in keep:
            p.unlink()
    for name, lk in keep.items():
        p = out / name
        if not p.is_file() or p.read_text() != lk.to_json():
            p.write_text(lk.to_json())


def lock_mismatches(have: Mapping[str, Lock], want: Mapping[str, Lock]) -> list[str]:
    """One line per model whose regenerated set differs from its committed lock."""
    lines: list[str] = []
    for name in sorted(set(have) | set(want)):
        h, w = have.get(name), want.get(name)
        if h is None:
            lines.append(f"{name}: locked but no longer generated")
        elif w is None:
            lines.append(f"{name}: generated but not locked")
        elif h != w:
            diff = [f"{k} {getattr(w, k)} -> {getattr(h, k)}" for k in asdict(h)
                    if getattr(h, k) != getattr(w, k)]  # fmt: skip
            lines.append(f"{name}: " + ", ".join(diff))
    return lines
