"""The native threads a driver cluster starts run at the lowest priority
(kvspec.drivers.native_threads): NIXL's progress threads busy-poll."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator

import pytest
from kvspec.drivers.native_threads import LOWEST, native_threads_niced, thread_ids

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's"),
    # Threads inherit their creator's nice: a suite already run at the lowest priority
    # (`nice -n 19 make test`) cannot show a renice.
    pytest.mark.skipif(
        sys.platform == "linux" and os.getpriority(os.PRIO_PROCESS, 0) >= LOWEST,
        reason="the tests already run at the lowest priority",
    ),
]


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def parked() -> Iterator[threading.Event]:
    stop = threading.Event()
    yield stop
    stop.set()


def _start(stop: threading.Event) -> int:
    t = threading.Thread(target=stop.wait, daemon=True)
    t.start()
    assert t.native_id is not None
    return t.native_id


def test_threads_started_in_the_block_are_reniced(parked: threading.Event) -> None:
    before = _start(parked)  # the negative control: started before the block
    with native_threads_niced(keep=set()) as niced:  # keep nothing: Python's count here
        inside = _start(parked)
    assert inside in niced and _nice(inside) == LOWEST
    assert before not in niced and _nice(before) == _nice(threading.get_native_id())


def test_python_threads_are_left_alone_by_default(parked: threading.Event) -> None:
    # The harness's own threads (a handshake listener, a timer) keep their priority.
    with native_threads_niced() as niced:
        tid = _start(parked)
    assert tid not in niced and _nice(tid) == _nice(threading.get_native_id())


def test_a_vllm_clusters_nixl_threads_run_at_the_lowest_priority() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    from kvspec.drivers import cluster_pool
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.matrix import ModelRow, Topology

    cluster_pool.shutdown_pool()  # a fresh cluster, built here
    own = thread_ids()
    d = VllmDriver(ModelRow("p", "v0.30-shipped", "nixl", Topology(1, 1, 1), 1, 1, False))
    try:
        new = thread_ids() - own
        low = {t for t in new if _nice(t) == LOWEST}
        # two agents (P's rank and D's), each with its progress thread at least
        assert len(low) >= 2, (len(new), len(low))
        assert _nice(threading.get_native_id()) != LOWEST
    finally:
        d.close()
        cluster_pool.shutdown_pool()
