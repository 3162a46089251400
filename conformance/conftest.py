"""Options and the driver factory shared by the conformance suite.

--driver reference|vllm   which implementation replays the traces (default reference)
--device cpu|cuda         the vllm driver's device
--impl-patch NAME         a patch the vllm driver applies to vLLM (see its registry)
--variant NAME            only traces of models of this design variant
--layout NAME             the vllm driver's prompts: one-block (default), shared-prefix
                          (vLLM's prefix caching on, every prompt's first block shared),
                          shared-prefix-d-hit (the same, D moves each request's own block
                          only); a row it cannot lay out is skipped (drivers/prefix_layout.py)
--per-model N             at most N generated traces per model, spread evenly over its set
                          (regressions always run); make test uses it for the vllm driver,
                          make test-full replays every trace
--verbose-vllm            leave vLLM's and NIXL's log on the terminal (so does -s); by
                          default it goes to build/logs/pytest[-<xdist worker>]-<time>.log
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from kvspec.conform import DriverFactory, driver_factory
from kvspec.drivers.prefix_layout import LAYOUTS, unsupported
from kvspec.drivers.vllm_logging import vllm_logs
from kvspec.matrix import DESIGNS, ModelRow

_LOGS = pytest.StashKey[contextlib.ExitStack]()
_LOG_PATH = pytest.StashKey[Path | None]()


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kvspec conformance")
    g.addoption("--driver", choices=("reference", "vllm"), default="reference")
    g.addoption("--device", choices=("cpu", "cuda"), default="cpu")
    g.addoption("--impl-patch", default=None, metavar="NAME")
    g.addoption("--variant", choices=DESIGNS, default=None)
    g.addoption("--per-model", type=int, default=None, metavar="N")
    g.addoption("--layout", choices=sorted(LAYOUTS), default="one-block")
    g.addoption("--verbose-vllm", action="store_true", help="vLLM's log on the terminal")


def pytest_configure(config: pytest.Config) -> None:
    """vLLM's and NIXL's log (a line per connector and agent) go to a file for the whole
    session, unless the terminal is asked for (-s or --verbose-vllm)."""
    verbose = config.getoption("capture") == "no" or bool(config.getoption("--verbose-vllm"))
    stack = contextlib.ExitStack()
    config.stash[_LOGS] = stack
    # Under pytest-xdist (make test: -n 2) each worker has a file of its own.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    name = f"pytest-{worker}" if worker else "pytest"
    config.stash[_LOG_PATH] = stack.enter_context(vllm_logs(name, verbose))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _LOGS in config.stash:
        config.stash[_LOGS].close()


def pytest_report_header(config: pytest.Config) -> str | None:
    path = config.stash.get(_LOG_PATH, None)
    return None if path is None else f"vLLM's log: {path}"


@pytest.fixture(scope="session")
def driver_name(pytestconfig: pytest.Config) -> str:
    return str(pytestconfig.getoption("--driver"))


@pytest.fixture(scope="session")
def make_driver(pytestconfig: pytest.Config) -> DriverFactory:
    """A factory building one fresh driver per trace (`wait_scale` lengthens its waits for
    a retry after a timeout); vLLM is imported once per session."""
    from kvspec.drivers.vllm_env import DriverUnavailable

    name = str(pytestconfig.getoption("--driver"))
    device = str(pytestconfig.getoption("--device"))
    patch = pytestconfig.getoption("--impl-patch")
    layout = str(pytestconfig.getoption("--layout"))
    try:
        return driver_factory(name, device, str(patch) if patch else None, layout)
    except (ImportError, DriverUnavailable) as exc:  # vllm/nixl missing, or no such device
        pytest.skip(f"{name} driver unavailable on {device}: {exc}")


def layout_refusal(config: pytest.Config, row: ModelRow) -> str | None:
    """Why the vllm driver's --layout cannot run `row` (None: it can, or the reference
    driver, which has no layout, replays it)."""
    if config.getoption("--driver") != "vllm":
        return None
    return unsupported(LAYOUTS[str(config.getoption("--layout"))], row)


def replay_extra(config: pytest.Config) -> str:
    """The non-default options, for the one-line replay command of a failure."""
    parts = []
    for opt in ("--device", "--impl-patch", "--layout"):
        v = config.getoption(opt)
        if v and not (opt == "--device" and v == "cpu") and v != "one-block":
            parts.append(f"{opt} {v}")
    return " ".join(parts)


@pytest.fixture(scope="module")
def device(pytestconfig: pytest.Config) -> str:
    """--device for tests that build the vllm driver themselves (cpu here, cuda on a GPU
    runner); skipped with the reason when vLLM or the device cannot run here."""
    pytest.importorskip("vllm")
    from kvspec.drivers.vllm_env import DriverUnavailable, check_device

    dev = str(pytestconfig.getoption("--device"))
    try:
        check_device(dev)
    except DriverUnavailable as exc:
        pytest.skip(f"vllm driver unavailable on {dev}: {exc}")
    return dev
