"""Prefix caching in the real-engine scenarios (vLLM's default, on): the engines run it
unless a scenario turns it off, the local reference never reuses the KV D received, and
pd-d-prefix-hit's D, holding request 1's first block, receives only the rest; the KV
check then compares D's blocks with the tail of P's."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from kvspec.record.log import Event
from kvspec.scenario import SCENARIOS, ScenarioResult
from kvspec.scenario_checks import prefix_hit_check, same_kv
from kvspec.scenario_engine import engine_args, parser
from kvspec.scenario_flows import LOCAL_SALT, _one_pair, prompts, warm_prefix
from kvspec.scenario_proc import EngineProc

# A fake engine: logs each command (tag, salt, prompts) to stderr and answers every prompt
LOGS = [sys.executable, "-c", (
    "import json, sys\n"
    "while True:\n"
    "    cmd = json.loads(input())\n"
    "    print(json.dumps([cmd['tag'], cmd.get('salt'), cmd['prompts']]), file=sys.stderr,"
    " flush=True)\n"
    "    qs = cmd.get('params') or [{'from': cmd['tag']}] * len(cmd['prompts'])\n"
    "    print(json.dumps({'outputs': [{'tokens': [1], 'params': q} for q in qs]}),"
    " flush=True)\n"
)]  # fmt: skip


def _args(*extra: str) -> dict[str, object]:
    a = parser().parse_args(["--model", "/nonexistent", "--engine-id", "P", "--dtype",
                             "float32", *extra])  # fmt: skip
    return engine_args(a)


def test_engines_run_vllms_prefix_caching_default_unless_turned_off() -> None:
    """No enable_prefix_caching argument: vLLM's default decides (on for a generating
    model, arg_utils.py:3021-3022). Negative control: --no-prefix-caching sets it off."""
    assert "enable_prefix_caching" not in _args()
    assert _args("--no-prefix-caching")["enable_prefix_caching"] is False


def _commands(tmp_path: Path, name: str) -> list[list[object]]:
    sc = SCENARIOS[name]
    engines = [EngineProc(LOGS, {}, tmp_path / f"{e}.log", grace_s=0.1) for e in "PD"]
    try:
        _one_pair(sc, engines, prompts(2), ScenarioResult(sc.name, "inconclusive", 0.0), 60)
    finally:
        for e in engines:
            e.close()
    # (then the fake's EOFError at close)
    return [
        json.loads(x) for x in (tmp_path / "D.log").read_text().splitlines() if x.startswith("[")
    ]


@pytest.mark.parametrize(("name", "tag"), [("pd-d-prefix-hit", "d"),
                                          ("pd-push-d-prefix-hit", "p")])  # fmt: skip
def test_the_local_reference_is_salted_and_a_prefix_hit_warms_d_first(
    tmp_path: Path, name: str, tag: str
) -> None:
    """D's commands in order: the warm prompt, sharing request 1's first 32 tokens and no
    more; the P/D requests (push: under P's ids); the local reference under LOCAL_SALT,
    so its prompts hash apart from the blocks D received. Negative control: pd-basic
    warms nothing."""
    ps = prompts(2)
    (warm, _, [w]), (pd, salt, _), (ref, ref_salt, _) = _commands(tmp_path, name)
    assert (warm, pd, salt, ref, ref_salt) == ("warm", tag, None, "local", LOCAL_SALT)
    assert w == warm_prefix(ps)[0] and w[:32] == ps[0][:32] and w[32] != ps[0][32]
    assert len(w) == len(ps[0]) and not any(w[:33] == p[:33] for p in ps)
    basic = tmp_path / "basic"
    basic.mkdir()
    assert [c[0] for c in _commands(basic, "pd-basic")] == ["d", "local"]


def _kv(rid: str, side: str, blocks: list[str | None], whole: str | None = "w") -> Event:
    return Event("P" if side == "sent" else "D", "kv_both", "worker", 0, 1, 1, 0, 1,
                 "kv_digest", reqs=(rid,), result={"side": side, "digest": whole,
                                                   "blocks": len(blocks),
                                                   "per_block": blocks})  # fmt: skip


def test_a_receive_after_a_local_hit_is_compared_with_the_tail_of_ps_blocks() -> None:
    """D with a local prefix hit receives the blocks after it (base_worker.py:3333-3337):
    its digest is of fewer blocks than P's, so the blocks are compared one by one with
    P's last ones. Negative controls: another last block, a receive whose blocks are
    unknown, and (whole receives) another digest fail it."""
    sent = _kv("p0-a", "sent", ["b0", "b1"])
    assert same_kv(sent, _kv("d0-b", "received", ["b1"], whole="other"))
    assert not same_kv(sent, _kv("d0-b", "received", ["b0"]))
    assert not same_kv(sent, _kv("d0-b", "received", [None]))
    assert same_kv(sent, _kv("d0-b", "received", ["x", "y"], whole="w"))
    assert not same_kv(sent, _kv("d0-b", "received", ["b0", "b1"], whole="v"))
    assert not same_kv(
        _kv("p0-a", "sent", ["b0", "b1"], whole=None),
        _kv("d0-b", "received", ["b0", "b1"], whole=None),
    )


def _add(rid: str, remote: str) -> Event:
    return Event("D", "kv_both", "scheduler", 0, 1, 1, 0, 1, "add_request", reqs=(rid,),
                 result={"remote_request_id": remote})  # fmt: skip


def test_the_prefix_hit_check_wants_one_block_fewer_for_request_1_only() -> None:
    """Negative controls: D received all of request 1's blocks (no hit), or fewer of
    request 2's (a hit the scenario did not stage)."""

    def run(n0: int, n1: int) -> bool:
        return prefix_hit_check([
            _add("d0-x", "p0-a"), _add("d1-y", "p1-b"),
            _kv("p0-a", "sent", ["a", "b"]), _kv("p1-b", "sent", ["c", "d"]),
            _kv("d0-x", "received", ["b", "a"][:n0]), _kv("d1-y", "received", ["c", "d"][:n1]),
        ]).ok  # fmt: skip

    assert run(1, 2)
    assert not run(2, 2)
    assert not run(1, 1)


def test_a_prefix_hit_needs_prefix_caching_and_one_pair() -> None:
    with pytest.raises(ValueError, match="prefix hit"):
        dataclasses.replace(SCENARIOS["pd-d-prefix-hit"], prefix_caching=False)
    with pytest.raises(ValueError, match="prefix hit"):
        dataclasses.replace(SCENARIOS["pd-d-prefix-hit"], late=True, lease=6)


def _finished(rid: str, ids: list[int], delay: bool = True) -> Event:
    result = {"delay": delay, "blocks": len(ids), "block_ids": ids}
    return Event("P", "kv_both", "scheduler", 0, 1, 1, 0, 1, "request_finished",
                 reqs=(rid,), result=result)  # fmt: skip


def test_the_shared_block_check_wants_request_2s_first_block_to_be_request_1s() -> None:
    """Negative controls: two blocks of their own each (no hit), or the same second block
    (not a prefix: a bookkeeping error)."""
    from kvspec.scenario_checks import shared_block_check

    assert shared_block_check([_finished("p0_0", [5, 6]), _finished("p1_0", [5, 7])]).ok
    assert not shared_block_check([_finished("p0_0", [5, 6]), _finished("p1_0", [8, 7])]).ok
    assert not shared_block_check([_finished("p0_0", [5, 6]), _finished("p1_0", [5, 6])]).ok


def test_a_shared_prefix_gives_p_the_prompts_one_at_a_time(tmp_path: Path) -> None:
    """P gets request 1, then (its answer back: request 1 prefilled and held) request 2,
    whose first 32 tokens are request 1's; D gets both at once."""
    from kvspec.scenario_flows import shared_prompts

    ps = shared_prompts(prompts(2))
    assert ps[1][:32] == ps[0][:32] and ps[1][32:] == prompts(2)[1][32:]
    sc = SCENARIOS["pd-shared-prefix"]
    engines = [EngineProc(LOGS, {}, tmp_path / f"{e}.log", grace_s=0.1) for e in "PD"]
    try:
        _one_pair(sc, engines, ps, ScenarioResult(sc.name, "inconclusive", 0.0), 60)
    finally:
        for e in engines:
            e.close()
    p_cmds = [json.loads(x) for x in (tmp_path / "P.log").read_text().splitlines()
              if x.startswith("[")]  # fmt: skip
    assert [(t, len(q)) for t, _, q in p_cmds] == [("p0_", 1), ("p1_", 1)]
    with pytest.raises(ValueError, match="shared prefix"):
        dataclasses.replace(sc, requests=3)


@pytest.mark.parametrize("on", [True, False])
def test_the_recorders_start_event_says_whether_prefix_caching_is_on(on: bool) -> None:
    """A user's recording says whether its decode engine may hold part of a prompt."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from kvspec.record.describe import describe

    cfg = NS(parallel_config=NS(tensor_parallel_size=1, pipeline_parallel_size=1),
             scheduler_config=NS(async_scheduling=False), model_config=NS(use_mla=False),
             kv_transfer_config=NS(), cache_config=NS(enable_prefix_caching=on))  # fmt: skip
    assert describe(object(), cfg)["prefix_caching"] is on
