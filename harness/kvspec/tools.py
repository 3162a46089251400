"""tla-bin style console scripts: ``tlc``, ``sany``, ``pcal``, ``tlatex``.

Same arguments as tla-bin (``tlc Spec.tla`` runs ``java -XX:+UseParallelGC -cp JAR
tlc2.TLC Spec.tla``, which reads ``Spec.cfg``); every flag is passed through and the
tool's exit code is returned. A missing java or a bad jar is one line on stderr and
exit code 2.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from kvspec.jar import JarError, JavaMissing, jar_path, java_path

# Interactive tools may legitimately run for a long time; the cap only guarantees that
# no process outlives a forgotten terminal. Override with KVSPEC_TOOL_TIMEOUT (seconds).
DEFAULT_TOOL_TIMEOUT_S = 7 * 24 * 3600


def java_command(main_class: str, args: Sequence[str]) -> list[str]:
    """The java command line for one of the TLA+ tools (raises JavaMissing/JarError)."""
    java = java_path()
    jar = jar_path()
    jvm = ["-XX:+UseParallelGC"]
    xmx = os.environ.get("KVSPEC_TLC_XMX")
    if xmx:
        jvm.append(f"-Xmx{xmx}")
    return [java, *jvm, "-cp", str(jar), main_class, *args]


def run_tool(prog: str, main_class: str, argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cmd = java_command(main_class, args)
    except (JavaMissing, JarError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    timeout = float(os.environ.get("KVSPEC_TOOL_TIMEOUT", DEFAULT_TOOL_TIMEOUT_S))
    proc = subprocess.Popen(cmd)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        print(f"{prog}: timed out after {timeout:g}s", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # java got the SIGINT too (same process group); give it a moment to exit.
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
            return 128 + signal.SIGINT
    return rc if rc >= 0 else 128 - rc  # killed by signal N -> 128+N, like a shell


def tlc_main(argv: Sequence[str] | None = None) -> int:
    return run_tool("tlc", "tlc2.TLC", argv)


def sany_main(argv: Sequence[str] | None = None) -> int:
    return run_tool("sany", "tla2sany.SANY", argv)


def pcal_main(argv: Sequence[str] | None = None) -> int:
    return run_tool("pcal", "pcal.trans", argv)


def tlatex_main(argv: Sequence[str] | None = None) -> int:
    return run_tool("tlatex", "tla2tex.TLA", argv)
