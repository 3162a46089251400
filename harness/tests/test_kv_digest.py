"""The recorder's KV digests and the scenario's KV-bytes check: a request's digest is its
blocks' bytes in every layer, in the layouts vLLM allocates, and the check pairs P's
"sent" digest with D's "received" one. Negative controls: one changed byte changes the
digest; a pair that differs fails the check, and a pair that agrees fails the reuse
scenario's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvspec.record.log import Event
from kvspec.scenario_checks import kv_bytes_check

torch = pytest.importorskip("torch")

from kvspec.record import kv_digest  # noqa: E402


def _caches(layout: tuple[int, ...], dtype: object) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": torch.rand(layout, generator=g).to(dtype) for i in range(2)}


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [((2, 5, 2, 32, 8), torch.float32), ((5, 32, 576), torch.bfloat16)],
    ids=["cpu_attn-kv-first", "mla-blocks-first"],
)
def test_a_digest_is_the_blocks_bytes(layout: tuple[int, ...], dtype: object) -> None:
    caches = _caches(layout, dtype)
    d = kv_digest.digest(caches, [1, 3], 5)
    assert d is not None and d == kv_digest.digest(caches, [1, 3], 5)
    assert d != kv_digest.digest(caches, [3, 1], 5)  # order is part of the KV
    other = 4  # a block the request does not hold: its bytes change nothing
    dim = 1 if layout[0] == 2 else 0
    caches["layer1"].select(dim, other).add_(1)
    assert kv_digest.digest(caches, [1, 3], 5) == d
    idx = (0,) * dim + (3,) + (0,) * (len(layout) - dim - 1)
    caches["layer1"][idx] += 1  # one value of the request's KV
    assert kv_digest.digest(caches, [1, 3], 5) != d
    assert kv_digest.digest(caches, [1], 7) is None  # no block dimension: unknown


def test_a_logical_block_is_its_kernel_blocks_and_receives_keep_their_order() -> None:
    assert kv_digest.kernel_blocks([1, 3], 2) == [2, 3, 6, 7]
    from kvspec.drivers.vllm_adapters import first_group, recv_block_lists, recv_blocks

    assert first_group(([4, 2], [9])) == [4, 2] and first_group([5]) == [5]
    w = SimpleNamespace(_recving_metadata={"d0": SimpleNamespace(local_block_ids=([3, 1],))})
    assert recv_block_lists(w) == {"d0": [3, 1]} and recv_blocks(w) == {"d0": frozenset({1, 3})}
    caches = _caches((10, 16, 8), torch.float32)  # CPU_MLA: two kernel blocks a block
    nw = SimpleNamespace(_physical_blocks_per_logical_kv_block=2, num_blocks=10)
    assert kv_digest.of_request(nw, caches, ([1, 4],)) == (
        kv_digest.digest(caches, [2, 3, 8, 9], 10),
        [kv_digest.digest(caches, [2, 3], 10), kv_digest.digest(caches, [8, 9], 10)],
        2)  # fmt: skip


def _kv(engine: str, rid: str, side: str, dg: str | None, world: int = 1) -> Event:
    return Event(engine, "kv_both", "worker", 0, world, 1, 0, 1, "kv_digest", reqs=(rid,),
                 result={"side": side, "digest": dg, "blocks": 2})  # fmt: skip


def test_the_kv_bytes_check_pairs_p_and_d_by_request() -> None:
    good = [_kv("P", "p0-aa", "sent", "x0"), _kv("P", "p1-bb", "sent", "x1"),
            _kv("D", "p0-cc", "received", "x0"), _kv("D", "p1-dd", "received", "x1")]  # fmt: skip
    ok = kv_bytes_check(good, reused=False)
    assert ok is not None and ok.ok and "p0: P x0, D x0" in ok.detail
    bad = [*good[:3], _kv("D", "p1-dd", "received", "zz")]
    assert not kv_bytes_check(bad, reused=False).ok  # type: ignore[union-attr]
    # the reuse scenario: every pair must differ; one that agrees fails it
    assert not kv_bytes_check(bad, reused=True).ok  # type: ignore[union-attr]
    wrong = [*good[:2], _kv("D", "p0-cc", "received", "y0"), _kv("D", "p1-dd", "received", "y1")]
    assert kv_bytes_check(wrong, reused=True).ok  # type: ignore[union-attr]
    # nothing to pair (pull: P's worker sends no digest) or ranks holding shares: no check
    assert kv_bytes_check(good[2:], reused=False) is None
    assert kv_bytes_check([_kv("P", "p0-aa", "sent", "x0", world=2), good[2]], False) is None
    # an unknown digest (None) never counts as the same KV
    unknown = [_kv("P", "p0-aa", "sent", None), _kv("D", "p0-cc", "received", None)]
    assert not kv_bytes_check(unknown, reused=False).ok  # type: ignore[union-attr]


def test_the_scheduler_hands_p_s_worker_the_blocks_of_what_it_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pull mode: the recording scheduler notes a finished request's blocks when it holds
    them for a transfer and puts them on the next step's metadata; the worker reads them
    beside push mode's own. Negative controls: a request freed at once (no delay), or a
    recording that asked for no digest, hands nothing."""
    conn = SimpleNamespace()
    monkeypatch.setenv(kv_digest.DIGEST_ENV, "1")
    kv_digest.note_finished(conn, "p0-a", [[3, 4]], delay=True)
    kv_digest.note_finished(conn, "local-b", [[5]], delay=False)
    meta = SimpleNamespace(push_finished_blocks={"p1-c": ([7],)})
    kv_digest.attach(conn, meta)
    assert kv_digest.finished_blocks(meta) == {"p0-a": [3, 4], "p1-c": ([7],)}
    later = SimpleNamespace()
    kv_digest.attach(conn, later)  # handed over once
    assert kv_digest.finished_blocks(later) == {}
    monkeypatch.delenv(kv_digest.DIGEST_ENV)
    kv_digest.note_finished(conn, "p2-d", [[9]], delay=True)
    kv_digest.attach(conn, later)
    assert kv_digest.finished_blocks(later) == {}


def test_pull_pairs_d_s_request_with_p_s_through_add_request() -> None:
    """Pull runs D's requests under D's own ids ("d0-..."); D's add_request names P's."""
    add = Event("D", "kv_both", "scheduler", 0, 1, 1, 0, 1, "add_request", reqs=("d0-x",),
                result={"remote_request_id": "p0-aa", "remote_prefill": True})  # fmt: skip
    events = [add, _kv("P", "p0-aa", "sent", "x0"), _kv("D", "d0-x", "received", "x0")]
    ok = kv_bytes_check(events, reused=False)
    assert ok is not None and ok.ok and "p0: P x0, D x0" in ok.detail
    assert kv_bytes_check(events[1:], reused=False) is None  # unnamed: "d0" is not "p0"


def test_a_failed_receive_is_no_receive_for_the_kv_bytes_check() -> None:
    """0.32 reports a failed receive in finished_recving too (pd-handshake-fail, make e2e
    2026-12-07: D digested its unwritten blocks and the check failed). Recorders since
    then digest no failed receive; older recordings' are left out by the check, as are
    receives a 0.29 rank names only by their load errors. Negative control: the same
    digest of a receive that did not fail fails the check."""
    from dataclasses import replace

    sent, got = _kv("P", "p0-aa", "sent", "x0"), _kv("D", "p0-cc", "received", "zeros")
    assert not kv_bytes_check([sent, got], reused=False).ok  # type: ignore[union-attr]
    both = {"failed_recving": ["p0-cc"], "finished_recving": ["p0-cc"]}
    report = replace(got, call="get_transfer_results", reqs=(), result=both)
    assert kv_bytes_check([sent, got, report], reused=False) is None
    errors = replace(got, call="load_errors", result={"block_ids": [1, 2]})
    assert kv_bytes_check([sent, got, errors], reused=False) is None
