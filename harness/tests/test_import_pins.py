"""vLLM keeps optional-import errors at module level; their tracebacks pinned the frames on
the stack at vLLM's first import, and with them a decode worker whose NIXL agent spun a
core for the rest of the process (kvspec.drivers.import_pins)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import types
import weakref
from collections.abc import Iterator

import pytest
from kvspec.drivers.import_pins import unpin_import_tracebacks


class Held:
    """Stands for the worker a caller's frame held when it returned."""


def _pin_into(module: types.ModuleType, obj: Held) -> None:
    # As vllm/multimodal/media/audio.py does: keep the import error for a later raise.
    holder = obj  # noqa: F841  (the returned frame keeps this local)
    try:
        raise ModuleNotFoundError("No module named 'torchcodec'")
    except ModuleNotFoundError as exc:
        module._import_exc = exc  # type: ignore[attr-defined]


@pytest.fixture
def fake_vllm() -> Iterator[types.ModuleType]:
    mod = types.ModuleType("vllm_kvspec_fake.media")
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def _pinned(fake: types.ModuleType) -> weakref.ref[Held]:
    obj = Held()
    _pin_into(fake, obj)
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    return ref


def test_a_kept_import_error_pins_its_callers_locals(fake_vllm: types.ModuleType) -> None:
    # The negative control: left alone, the traceback keeps the object alive.
    assert _pinned(fake_vllm)() is not None


def test_unpinning_frees_them_and_keeps_the_error(fake_vllm: types.ModuleType) -> None:
    ref = _pinned(fake_vllm)
    assert unpin_import_tracebacks("vllm_kvspec_fake") == 1
    gc.collect()
    assert ref() is None
    kept = fake_vllm._import_exc  # type: ignore[attr-defined]
    assert isinstance(kept, ModuleNotFoundError) and "torchcodec" in str(kept)


def test_other_packages_are_left_alone(fake_vllm: types.ModuleType) -> None:
    ref = _pinned(fake_vllm)
    assert unpin_import_tracebacks("vllm_kvspec_other") == 0
    assert ref() is not None


# A fresh process, so that vLLM's first import happens under build_cluster. With the unpin
# disabled the first cluster's decode worker outlives shutdown_pool (the negative control);
# the real unpin then frees it. 17 s (vLLM's import and a cluster): make test-full; the
# tests above keep the mechanism in make test.
_REAL = textwrap.dedent(
    """
    import gc, weakref
    from kvspec.drivers import cluster_pool, import_pins, vllm_env
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.matrix import ModelRow, Topology

    real = import_pins.unpin_import_tracebacks
    vllm_env.unpin_import_tracebacks = cluster_pool.unpin_import_tracebacks = lambda: 0
    d = VllmDriver(ModelRow("p", "v0.30-shipped", "nixl", Topology(1, 1, 1), 1, 1, False))
    worker = weakref.ref(d.c.consumer_nixl(0).connector_worker)
    d.close(); del d
    cluster_pool.shutdown_pool(); gc.collect()
    print("without-unpin", "alive" if worker() is not None else "freed")
    print("cleared", real())
    gc.collect()
    print("with-unpin", "alive" if worker() is not None else "freed")
    """
)


@pytest.mark.slow
def test_vllms_first_import_pins_a_decode_worker_until_unpinned() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    out = subprocess.run(
        [sys.executable, "-c", _REAL], capture_output=True, text=True, timeout=600, check=False
    )
    lines = dict(ln.split(" ", 1) for ln in out.stdout.splitlines() if " " in ln)
    assert out.returncode == 0, out.stderr[-2000:]
    assert lines.get("without-unpin") == "alive", out.stdout
    assert int(lines.get("cleared", "0")) >= 1
    assert lines.get("with-unpin") == "freed", out.stdout
