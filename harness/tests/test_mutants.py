"""The mutation campaign: catalogue, exact undo, extension scripts, no false kill, and
known kills."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvspec.drivers.patches import PATCHES, target_owner
from kvspec.extensions import extension_traces, load_extensions
from kvspec.mutants import run_mutant, unmutated
from kvspec.mutations import FIXED, SHIPPED, Base, Mutant, patched
from kvspec.mutations.catalogue import MUTANTS
from kvspec.replay import INCORRECT


def _vllm() -> None:
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")


def test_catalogue_is_well_formed() -> None:
    assert len(MUTANTS) >= 12
    for name, m in MUTANTS.items():
        assert m.name == name
        p = m.patch
        assert p.description and "\n" not in p.description
        mod, sep, qual = p.target.partition(":")
        assert sep and mod.startswith("vllm.") and "." in qual, p.target
        assert p.origin
        assert m.base in (SHIPPED, FIXED)
        if m.base.impl_patch is not None:
            assert m.base.impl_patch in PATCHES
    # the bug history the brief names is covered
    origins = " ".join(m.patch.origin for m in MUTANTS.values())
    for bug in ("#58222", "#51786", "#25808", "#52779", "#53903", "#36549"):
        assert bug in origins


@pytest.mark.parametrize("variant", [SHIPPED.variant, FIXED.variant])
def test_extension_traces_follow_the_spec(variant: str) -> None:
    traces = extension_traces(variant)  # raises if an action is not enabled in the spec
    mine = [x.name for x in load_extensions() if variant in x.variants]
    assert [t.name.rsplit("/", 1)[1] for t in traces] == mine
    assert all(len(t.states) == len(t.actions) + 1 for t in traces)
    assert {t.row.name for t in traces if t.row.timing == "untimed"} == (
        {"x-v0.30-shipped-nixl-push-untimed-2req"} if variant == SHIPPED.variant else set()
    )
    # The offloading and push scripts run on the installed design only (the fix does not
    # touch them). The untimed push script's row keeps Timing = "untimed".
    offload = {
        "x-v0.30-shipped-offload-pcp1-2req",
        "x-v0.30-shipped-offload-pcp2-1req",
        "x-v0.30-shipped-nixl-push-pcp1",
        "x-v0.30-shipped-nixl-push-untimed-2req",
    }
    assert {t.row.name for t in traces} == {
        f"x-{variant}-nixl-pcp2-2req",
        f"x-{variant}-nixl-pcp2-async",
    } | (offload if variant == SHIPPED.variant else set())


def _script(tmp_path: Path, *actions: str, key: str = "actions") -> Path:
    """One [[extension]] on a fixed TP2 x PCP2 one-request row."""
    path = tmp_path / f"x{len(list(tmp_path.iterdir()))}.toml"
    path.write_text(
        '[defaults]\nvariants = ["fixed"]\nmodel = "m"\ncomposition = "nixl"\n'
        "topology = {tp = 2, pp = 1, pcp = 2}\nrequests = 1\ncapacity = 1\n"
        f'[[extension]]\nname = "a"\n{key} = {list(actions)!r}\n'.replace("'", '"')
    )
    return path


def test_extension_scripts_must_follow_the_spec(tmp_path: Path) -> None:
    # Ranks are numbered TP innermost: on TP2 x PCP2, w = pcp * TP + tp, so the consumer
    # reads from ranks 0 and 1 (pcp 0); rank 2 (tp 0, pcp 1) is a replica it never reads.
    step = ("schedule", "execute_model", "update_from_output")
    ok = _script(tmp_path, *step, "consumer_start_load_kv(1, 1)")
    (trace,) = extension_traces("fixed", ok)
    assert trace.name == "x-fixed-m/a" and trace.row.topology.world_size == 4
    assert extension_traces("v0.30-shipped", ok) == []
    replica = _script(tmp_path, *step, "consumer_start_load_kv(1, 2)")
    with pytest.raises(ValueError, match=r"consumer_start_load_kv\(1, 2\) is not enabled"):
        extension_traces("fixed", replica)
    with pytest.raises(ValueError, match="unknown key"):
        load_extensions(_script(tmp_path, *step, key="actoins"))
    with pytest.raises(ValueError, match="unknown action 'sched'"):
        load_extensions(_script(tmp_path, "sched"))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_apply_then_undo_restores_the_original(name: str) -> None:
    _vllm()
    m: Mutant = MUTANTS[name]
    owner, attr = target_owner(m.patch.target)
    before = vars(owner).get(attr)
    assert before is not None, f"{m.patch.target} is not defined on {owner.__name__}"
    impl = m.base.impl_patch
    base_targets = [target_owner(PATCHES[impl].target)] if impl else []
    base_before = [vars(o).get(a) for o, a in base_targets]
    with patched(m.base, m.patch):
        assert vars(owner).get(attr) is not before, "the mutant changed nothing"
    assert vars(owner).get(attr) is before
    assert [vars(o).get(a) for o, a in base_targets] == base_before
    # and twice in a row (no state left behind by the first application)
    with patched(m.base, m.patch):
        pass
    assert vars(owner).get(attr) is before


@pytest.mark.vllm
@pytest.mark.parametrize("base", [SHIPPED, FIXED], ids=lambda b: b.name)
def test_unmutated_vllm_passes_the_extension_traces(base: Base) -> None:
    """No false kill. The committed traces of both bases already run on the unmutated
    vLLM in the conformance suite (make test); the campaign's own extension traces don't."""
    _vllm()
    trace, div, crash = unmutated(base)
    assert (trace, div, crash) == (None, None, ""), f"false kill on {trace}: {div} {crash}"


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("name", "trace_prefix", "step"),
    [
        # extension traces run first: the handshake set differs at Init
        ("handshake-published-by-replicas", "x-v0.30-shipped-nixl-pcp2-2req/", 0),
        # expected = world_size - 1: rank 0's single report frees the request
        ("agg-expected-minus-one", "x-v0.30-shipped-nixl-pcp2-2req/", None),
        # only the async extension trace reaches a read before the lease (#25808)
        ("notif-before-metadata-dropped", "x-v0.30-shipped-nixl-pcp2-async/", None),
        # the reused block's job is not flushed: flush, fence and clobbered differ
        ("offload-fence-dropped", "x-v0.30-shipped-offload-pcp1-2req/", None),
        # rank 1's acks are lost: pending_count stays at 1
        ("offload-replica-never-acks", "x-v0.30-shipped-offload-pcp2-1req/", None),
        # the WRITE in flight is reported done at once: freed under the WRITE
        ("push-reports-on-post", "x-v0.30-shipped-nixl-push-pcp1/", None),
        # Timing untimed: the WRITE outlives its lease; reported again at step 15 (14 before
        # the lazy handshake: a rank's first WRITE is push_match, push_deferred)
        ("push-expired-write-reported", "x-v0.30-shipped-nixl-push-untimed-2req/", 15),
        # #58188's regression: the WRITE lands, P does not report the request (its lease will)
        ("push-success-unreported", "x-v0.30-shipped-nixl-push-pcp1/", 14),
    ],
)
def test_mutant_is_killed(name: str, trace_prefix: str, step: int | None) -> None:
    _vllm()
    m = MUTANTS[name]
    # Only the trace family that must kill it (the campaign's order is `make review`'s).
    traces = [t for t in extension_traces(m.base.variant) if t.name.startswith(trace_prefix)]
    assert traces, trace_prefix
    out = run_mutant(m, traces=traces)
    assert out.killed, f"{name} survived"
    assert out.failure_class == INCORRECT
    assert out.trace is not None and out.trace.startswith(trace_prefix), out.trace
    if step is not None:
        assert out.step == step


def test_cli_unknown_mutant_and_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    from kvspec.cli import build_parser, main

    assert main(["mutants", "--only", "no-such-mutant"]) == 2
    assert "unknown mutant(s) no-such-mutant" in capsys.readouterr().err
    assert build_parser().parse_args(["mutants", "--verbose"]).verbose
    assert not build_parser().parse_args(["review"]).verbose


def test_a_wait_that_expired_is_inconclusive_not_a_kill_nor_a_survival(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A mutant run stopped by an expired wait decides nothing (project rule); a crash is
    still a kill (negative control)."""
    import contextlib

    from kvspec import mutants

    monkeypatch.setattr(mutants, "patched", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(
        mutants, "run_traces",
        lambda ts, dev: ("m/003", None, "inconclusive: the READ did not happen in 120s"),
    )  # fmt: skip
    mutant = next(iter(MUTANTS.values()))
    out = run_mutant(mutant, traces=[])
    assert (out.killed, out.failure_class, out.trace) == (False, "inconclusive", "m/003")
    assert "did not happen" in out.detail
    monkeypatch.setattr(mutants, "run_traces", lambda ts, dev: ("m/003", None, "KeyError: 1"))
    assert run_mutant(mutant, traces=[]).killed


@pytest.mark.vllm
def test_lease_mutants_are_killed_by_the_lease_counterexamples() -> None:
    """The campaign's last traces are LeaseClock's counterexamples on the lease driver: a
    heartbeat that extends by the whole lease changes a ttl the spec predicts."""
    _vllm()
    out = run_mutant(MUTANTS["heartbeat-full-lease"], traces=[])
    assert out.killed and out.failure_class == INCORRECT
    assert out.trace is not None and out.trace.startswith("lease/"), out.trace


@pytest.mark.vllm
def test_a_cluster_that_does_not_reset_makes_the_run_inconclusive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pooled cluster whose reset wait expires while a mutant's driver is built (seen:
    the push writer under a push mutant) stops that run undecided and drops the pool; it
    used to end the whole campaign."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from kvspec import mutants
    from kvspec.drivers import cluster_pool, vllm_driver
    from kvspec.drivers.base import WaitTimeout

    def stuck(*a: object, **k: object) -> None:
        raise WaitTimeout("the push writer to drop the previous trace's blocks", 120.0)

    dropped: list[bool] = []
    monkeypatch.setattr(vllm_driver, "VllmDriver", stuck)
    monkeypatch.setattr(cluster_pool, "shutdown_pool", lambda: dropped.append(True))
    t = SimpleNamespace(name="m/007", row=None)
    name, div, detail = mutants.run_traces([t])  # type: ignore[list-item]
    assert (name, div, dropped) == ("m/007", None, [True])
    assert detail.startswith(mutants.INCONCLUSIVE) and "push writer" in detail
