"""A scenario's engine process: JSON lines in and out with a deadline on every answer.

A reader thread moves stdout lines into a queue, so a wait is a `queue.get(timeout=)`: an
engine that hangs, or a machine too loaded to answer in time, raises EngineTimeout (the
scenario is inconclusive), and `close` kills the process group, vLLM's children included.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any


class EngineTimeout(TimeoutError):
    """An engine did not answer before its deadline, or the machine killed it (a signal:
    the OOM killer on a loaded machine): no verdict either way."""


class EngineExited(RuntimeError):
    """An engine exited by itself before answering: a crash (vLLM's EngineCore assert,
    a refused configuration), which is a failed scenario, not a timeout. `last`: the
    last line of its log that names an error."""

    def __init__(self, rc: int, log: Path, last: str) -> None:
        super().__init__(f"engine exited with {rc} (log: {log}): {last}")
        self.rc = rc


def last_error(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    errs = [x.strip() for x in lines if "Error" in x or "error" in x]
    return (errs or lines or ["(empty log)"])[-1][:300]


class EngineProc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path,
                 grace_s: float = 10) -> None:  # fmt: skip
        self.log = log
        self.grace_s = grace_s  # how long `close` lets the engine shut down by itself
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            args,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        # (monotonic s, "send" | "answer", what): when each exchange happened, for the log
        self.timings: list[tuple[float, str, str]] = []
        assert self.proc.stdout is not None
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, out: IO[bytes]) -> None:
        for raw in out:
            self._lines.put(raw.decode(errors="replace"))
        self._lines.put(None)  # EOF: the engine exited

    def send(self, cmd: dict[str, Any]) -> None:
        """Send `cmd` without waiting: `ask(None, ...)` takes its answer (several engines
        asked at once, as a proxy spreads requests)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def ask(self, cmd: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        """Send `cmd` (None: send nothing) and return the next JSON line the engine prints;
        lines that are not JSON objects (a library printing to stdout) are skipped."""
        self.timings.append((time.monotonic(), "send", (cmd or {}).get("cmd", "wait")))
        if cmd is not None:
            self.send(cmd)
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                raise EngineTimeout(f"no answer in {timeout_s:.0f} s (log: {self.log})") from None
            if line is None:
                rc = self.proc.wait()
                if rc < 0:  # killed by a signal: the machine, not the engine
                    raise EngineTimeout(f"engine killed by signal {-rc} (log: {self.log})")
                self._log.flush()
                raise EngineExited(rc, self.log, last_error(self.log))
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                self.timings.append((time.monotonic(), "answer", ",".join(sorted(obj))))
                return obj

    def answered(self) -> bool:
        """A line is waiting to be read (the engine answered, or exited): no wait."""
        return not self._lines.empty()

    def kill(self) -> None:
        """SIGKILL the engine's process group, vLLM's children included: a crash, as a
        scenario stages one (`close` later writes the timings)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self) -> None:
        """SIGSTOP the engine's process group: a producer that hangs (its NIXL agent makes
        no progress, so a READ of it stays in flight) until `kill` crashes it."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def close(self) -> None:
        """Ask the engine to exit, kill its process group after grace_s, and append the
        exchange timings to its log. Idempotent. The group is killed even where the wait
        is interrupted (Ctrl-C): vLLM's children run in the engine's own session, so
        nothing else would stop them."""
        if self._log.closed:
            return
        try:
            if self.proc.poll() is None:
                try:
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(b'{"cmd": "exit"}\n')
                    self.proc.stdin.flush()
                    self.proc.wait(self.grace_s)
                except (OSError, subprocess.TimeoutExpired):
                    pass
        finally:
            try:  # vLLM's engine-core and worker children share the group
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self._log.writelines(f"kvspec scenario: {t:.3f} {kind} {what}\n".encode()
                                 for t, kind, what in self.timings)  # fmt: skip
            self._log.close()
