"""Which vLLM is under test, and running the suite against a source checkout (issue #15).

A vLLM developer tests their branch either by installing it (`pip install -e .`: nothing to
do, vLLM is imported from the checkout) or with `kvspec --vllm-src PATH COMMAND` (or
`KVSPEC_VLLM_SRC=PATH`), which puts PATH first on `sys.path` (and on PYTHONPATH, for the
processes the engine scenarios spawn) before anything imports vLLM. A checkout that was
never built has no compiled extensions (`vllm/_C.abi3.so`, ...): the installed wheel's
package directory is appended to `vllm.__path__`, so Python modules come from the checkout
and only modules the checkout lacks (the compiled ones) from the wheel. That mix is what a
connector-only change needs; a change to the C++ kernels needs a built checkout.

`describe()` says what was imported: version, directory, and the git commit (with a dirty
flag) when the package lives in a git work tree, else the commit the wheel was built from
(`vllm._version.__commit_id__`) when it records one. `kvspec conform` and the report name it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kvspec.itf import JSON

ENV = "KVSPEC_VLLM_SRC"
GIT_TIMEOUT_S = 10.0


class SourceError(ValueError):
    """A --vllm-src that cannot be used; the message is one line: the path, what is wrong
    and what to do."""


@dataclass(frozen=True)
class VllmSource:
    version: str
    path: str  # the imported vllm package directory
    kind: str  # "source checkout" | "installed package"
    commit: str | None
    dirty: bool | None

    def label(self) -> str:
        """`vLLM 0.32.0` for an installed wheel, `vLLM 0.32.0 from PATH (commit abc1234,
        dirty)` for a checkout."""
        if self.kind != "source checkout":
            return f"vLLM {self.version}" + (f" (commit {self.commit[:12]})" if self.commit else "")
        rev = "no git commit" if self.commit is None else f"commit {self.commit[:12]}"
        rev += ", dirty" if self.dirty else ""
        return f"vLLM {self.version} from {Path(self.path).parent} ({rev})"

    def to_json(self) -> dict[str, JSON]:
        return dict(asdict(self))


def _installed_package_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def use_source(path: Path) -> None:
    """Import vLLM from the checkout at `path` from now on (raises SourceError)."""
    root = path.expanduser().resolve()
    if not (root / "vllm" / "__init__.py").is_file():
        raise SourceError(
            f"{path}: no vllm/__init__.py there; pass the root of a vLLM checkout (the "
            "directory holding setup.py and vllm/)"
        )
    loaded = sys.modules.get("vllm")
    if loaded is not None:
        if Path(str(loaded.__file__)).resolve().parent == root / "vllm":
            return
        raise SourceError(
            f"{path}: vLLM was already imported from {Path(str(loaded.__file__)).parent}; "
            "pass --vllm-src before the command (kvspec --vllm-src PATH COMMAND)"
        )
    wheel = _installed_package_dir()
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(root), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    )
    importlib.invalidate_caches()
    import vllm

    if Path(str(vllm.__file__)).resolve().parent != root / "vllm":
        raise SourceError(f"{path}: vllm still imports from {vllm.__file__}; check PYTHONPATH")
    if wheel is not None and wheel.resolve() != root / "vllm":
        # Compiled extensions of the installed wheel for an unbuilt checkout (module doc).
        vllm.__path__.append(str(wheel))


def _git(cwd: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(cwd), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def describe() -> VllmSource | None:
    """The vLLM this process imports (None when there is none)."""
    try:
        import vllm
    except ImportError:
        return None
    pkg = Path(str(vllm.__file__)).resolve().parent
    version = str(getattr(vllm, "__version__", "unknown"))
    top = _git(pkg, "rev-parse", "--show-toplevel")
    if top is not None and "site-packages" not in pkg.parts:
        commit = _git(pkg, "rev-parse", "HEAD")
        status = _git(pkg, "status", "--porcelain", "--untracked-files=no")
        dirty = None if status is None else bool(status)
        return VllmSource(version, str(pkg), "source checkout", commit, dirty)
    kind = "installed package" if "site-packages" in pkg.parts else "source checkout"
    commit = None
    try:
        from vllm import _version

        commit = getattr(_version, "__commit_id__", None)
    except ImportError:
        pass
    return VllmSource(version, str(pkg), kind, commit, None)
