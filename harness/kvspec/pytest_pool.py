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
    cluster = sys.modules.get("kvspec.drivers.cluster_pool")
    if cluster is not None:
        cluster.shutdown_pool()

