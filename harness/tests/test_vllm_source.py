"""`kvspec --vllm-src PATH`: a source checkout is imported and named by its commit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvspec.cli import main
from kvspec.vllm_source import VllmSource

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]


def _checkout(root: Path) -> str:
    """A fake vLLM checkout: a package with a version and one module the wheel lacks,
    committed to git; returns the commit."""
    pkg = root / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.99.0+mybranch"\n')
    (pkg / "only_in_checkout.py").write_text("X = 1\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "branch"]):
        subprocess.run([*GIT, "-C", str(root), *args], check=True, timeout=30)
    out = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
    )
    return out.stdout.strip()


_PROBE = """
import json, sys
from pathlib import Path
from kvspec.vllm_source import use_source, describe
use_source(Path(sys.argv[1]))
import vllm, vllm.only_in_checkout
print(json.dumps({"src": describe().to_json(), "path": [str(p) for p in vllm.__path__]}))
"""


def _probe(src: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(src)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    doc: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return doc


def test_checkout_is_imported_and_named_by_its_commit(tmp_path: Path) -> None:
    commit = _checkout(tmp_path / "src")
    doc = _probe(tmp_path / "src")
    src = VllmSource(**doc["src"])  # type: ignore[arg-type]
    assert src.kind == "source checkout" and src.version == "0.99.0+mybranch"
    assert src.path == str((tmp_path / "src" / "vllm").resolve())
    assert src.commit == commit and src.dirty is False
    assert src.label().endswith(f"(commit {commit[:12]})")
    paths = doc["path"]
    assert isinstance(paths, list) and paths[0] == src.path
    # An edit on top of the commit is named dirty.
    (tmp_path / "src" / "vllm" / "__init__.py").write_text('__version__ = "0.99.1"\n')
    dirty = VllmSource(**_probe(tmp_path / "src")["src"])  # type: ignore[arg-type]
    assert dirty.dirty is True and dirty.label().endswith(", dirty)")


@pytest.mark.vllm
def test_unbuilt_checkout_takes_compiled_modules_from_the_wheel(tmp_path: Path) -> None:
    """The installed wheel's package directory comes after the checkout's in vllm.__path__
    (the only place an unbuilt checkout can find vllm._C)."""
    if importlib.util.find_spec("vllm") is None:  # no import: vLLM takes ~20 s to import
        pytest.skip("vLLM is not installed")
    _checkout(tmp_path / "src")
    paths = _probe(tmp_path / "src")["path"]
    assert isinstance(paths, list) and len(paths) == 2
    assert Path(paths[1]).name == "vllm" and "site-packages" in Path(paths[1]).parts


def test_not_a_checkout_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--vllm-src", str(tmp_path), "doctor", "--jar-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{tmp_path}: no vllm/__init__.py there" in err
