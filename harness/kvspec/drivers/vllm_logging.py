"""vLLM's and NIXL's log records, sent to a file while a kvspec command drives them
(`vllm_logs`): the terminal shows progress and results, the file vLLM's own lines."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

LOG_DIR = Path(__file__).resolve().parents[3] / "build" / "logs"
# vLLM's loggers are children of "vllm"; NIXL's Python API logs under "nixl".
CHATTY_LOGGERS = ("vllm", "nixl")


@dataclass
class _Saved:
    handlers: list[logging.Handler]
    level: int
    propagate: bool


@dataclass
class _Redirect:
    """Loggers sent to one file handler, and what they had before (restored at the end)."""

    handler: logging.Handler
    saved: dict[str, _Saved] = field(default_factory=dict)

    def take(self, name: str) -> None:
        lg = logging.getLogger(name)
        self.saved[name] = _Saved(list(lg.handlers), lg.level, lg.propagate)
        lg.handlers = [self.handler]
        lg.propagate = False
        if lg.level == logging.NOTSET:
            # vLLM's own default (VLLM_LOGGING_LEVEL), so the file has its INFO lines.
            lg.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())

    def restore(self) -> None:
        for name, sv in self.saved.items():
            lg = logging.getLogger(name)
            lg.handlers = sv.handlers
            lg.setLevel(sv.level)
            lg.propagate = sv.propagate


_ACTIVE: list[_Redirect] = []  # the vllm_logs blocks in force, outermost first


def retake_loggers() -> None:
    """NIXL configures its "nixl" logger when it is first imported (inside vllm_api(): vLLM
    must import it itself, after setting UCX_RCACHE_MAX_UNRELEASED), and vLLM 0.29 its
    "vllm" logger (dictConfig at the import of vllm.logger, 0.29 logger.py:241; 0.32 only
    in its entry points), replacing the handlers a vllm_logs block installed: take them
    over again, saving their own set-up to restore."""
    for name in CHATTY_LOGGERS:
        if _ACTIVE and logging.getLogger(name).handlers != [_ACTIVE[-1].handler]:
            for r in _ACTIVE:
                r.take(name)


@contextlib.contextmanager
def vllm_logs(
    command: str, verbose: bool = False, log_dir: Path = LOG_DIR
) -> Iterator[Path | None]:
    """Send vLLM's and NIXL's log records to `log_dir/<command>-<YYYYmmdd-HHMMSS>.log`
    while the block runs (yields the path; None with `verbose`, which leaves them on the
    terminal). Every logger is restored on exit.

    Where the lines come from: vLLM 0.32 installs its handler only in its engine entry
    points (vllm.logger.configure_logging), which the driver never runs, so its records
    ("Initializing KVConnectorBase_V1 ...", one per connector) propagate to the root logger
    and reach the terminal through logging.lastResort or whatever handler the host
    installed. NIXL's Python API gives the "nixl" logger a StreamHandler on stdout at
    import (INFO: one "Initialized NIXL agent" per agent; see retake_loggers). UCX and
    NIXL's C++ core write to the file descriptors below Python's logging; in these runs
    they print nothing, and what they would print (errors) stays on the terminal.
    """
    if verbose:
        yield None
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    # delay: a run that logs nothing leaves no file behind.
    handler = logging.FileHandler(path, mode="a", encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    redirect = _Redirect(handler)
    for name in CHATTY_LOGGERS:
        redirect.take(name)
    _ACTIVE.append(redirect)
    try:
        yield path
    finally:
        _ACTIVE.remove(redirect)
        redirect.restore()
        handler.close()
