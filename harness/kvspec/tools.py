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


# The JVM flags of short TLC runs (`kvspec check`'s default matrix: ~60 runs of 1-40 s on
# 2 shared cores). Measured on one 1,536-state row: the default JIT spends 10.4 s of CPU
# for 6.2 s wall, C1 alone 6.5 s for the same wall, so two runs at once each get a core;
# the default matrix took 336 s wall with the default JIT, 243 s with these. Runs that
# explore for minutes are faster with C2 (70% slower under C1, measured), so long sweeps
# keep the default. Since the thirty-fourth session also every run bounded to seconds by
# construction: the fast rows of the sweeps, trace validation (the log bounds it) and the
# conformance graphs' dumps. make test's pytest with every TLC run under C1
# (KVSPEC_JVM_FLAGS) took 868 s of test time (466 s wall), against 1,192 s (555-630 s) before.
QUICK_JVM = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")


def java_command(
    main_class: str, args: Sequence[str], jvm_flags: Sequence[str] | None = None
) -> list[str]:
    """The java command line for one of the TLA+ tools (raises JavaMissing/JarError).
    `jvm_flags` replaces the default `-XX:+UseParallelGC`; KVSPEC_JVM_FLAGS (a
    space-separated list) replaces both."""
    java = java_path()
    jar = jar_path()
    env = os.environ.get("KVSPEC_JVM_FLAGS")
    jvm = env.split() if env else list(jvm_flags or ["-XX:+UseParallelGC"])
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
