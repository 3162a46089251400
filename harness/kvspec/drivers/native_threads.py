"""Run the native threads a driver cluster starts (NIXL's and UCX's) at the lowest CPU
priority, so that they yield the core to the harness's own thread and to TLC.

NIXL's Python agent sets `pthrDelay = 0` (`nixl_cu12/_api.py:226`, vLLM passes no
delay): each agent's progress thread busy-polls a core for as long as the agent lives.
A cluster has two agents or more (producer ranks and decode ranks; a PCP 2 x TP 2 one has
six), so on the 2-core machines `make test` targets the driver's own thread shared the
cores with two to six spinning threads while a cluster existed: two thirds of a core at
best. Measured 2026-12-03, `test_spec_matrix_sample.py` alone: 60 s as
started, 36 s with those threads at nice 19 (two runs each, same results).

Priority is not behaviour: the threads still run whenever a core is free, and every wait
of the driver sleeps while it polls a NIXL state, so transfers and notifications make
progress as before; no step is decided by how fast they do. Real engines (`kvspec
scenario`) are separate processes started as a deployment starts them, and are not
touched.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

LOWEST = 19  # nice value
_TASKS = Path("/proc/self/task")


def thread_ids() -> set[int]:
    """This process's kernel thread ids (empty where /proc has none: not Linux)."""
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return set()


def python_thread_ids() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def renice(tids: set[int], nice: int = LOWEST) -> list[int]:
    """Set each thread's nice value (Linux: per thread). Returns those set; a thread that
    ended in between is skipped."""
    done = []
    for tid in sorted(tids):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            done.append(tid)
    return done


@contextlib.contextmanager
def native_threads_niced(keep: set[int] | None = None) -> Iterator[list[int]]:
    """Threads started inside the block, except Python threads (and `keep`), run at the
    lowest priority when it ends. Yields the list it fills with the threads reniced."""
    before = thread_ids()
    niced: list[int] = []
    try:
        yield niced
    finally:  # a failed build's threads too, until its teardown ends them
        skip = python_thread_ids() if keep is None else keep
        niced.extend(renice(thread_ids() - before - skip))
