"""Decode.tla's traces on vLLM's real decode engine (drivers/decode_driver.py): the
installed 0.32 conforms step for step, a corrupted trace diverges where it was corrupted
(the negative control of the comparison), and each decode-side bug of the history,
re-introduced in memory, is killed by a trace."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("nixl")

from kvspec.decode_traces import (  # noqa: E402
    driver_for,
    replay,
    replay_with_retry,
    suite,
    trace_from_counterexample,
)
from kvspec.drivers.decode_driver import DecodeDriver  # noqa: E402
from kvspec.drivers.full_hit import full_hits  # noqa: E402
from kvspec.drivers.vllm_adapters import aborted_kv_loads  # noqa: E402
from kvspec.mutants import run_mutant  # noqa: E402
from kvspec.mutations.catalogue import MUTANTS  # noqa: E402

DECODE_MUTANTS = sorted(n for n, m in MUTANTS.items() if m.family == "decode")


def _traces(row: str) -> list[tuple[str, object, list[tuple[str, dict[str, object]]]]]:
    return suite("full", frozenset([row]))  # type: ignore[return-value]


# Rows replayed as an even sample of about this many traces (MLA: 249 traces, 17 s).
SAMPLED = {"conf-decode-p2-d1-mla": 40}


@pytest.mark.parametrize(
    "row",
    [
        "conf-decode-d1-fail",
        pytest.param("conf-decode-d1-multi", marks=pytest.mark.slow),
        pytest.param("conf-decode-d1-fail-sync", marks=pytest.mark.slow),
        pytest.param("conf-decode-d1-recompute", marks=pytest.mark.slow),
        pytest.param("conf-decode-d2-fail", marks=pytest.mark.slow),
        pytest.param("conf-decode-p2-d1-fail", marks=pytest.mark.slow),
        pytest.param("conf-decode-p1-d2-fail", marks=pytest.mark.slow),
        "conf-decode-d1-fail-instep",
        pytest.param("conf-decode-p1-d2-fail-instep", marks=pytest.mark.slow),
        "conf-decode-d1-first-contact",
        "conf-decode-d1-first-contact-hs-fails",
        pytest.param("conf-decode-p1-d2-first-contact", marks=pytest.mark.slow),
        "conf-decode-p2-d1-mla",  # the unmutated control of decode-mla-notify-local-id
        pytest.param("conf-decode-p2-d1-mla-recompute", marks=pytest.mark.slow),
        pytest.param("conf-decode-p1-d2-mla", marks=pytest.mark.slow),
        # (make test keeps one full-hit trace with its negative control, the first-contact
        # counterexample and the #56640 mutant; every trace in `make test-full`)
        pytest.param("conf-decode-d1-full-hit-sync", marks=pytest.mark.slow),
        pytest.param("conf-decode-d1-full-hit", marks=pytest.mark.slow),
    ],
)
def test_the_installed_decode_engine_conforms(row: str) -> None:
    traces = _traces(row)
    assert traces
    if row in SAMPLED:  # an even sample in make test; every trace in `kvspec decode --conform`
        traces = traces[:: max(1, len(traces) // SAMPLED[row])]
    inconclusive = []
    for name, srow, trace in traces:
        # A wait that expires twice is inconclusive (a loaded machine), never a verdict.
        res = replay_with_retry(trace, driver_for(srow, trace))  # type: ignore[arg-type]
        assert res.divergence is None, (name, res)
        if res.timeout is not None:
            inconclusive.append(f"{name}: {res.timeout}")
    if inconclusive:
        pytest.skip(f"inconclusive (waits expired): {'; '.join(inconclusive[:3])}")


@pytest.mark.parametrize(
    "row", ["conf-decode-p2-d1-mla", pytest.param("conf-decode-p1-d2-mla", marks=pytest.mark.slow)]
)
def test_mla_rows_conform_with_amx_mla(row: str) -> None:
    """vLLM's MLA backend on an AMX host, AMX_MLA in bfloat16 (one kernel block per block,
    vllm_caches.amx_tiles makes any host lay it out so), admits the MLA decode traces
    too: the verdicts above do not rest on CPU_MLA's kernel split (an even sample of 10
    in make test; every trace with -m slow)."""
    traces = _traces(row)
    if row in SAMPLED:
        traces = traces[:: max(1, len(traces) // 10)]
    for name, srow, trace in traces:
        res = replay_with_retry(trace, driver_for(srow, trace, mla="mla-amx"))  # type: ignore[arg-type]
        assert res.divergence is None, (name, res)
        if res.timeout is not None:
            pytest.skip(f"inconclusive (waits expired): {name}: {res.timeout}")


def test_a_full_hit_is_vllms_own_prefix_lookup_and_reads_nothing() -> None:
    """A trace whose request D admits as a full local hit (full_hit.py: an MTP drafter with
    its block drop off, prefix caching on, the prompt run once on D before): it runs at
    once, D READs nothing and P is notified, step for step. Negative control: the same
    trace with D's prefix cache left empty diverges at the schedule that admits it (vLLM
    finds no local hit, awaits the request and parks it)."""
    name, row, trace = next(t for t in _traces("conf-decode-d1-full-hit-sync")
                            if full_hits(t[2]) and len(t[2]) > 3)  # type: ignore[arg-type]  # fmt: skip
    res = replay_with_retry(trace, driver_for(row, trace))  # type: ignore[arg-type]
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is None, (name, res)
    with DecodeDriver(row) as d:  # type: ignore[arg-type]
        res = replay(trace, d)  # type: ignore[arg-type]
    first = next(i for i, (a, _) in enumerate(trace) if a == "schedule")
    assert res.divergence is not None and res.steps == first - 1, res
    assert "(schedule)" in res.divergence and "aw" in res.divergence, res.divergence


def test_0_32_diverges_from_0_29s_design_at_the_registered_cleanup() -> None:
    """0.29 registers every receive entry, an aborted request's notify-only cleanup
    included, and never pops it (Decode.tla Registered): 0.32 registers only awaited
    entries, so it diverges from 0.29's design at `reg`, on an execute step, and only
    there: a trace without such a cleanup conforms to both (0.29's own venv conforms to
    every trace of the row: README, "0.29's decode side")."""
    diverged, conformed = None, 0
    for name, srow, trace in _traces("conf-decode-d1-fail-v0.29"):
        res = replay_with_retry(trace, driver_for(srow, trace))  # type: ignore[arg-type]
        if res.divergence is not None and diverged is None:
            diverged = (name, res.divergence)
        conformed += res.divergence is None and res.timeout is None
        if diverged is not None and conformed:
            break
    assert diverged is not None, "0.32 conformed to 0.29's design"
    assert "(execute): reg:" in diverged[1], diverged
    assert conformed, "no trace of 0.29's design conforms on 0.32: more than `reg` differs"


def test_negative_control_a_wrong_state_diverges() -> None:
    name, row, trace = next(t for t in _traces("conf-decode-d1-fail") if len(t[2]) > 4)
    bad = copy.deepcopy(trace)
    bad[3][1]["crashed"] = True
    with DecodeDriver(row) as d:  # type: ignore[arg-type]
        res = replay(bad, d)
    assert res.divergence is not None and res.divergence.startswith("step 3"), (name, res)


def test_plain_attention_p_tp_above_kv_heads_is_refused_at_the_handshake() -> None:
    # Decode.tla assumes at least P TP KV heads: for a plain attention model vLLM refuses
    # P TP > KV heads with D TP < P TP (base_worker.py:2445-2451, an assert inside the
    # handshake), so GQA dedup never leaves a producer rank unread. One KV head at P TP 2,
    # D TP 1: the real handshake fails. Negative control: two heads, the same TPs, builds.
    from kvspec.drivers.base import WaitTimeout
    from kvspec.drivers.vllm_driver import VllmDriver
    from kvspec.drivers.vllm_inbox import ClusterError
    from kvspec.matrix import ModelRow, Topology

    prow = ModelRow("p2", "v0.30-shipped", "nixl", Topology(2, 1, 1), 1, 1, False)
    try:  # the side channel's reply may time out on a loaded machine: inconclusive
        with pytest.raises(ClusterError, match="handshake"):
            VllmDriver(prow, decode_tp=1, model="kv1").close()
        VllmDriver(prow, decode_tp=1, model="kv2").close()
    except WaitTimeout as exc:
        pytest.skip(f"inconclusive: {exc}")


@pytest.mark.parametrize("name", DECODE_MUTANTS)
def test_each_decode_mutant_is_killed(name: str) -> None:
    out = run_mutant(MUTANTS[name])
    if name == "decode-full-hit-parked":
        # 0.32 guards #56640's mechanism itself: an async load with no external token
        # trips `assert num_external_computed_tokens > 0` (scheduler.py:1111), which
        # would kill EngineCore at once instead of stalling the request silently.
        assert out.killed and out.failure_class == "crash", out
        assert (out.detail or "").startswith("AssertionError"), out
        return
    assert out.killed and out.failure_class == "incorrect state", out


def test_negative_control_a_read_kept_past_its_step_diverges() -> None:
    # The same trace with the driver told nothing of the in-step end (the READ stays in
    # progress at the poll): the step that should report the request does not.
    name, row, trace = next(
        t
        for t in _traces("conf-decode-d1-fail-instep")
        if any(a.startswith("execute(") and a.endswith(".done)") for a, _ in t[2])
    )
    at = next(i for i, (a, _) in enumerate(trace) if a.startswith("execute("))
    plain = [("execute" if i == at else a, st) for i, (a, st) in enumerate(trace)]
    with DecodeDriver(row) as d:  # type: ignore[arg-type]
        res = replay(plain, d)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is not None and res.divergence.startswith(f"step {at}"), (name, res)


FIRST_CONTACT = Path(__file__).resolve().parents[2] / "conformance" / "decode"


def _matrix_row(name: str) -> object:
    from kvspec.decode import DECODE
    from kvspec.sweep import load_sweep_matrix

    return next(r for r in load_sweep_matrix(DECODE) if r.name == name)


def _first_contact_counterexample(
    name: str, row_name: str, full: bool
) -> tuple[object, list[tuple[str, dict[str, object]]]]:
    """Replay ProducerNotified's committed counterexample `name` on the real engine, then
    let the handshake complete: the notify-only entry waits for a next step D never takes,
    and P never hears of the request (its blocks go only with the lease)."""
    doc = json.loads((FIRST_CONTACT / f"{name}.itf.json").read_text())
    trace = trace_from_counterexample(doc)
    row = _matrix_row(row_name)
    hits = full_hits(trace) if full else frozenset()
    with DecodeDriver(row, full_hits=hits) as d:  # type: ignore[arg-type]
        res = replay(trace, d)
        if res.timeout is not None:
            pytest.skip(f"inconclusive: {res.timeout}")
        assert res.divergence is None, res
        d.handshake_done(0)  # the handshake completes: the entry waits for a next step
        assert d.observe()["rdy"] == {0: frozenset({(1, False)})}
        assert d.p.c.inboxes[0].take_arrived(b"req-1:1") is None  # P never heard of it
    return row, trace


def test_first_contact_leaves_the_abort_notification_queued_and_p_waits_for_its_lease() -> None:
    # ProducerNotified's counterexample (spec/decode-matrix.toml p1-d1-first-contact-abort)
    # on the real engine: the aborted request's notify-only entry waits for the handshake,
    # D has nothing to run, and P's blocks go only when the lease does.
    _first_contact_counterexample(
        "first-contact-abort-ProducerNotified", "p1-d1-first-contact-abort", full=False
    )


def test_first_contact_leaves_a_full_hits_notification_queued_and_p_waits_for_its_lease() -> None:
    # The same finding's other case, now driven (full_hit.py: the deployment where 0.32
    # takes a full hit): D runs the full-hit request at once, its notify-only entry waits
    # for the handshake, the request completes, D idles, P frees only at the lease.
    row, trace = _first_contact_counterexample(
        "first-contact-full-hit-ProducerNotified", "p1-d1-first-contact-full-hit", full=True
    )
    assert full_hits(trace) == {1} and not any(a.startswith("abort") for a, _ in trace)
    # Negative control: without the full hit (D's prefix cache empty) the request is
    # awaited and parked instead, at the first schedule.
    with DecodeDriver(row) as d:  # type: ignore[arg-type]
        res = replay(trace, d)
    assert res.divergence is not None and res.divergence.startswith("step 1 (schedule)"), res


def test_negative_control_handshaken_d_notifies_and_the_lease_step_is_refused() -> None:
    # The same steps with D handshaken (steady state; the trace says so too): the execute
    # sends the notify-only message at once (pin), where the counterexample's is queued.
    doc = json.loads((FIRST_CONTACT / "first-contact-abort-ProducerNotified.itf.json").read_text())
    row = _matrix_row("p1-d1-first-contact-abort")
    steady = dataclasses.replace(row, consts={**row.consts, "Handshake": False})  # type: ignore[type-var]
    trace = [(a, {**st, "hsd": {0: "done"}}) for a, st in trace_from_counterexample(doc)]
    with DecodeDriver(steady) as d:  # type: ignore[arg-type]
        res = replay(trace, d)
    if res.timeout is not None:
        pytest.skip(f"inconclusive: {res.timeout}")
    assert res.divergence is not None and res.divergence.startswith("step 3"), res


def test_a_release_without_the_background_handshake_leaves_first_contact_not_driven(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A vLLM whose NIXL worker lacks the deferral path (probed, as an older release would
    # be): its first-contact rows get no verdict, and say why.
    from kvspec.cli import main
    from kvspec.drivers.decode_seams import HeldHandshake

    monkeypatch.setattr(HeldHandshake, "NEEDS", (*HeldHandshake.NEEDS, "_not_in_any_release"))
    rc = main(["decode", "--conform", "--only", "conf-decode-d1-first-contact"])
    out = capsys.readouterr().out
    assert rc == 0 and "conf-decode-d1-first-contact: not driven" in out
    assert "_not_in_any_release" in out


def test_the_load_cap_row_is_driven_where_vllm_has_the_option() -> None:
    # vLLM 0.34's --max-num-inflight-kv-loads (Decode.tla LoadCap). Before 0.34 there is no
    # such option: the row is not driven, and says why. On 0.34 its traces conform, and the
    # same traces on D with the cap unset diverge at a schedule (the negative control:
    # measured 272 of 402 diverge, kvspec versions' 0.34 venv; the async row's 834 of
    # 1,142).
    from kvspec.decode_traces import conform_rows
    from kvspec.drivers.vllm_adapters import has_load_cap
    from kvspec.drivers.vllm_env import DriverUnavailable

    if not has_load_cap():  # refused before any engine is built, and before TLC runs
        row = next(r for r in conform_rows() if r.name == "conf-decode-d1-load-cap")
        with pytest.raises(DriverUnavailable, match="max-num-inflight-kv-loads"):
            DecodeDriver(row)
        return
    name, row, trace = _traces("conf-decode-d1-load-cap")[2]  # the 2nd waits for the 1st
    res = replay_with_retry(trace, driver_for(row, trace))  # type: ignore[arg-type]
    uncapped = dataclasses.replace(row, consts={**row.consts, "LoadCap": 0})  # type: ignore[type-var]
    ctl = replay_with_retry(trace, driver_for(uncapped, trace))  # type: ignore[arg-type]
    if res.timeout or ctl.timeout:
        pytest.skip(f"inconclusive: {res.timeout or ctl.timeout}")
    assert res.divergence is None, (name, res)
    assert ctl.divergence is not None and "(schedule)" in ctl.divergence, ctl


def test_aborted_loads_are_compared_where_the_scheduler_keeps_them() -> None:
    # Decode.tla's abl is vLLM 0.34's _aborted_kv_loads (LoadRoom). On 0.34 an abort of a
    # load whose receive is outstanding puts it there, the trace conforms, and the same
    # trace with abl emptied at that step diverges at abl (measured on 0.34: 254 of the
    # 504 traces of conf-decode-d1-fail and -d1-load-cap pass through a non-empty abl).
    # Before 0.34 the scheduler has no such set: the driver does not observe it.
    name, row, trace = next(t for t in _traces("conf-decode-d1-fail")
                            if any(s.get("abl") for _, s in t[2]))  # fmt: skip
    at = next(k for k, (_, s) in enumerate(trace) if s.get("abl"))
    with DecodeDriver(row) as d:  # type: ignore[arg-type]
        if aborted_kv_loads(d.d) is None:
            assert "abl" not in d.observe()
            return
    res = replay_with_retry(trace, driver_for(row, trace))  # type: ignore[arg-type]
    bad = copy.deepcopy(trace)
    bad[at][1]["abl"] = frozenset()
    ctl = replay_with_retry(bad, driver_for(row, bad))  # type: ignore[arg-type]
    if res.timeout or ctl.timeout:
        pytest.skip(f"inconclusive: {res.timeout or ctl.timeout}")
    assert res.divergence is None, (name, res)
    assert ctl.divergence is not None and f"step {at} " in ctl.divergence, ctl
    assert "abl:" in ctl.divergence, ctl
