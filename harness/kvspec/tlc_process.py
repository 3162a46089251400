"""TLC as a process: its command-line arguments, waiting for it, killing it.

Split out of ``kvspec.tlc`` (which runs TLC and reads its output): nothing here reads
TLC's output, except that ``wait_tlc`` hands the log so far to a ``stop`` predicate.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def tlc_args(
    spec: Path, config: Path, metadir: Path, *, workers: int = 1, fp: int = 0, seed: int = 0,
    deadlock: bool = True, extra_args: Sequence[str] = (),
    simulate: tuple[int, int] | None = None, dump_dot: Path | None = None,
) -> list[str]:  # fmt: skip
    """TLC's arguments (after ``tlc2.TLC``) for one reproducible ``-tool`` run."""
    args = ["-tool", "-metadir", str(metadir), "-fp", str(fp), "-seed", str(seed),
            "-workers", str(workers), "-config", str(config)]  # fmt: skip
    if not deadlock:
        args.append("-deadlock")
    if simulate is not None:
        args += ["-simulate", f"num={simulate[0]}", "-depth", str(simulate[1])]
    if dump_dot is not None:
        args += ["-dump", "dot,actionlabels,colorize", str(dump_dot)]
    return [*args, *extra_args, str(spec)]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
        pass


def wait_tlc(
    proc: subprocess.Popen[bytes], timeout_s: float, log: Path,
    stop: Callable[[str], bool] | None, poll_s: float,
) -> tuple[int | None, bool, bool]:  # fmt: skip
    """Wait for TLC: (exit status, timed out, stopped by ``stop``)."""
    deadline = time.monotonic() + timeout_s
    seen = -1
    while (left := deadline - time.monotonic()) > 0:
        try:
            return proc.wait(timeout=left if stop is None else min(poll_s, left)), False, False
        except subprocess.TimeoutExpired:
            pass
        if stop is not None and (size := log.stat().st_size) != seen:
            seen = size
            if stop(log.read_text(errors="replace")):
                kill_group(proc)
                return proc.returncode, False, True
    kill_group(proc)
    return proc.returncode, True, False
