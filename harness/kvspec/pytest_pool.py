"""pytest plugin (`-p kvspec.pytest_pool`, set in pyproject.toml): tear down pooled vLLM clusters
between test modules. A plugin, not a root conftest.py: a second `conftest` module would
shadow conformance/conftest.py for `from conftest import ...`."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="module")
def _vllm_clusters_torn_down_per_module() -> Iterator[None]:
    """Tear down the vLLM driver's pooled clusters when a test module ends: their NIXL
    agents' progress threads poll, and clusters left over from one module would take
    CPU from every later one. Only where a module already imported the driver (vLLM is
    never imported for this)."""
    yield
    cluster = sys.modules.get("kvspec.drivers.vllm_cluster")
    if cluster is not None:
        cluster.shutdown_pool()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules marked `last` run after every other one (a stable sort: order kept within
    each group). The decode driver's in-process replays leave a native thread (NIXL's,
    not a Python thread; no Python agent object survives `shutdown_pool`) spinning one
    core for the rest of the process: measured 2026-12-03, test_handshake_fail's TLC
    runs took 135 s after test_decode_real and 31 s alone. Until that thread is found,
    the modules that leave it go last, so the others are not slowed."""
    items.sort(key=lambda it: it.get_closest_marker("last") is not None)
