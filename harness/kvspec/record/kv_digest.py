"""A digest of one request's KV bytes on one worker, so that a recording can say whether the
KV a decode engine received is the KV the producer computed (the recorder's `kv_digest`
events, checked by `kvspec scenario`).

Why bytes and not outputs: the scenario fixtures' dummy weights (load_format "dummy",
values of about 1e-3) make a decode step's tokens depend on the last token, not on the KV.
Measured (pd-push-p-handshake-late-reuse, 2026-12-06): D decoded two requests whose KV P's
late WRITEs had taken from blocks P had reused for two other prompts, and D's tokens still
equalled a local run. "decode outputs equal a local run" cannot see a wrong KV there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from typing import Any

from kvspec.drivers.vllm_adapters import first_group

# Opt-in (kvspec scenario sets it): a digest copies a request's KV to the host and hashes
# it on the worker's step, time a user's recorded deployment must not pay.
DIGEST_ENV = "KVSPEC_KV_DIGEST"


def kernel_blocks(blocks: Iterable[int], per_logical: int) -> list[int]:
    """The kernel blocks of logical blocks (base_worker.py:946-966: a logical block is
    `_physical_blocks_per_logical_kv_block` consecutive kernel blocks)."""
    return [b * per_logical + i for b in blocks for i in range(per_logical)]


def digest(caches: dict[str, Any], blocks: Sequence[int], num_blocks: int) -> str | None:
    """sha256 (16 hex digits) of the blocks' bytes in every layer's cache, layers in name
    order; None where a cache has no dimension of `num_blocks` among its first two (the
    block dimension of every CPU and CUDA layout vLLM allocates: (2, blocks, ...) or
    (blocks, ...))."""
    h = hashlib.sha256()
    for name in sorted(caches):
        t = caches[name]
        shape = tuple(getattr(t, "shape", ()))
        dim = next((d for d in (0, 1) if len(shape) > d and shape[d] == num_blocks), None)
        if dim is None:
            return None
        for b in blocks:
            h.update(_bytes(t.select(dim, b).detach().to("cpu").contiguous()))
    return h.hexdigest()[:16]


def _bytes(t: Any) -> bytes:
    """A CPU tensor's raw bytes (bfloat16 has no numpy dtype: viewed as uint8 first)."""
    import torch

    return bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def of_request(worker: Any, caches: dict[str, Any] | None,
               logical: Any) -> tuple[str | None, list[str | None], int]:  # fmt: skip
    """(digest, per-block digests, blocks) of a request's logical blocks on this worker's
    caches. Per block: a decode engine with a local prefix hit receives only the blocks
    after it (base_worker.py:3333-3337), so its receive is compared with the tail of what
    the producer computed (kvspec.scenario.kv_bytes_check)."""
    blocks = first_group(logical)
    if not caches or worker is None:
        return None, [], len(blocks)
    per = int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1) or 1)
    n = int(getattr(worker, "num_blocks", -1))
    each = [digest(caches, kernel_blocks([b], per), n) for b in blocks]
    return digest(caches, kernel_blocks(blocks, per), n), each, len(blocks)


def enabled() -> bool:
    """Asked for (DIGEST_ENV)."""
    return os.environ.get(DIGEST_ENV) == "1"


def emit(rec: Any, worker: Any, caches: dict[str, Any] | None, rid: str, blocks: Any,
         side: str) -> None:  # fmt: skip
    """The recorder's `kv_digest` event of request rid ("sent": P's blocks as its forward
    left them; "received": D's as the transfer left them); never raises into vLLM."""
    if not enabled():
        return
    try:
        dg, each, n = of_request(worker, caches, blocks)
        rec.emit("kv_digest", reqs=[rid], side=side, digest=dg, blocks=n, per_block=each)
    except Exception as exc:  # noqa: BLE001 - never raise into vLLM
        rec.emit("recorder_error", where="kv_digest", error=repr(exc))


# Pull mode: P's worker never sees a request's blocks (D READs them one-sided), so the
# recording scheduler hands them over on the step's connector metadata, which vLLM pickles
# to the workers as it is (an attribute of ours; only where a digest is asked for).
PENDING_ATTR = "kvspec_finished_blocks"


def note_finished(connector: Any, rid: str, groups: Any, delay: bool) -> None:
    """The scheduler finished rid and holds its blocks for a transfer: hand them to the
    workers with the next metadata (`attach`)."""
    if enabled() and delay:
        try:
            vars(connector).setdefault("_kvspec_pending", {})[rid] = first_group(groups)
        except (TypeError, ValueError):  # block ids of a shape we do not know: none
            pass


def attach(connector: Any, meta: Any) -> None:
    """Put the blocks noted since the last step on this step's metadata."""
    pending = vars(connector).get("_kvspec_pending")
    if pending:
        try:
            setattr(meta, PENDING_ATTR, dict(pending))
            pending.clear()
        except (AttributeError, TypeError):  # a metadata that takes no attribute: none
            pending.clear()


def finished_blocks(meta: Any) -> dict[str, Any]:
    """The blocks of the requests a worker's metadata says P finished: push mode's own
    (`push_finished_blocks`, push_scheduler.py:336-338) and the recorder's (`attach`)."""
    return {**dict(getattr(meta, PENDING_ATTR, None) or {}),
            **dict(getattr(meta, "push_finished_blocks", None) or {})}  # fmt: skip
