"""`kvspec scenario NAME`: real vLLM engines (one process each, kvspec.scenario_engine) run a
prefill/decode exchange over NIXL with recording connectors; the recording is validated
against the spec (kvspec.validate; each producer on its own where there are several) and
the end state is checked: every engine's free blocks are back to their baseline (not a
producer the scenario killed) and the decode outputs equal a local run of the same
prompts. How requests travel between the engines: kvspec.scenario_flows.

Every wait on an engine has a deadline; one that passes is a timeout, and the scenario is
then "inconclusive", never "fail" (a loaded machine is not a bug); so is an engine killed by
a signal. An engine that exits by itself crashed: the scenario fails, naming its error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from kvspec.record.kv_digest import DIGEST_ENV
from kvspec.record.log import DIR_ENV, FAULT_ENV, Event, read_dir
from kvspec.record.mapping import Sides, validation_sides
from kvspec.scenario_catalogue import MODEL_CONFIGS, SCENARIOS, Scenario
from kvspec.scenario_checks import (
    backend_check,
    heartbeat_chances,
    kv_bytes_check,
    prefix_hit_check,
    shared_block_check,
)
from kvspec.scenario_flows import (
    Check,
    ScenarioResult,
    _crash_mid_read,
    _one_pair,
    _restart,
    _xpyd,
    failed_read_s,
    free_port,
    frees_of,
    go_file,
    heartbeat_extended,
    held_after_d_finished,
    prompts,
    shared_prompts,
    wait_until,
    writes_after_free,
)
from kvspec.scenario_proc import EngineExited, EngineProc, EngineTimeout
from kvspec.scenario_weights import write_checkpoint
from kvspec.validate import validate_events


def _engine(sc: Scenario, eid: str, model: Path, rec: Path, logs: Path,
            cmd: list[str] | None, grace_s: float, port: int = 0) -> EngineProc:  # fmt: skip
    """Engine `eid`'s process; `port`: its NIXL side channel (0: a free one)."""
    env = {**os.environ, DIR_ENV: str(rec),
           "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port or free_port()),
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
           DIGEST_ENV: "1",  # the recorder's kv_digest events (the KV-bytes check)
           # vLLM logs to stdout by default; stdout is the engine's answer channel
           "VLLM_LOGGING_STREAM": "ext://sys.stderr",
           # one compute thread per engine, unbound: two engines share the machine
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
    if sc.p_crash_mid_read:
        # UCX over TCP, as between hosts without RDMA: a READ then needs P's progress, so
        # it stays in flight while P hangs. With UCX's shared-memory transports D may read
        # a stopped P's memory by itself (measured: one pd-p-hang READ ended in 20 ms)
        env["UCX_TLS"] = "tcp"
    args = cmd or [sys.executable, "-m", "kvspec.scenario_engine"]

    args = [*args, "--model", str(model), "--engine-id", eid, "--connector", sc.connector,
            "--tp", str(sc.tp_of(eid)), "--lease", str(sc.lease),
            "--device", sc.device,
            "--child", sc.child, *(["--sync"] if sc.sync else []),
            *([] if sc.prefix_caching else ["--no-prefix-caching"]),
            # each engine's ExampleConnector gets a fresh directory of its own: D's child
            # then finds nothing P stored (Decode.tla's multi-nixl-example)
            "--storage", str(logs / f"example-{eid}")]  # fmt: skip
    if eid.startswith("P") and sc.pcp > 1:
        args += ["--pcp", str(sc.pcp)]
    if eid.startswith("D") and sc.queued:
        args += ["--max-seqs", "1"]
    blocks = (sc.kv_blocks if eid.startswith("P") else sc.d_kv_blocks) or sc.pool_blocks
    if blocks:
        args += ["--num-blocks", str(blocks)]
    if eid.startswith("D") and sc.load_policy:
        args += ["--load-failure", sc.load_policy]
    if eid.startswith("P") and (sc.p_handshake_fails or sc.p_handshake_late):
        args += ["--connector-module", "kvspec.record.faults"]  # it stages them
    if eid.startswith("P") and sc.p_handshake_late:
        env[FAULT_ENV] = f"late:{sc.lease or 30}" + (f":{go_file(logs)}" if sc.p_reuse else "")

    return EngineProc(args, env, logs / f"{eid}.log", grace_s)


def _count(rec: Path, glob: str, call: str) -> int:
    """Events of `call` in the recording files matching glob. Polled every 0.5 s while an
    engine busy-loops (~300 events/s): count lines, do not parse the whole recording."""
    return "".join(f.read_text() for f in rec.glob(glob)).count(f'"call": "{call}"')


def run_scenario(sc: Scenario, out: Path, *, start_s: float = 600, step_s: float = 300,
                 engine_cmd: list[str] | None = None,
                 grace_s: float = 10) -> ScenarioResult:  # fmt: skip
    t0 = time.monotonic()
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIGS[sc.model]))
    if engine_cmd is None:  # real engines: seeded weights whose decode sees the KV
        write_checkpoint(model, MODEL_CONFIGS[sc.model])
    rec = out / "record"
    for f in [*rec.glob("*.ndjson"), go_file(out)]:
        f.unlink(missing_ok=True)
    p_ids, d_ids = sc.engine_ids()
    for eid in p_ids + d_ids:  # the ExampleConnector children's stores (MultiConnector)
        shutil.rmtree(out / f"example-{eid}", ignore_errors=True)
    res = ScenarioResult(sc.name, "inconclusive", 0.0)
    port = free_port()  # P's side channel: a restarted P (P2) binds it again
    first = [eid for eid in p_ids + d_ids if not (sc.p_restart and eid == "P2")]
    engines = [_engine(sc, eid, model, rec, out, engine_cmd, grace_s, port if eid == "P" else 0)
               for eid in first]  # fmt: skip

    def frees(glob: str = "P*-scheduler-*.ndjson") -> int:
        return _count(rec, glob, "free_blocks")

    try:
        for e in engines:
            e.ask(None, start_s)  # the "ready" line
        ps = shared_prompts(prompts(sc.requests)) if sc.shared_prefix else prompts(sc.requests)
        if sc.p_crash_mid_read:
            _crash_mid_read(sc, engines, ps, res, step_s, lambda: frees("P-scheduler-*.ndjson"),
                            lambda call: _count(rec, "D-worker-*.ndjson", call))  # fmt: skip
        elif sc.p_restart:
            _restart(sc, engines, ps, res, step_s, start_s, lambda: _engine(
                sc, "P2", model, rec, out, engine_cmd, grace_s, port),
                lambda: frees("P-scheduler-*.ndjson"))  # fmt: skip
        elif len(p_ids) > 1 or len(d_ids) > 1:
            _xpyd(sc, engines[:len(p_ids)], engines[len(p_ids):], ps, res, step_s)
        else:
            _one_pair(sc, engines, ps, res, step_s, lambda: frees("P-scheduler-*.ndjson"),
                      lambda: _count(rec, "P-worker-*.ndjson", "write"), go_file(out))
        # every request freed, but the one a crashed producer held
        # (and the requests that nudged a late-WRITEing P, or reused its blocks: at their lease)
        want = (sc.requests - len(sc.abort)) * sc.p_n - sc.p_crashes + (
            sc.p_reuse or int(sc.p_handshake_late))
        if not wait_until(lambda: frees() >= want, step_s):
            raise EngineTimeout(f"producer did not free {sc.requests} requests in {step_s:.0f} s")
    except EngineTimeout as exc:
        res.detail = f"timeout: {exc}"
        return _done(res, t0)
    except EngineExited as exc:  # a crash is a result: failed, and not retried
        res.verdict, res.detail = "fail", f"crash: {exc}"
        return _done(res, t0)
    finally:
        for e in engines:
            e.close()
    return _done(_judge(sc, rec, out, res), t0)


def _judge(sc: Scenario, rec: Path, out: Path, res: ScenarioResult) -> ScenarioResult:
    events = read_dir(rec)
    p_ids, d_ids = sc.engine_ids()
    for eid in p_ids + d_ids:
        base, last, freed = frees_of(events, eid)
        if sc.p_crashes and eid == "P":  # killed holding request 2: its blocks died with it
            res.checks.append(Check("P freed request 1 before its crash", len(freed) == 1,
                                    f"{len(freed)} requests freed"))  # fmt: skip
            continue
        if sc.stalls and eid.startswith("D"):  # Decode.tla HeldReleased, violated
            pd = {r for r in freed if not r.startswith("local")}  # D's P/D requests freed
            res.checks.append(Check(f"{eid} keeps the aborted requests' blocks (their receive "
                                    "is outstanding; no WRITE can come)", base is not None
                                    and last is not None and last < base and not pd,
                                    f"baseline {base}, end {last}, P/D requests freed "
                                    f"{sorted(pd)}"))  # fmt: skip
            continue
        res.checks.append(Check(f"{eid} free blocks back to baseline", base is not None
                                and base == last, f"baseline {base}, end {last}, "
                                f"{len(freed)} requests freed"))  # fmt: skip
    if sc.p_handshake_fails:  # D's heartbeats held P's blocks while D waited in vain
        # (until D's abort where P steps often enough: on 2 shared cores P may stall, and
        # push handles the heartbeats that came during a stall after its reaper)
        # (past the lease, and extended by a heartbeat P handled: a free a hair after the
        # lease is the reaper's own timing, no heartbeat's)
        held = held_after_d_finished(events, "P")
        extended = heartbeat_extended(events, "P")
        ok = len(held) == sc.requests and all(s > sc.lease and r in extended
                                              for r, (s, _) in held.items())  # fmt: skip
        res.checks.append(Check(f"P held every request past its {sc.lease} s lease (D's "
                                "heartbeats extended the lease of a WRITE that cannot "
                                "come)", ok, ", ".join(
                                    f"{r} {s:.1f} s, {'after' if a else 'before'} D's abort"
                                    for r, (s, a) in sorted(held.items()))))  # fmt: skip
    if sc.p_handshake_late:  # KVClock NoWriteFromFreed, violated on real engines
        late = writes_after_free(events, "P")
        res.checks.append(Check("P WRITEs every request after its lease freed the blocks "
                                "(the handshake it waited for ended after the free)",
                                len(late) == sc.requests * sc.tp and all(s > 0 for s in late),
                                ", ".join(f"{s:+.2f} s" for s in late) or "no WRITE"))
    if sc.p_crash_mid_read:  # the READ P hung under, read off the recording
        s = failed_read_s(events)
        res.checks.append(Check(f"D's READ of request 2 stayed in flight while P hung (at "
                                f"least {sc.hang_s:g} s), then failed", s is not None
                                and s >= sc.hang_s, f"posted to failed: {s} s"))  # fmt: skip
    if any(e.call == "kv_caches" for e in events):  # (recordings before 2026-12-06: none)
        res.checks.append(backend_check(events, p_ids + d_ids))
    if sc.d_prefix_hit:
        res.checks.append(prefix_hit_check(events))
    if sc.shared_prefix:
        res.checks.append(shared_block_check(events))
    kv = kv_bytes_check(events, sc.p_reuse > 0)
    if kv is not None:
        res.checks.append(kv)
    t = time.monotonic()
    res.events = len(events)
    undecided = False
    sides = {s.name: s for s in validation_sides(events)}
    for n, p in enumerate(p_ids):  # each producer's completion is its own (xPyD)
        if p not in sides:
            res.checks.append(Check(f"{p} recorded", False, "no scheduler steps to validate"))
            continue
        no_verdict, admitted = _validate_producer(sc, events, out / "validate", res,
                                                  sides[p], d_ids)  # fmt: skip
        undecided |= no_verdict
        # the designs that admit every producer's log
        res.admitted = admitted if n == 0 else [x for x in res.admitted if x in admitted]
    res.validate_s = time.monotonic() - t
    timed_out = _handshake_timed_out(sc, events, d_ids)
    if timed_out:
        res.detail += f" {timed_out}"
    if (undecided or timed_out) and not all(c.ok for c in res.checks):
        res.verdict = "inconclusive"
    else:
        res.verdict = "pass" if all(c.ok for c in res.checks) else "fail"
    return res


def _handshake_timed_out(sc: Scenario, events: list[Event], d_ids: list[str]) -> str:
    """Why a scenario that needs D's handshake with P (in push, P's with D too) has no
    verdict, or "": a worker whose handshake failed where the scenario does not stage that
    failure (the recorder's `handshake` event with ok false: vLLM's own 5 s wait for the
    other side channel, base_worker.py:1043-1047, expired on the loaded machine, and vLLM
    logged handshake_setup_failed). The run is still a behaviour of
    vLLM, and is validated, but not the one the scenario stages: a timeout, retried,
    never a verdict."""
    staged = (sc.dead_port or sc.refused, sc.p_handshake_fails)  # (D's, P's) failure staged
    # push: the producer handshakes D to WRITE (push_worker.py _do_start_push_kv)
    hit = sorted({f"{e.engine} rank {e.rank}" for e in events if e.call == "handshake"
                  and e.result.get("ok") is False
                  and not staged[0 if e.engine in d_ids else 1]})  # fmt: skip
    if hit:
        return f"timeout: {', '.join(hit)}'s handshake failed (vLLM's 5 s wait)"
    if (sc.p_handshake_fails or sc.p_handshake_late) and not any(
            e.call == "handshake" and e.engine not in d_ids for e in events):  # fmt: skip
        # the staged fault fires only at P's WRITE: D's registration came after P's lease
        return "timeout: P never handshook D (D's registration came after P freed)"
    if sc.p_handshake_late and any(s <= 0 for s in writes_after_free(events, "P")):
        # the fault waits for the worker's reaper, then 2 s for the scheduler's free, which
        # a loaded machine may take longer over: the staged order not reached, no verdict
        return "timeout: P's held handshake ended before its scheduler freed the requests"
    lease = sc.lease or 30
    # The check is that D's heartbeats kept P's blocks: P's worker must step to read one
    # before the lease ends, twice in push (p_handshake_fails is push-only). Measured in
    # make e2e: a 77 s stall (2026-12-07, session 28), and a worker idle 21.8-48.9 s
    # while D heartbeated from 23.6 s and the lease ended at 40.0 s (its scheduler's
    # longest gap was 15.8 s: the scheduler's steps do not show a worker's stall).
    need = 2
    n = heartbeat_chances(events, "P", lease) if sc.p_handshake_fails else None
    if n is not None and n < need:
        return (f"timeout: P's worker took {n} step(s) between D's first heartbeat and "
                f"the end of its {lease} s lease, {need} needed to handle one (a stall of "
                "the loaded machine)")
    return ""


def _validate_producer(sc: Scenario, events: list[Event], work: Path, res: ScenarioResult,
                       s: Sides, d_ids: list[str]) -> tuple[bool, list[str]]:  # fmt: skip
    """A producer's sides (mapping.validation_sides): KVTrace, the clock, and each decode
    engine's share of it (Decode.tla's 0.32 design). Adds res's checks. Returns (TLC gave
    no verdict somewhere: timed out or failed, the designs admitting its KVTrace log)."""
    from kvspec.record.mapping import MappingError
    from kvspec.validate_clock import validate_clock
    from kvspec.validate_decode import validate_decode

    p = s.producer
    of = f" ({p})" if p else ""
    admitted: list[str] | None = None
    if p:
        work = work / p
    try:
        v = validate_events(events, work, producer=p)
    except MappingError as exc:  # a recording the producer side cannot map: not admitted
        res.checks.append(Check(f"admitted by {', '.join(sc.admits)}{of}", False,
                                f"not mapped: {exc}"))  # fmt: skip
    else:
        admitted = v.admitted
        if sc.rejected_at:  # KVCompletion's gap (Scenario.rejected_at)
            first = next((n for n, x in enumerate(v.mapped.log) if x.a == sc.rejected_at), -1)
            res.checks.append(Check(
                f"rejected by every design at the first {sc.rejected_at}{of} (KVCompletion "
                "lacks it: the model's gap)", first >= 0 and all(
                    (d.verdict, d.explained) == ("rejected", first) for d in v.designs),
                "; ".join(f"{d.variant}: {d.verdict} at {d.explained}" for d in v.designs)
                + f" (first {sc.rejected_at}: event {first})"))  # fmt: skip
        else:
            res.checks.append(Check(f"admitted by {', '.join(sc.admits)}{of}",
                                    set(sc.admits) <= set(v.admitted),
                                    "admitted: " + (", ".join(v.admitted) or "none")))  # fmt: skip
    # The producer against the lease clock, heartbeats included (spec/ClockTrace.tla),
    # where the clock can map the run (the mapping says why not: one place decides);
    # once per decode engine where P feeds several (KVClock has one: project_log)
    undecided = False
    for c in s.clocks:
        at = f"{of} ({c}'s requests)" if c else of
        try:
            cv = validate_clock(events, work / (c or ""), ("v0.30-shipped",), sc.lease or 30,
                                p, c)  # fmt: skip
        except MappingError as exc:
            res.detail += f" clock{at}: not validated: {exc}"
            continue
        said = "; ".join(f"{d.design.variant}: {d.design.verdict} {d.safe} {d.writes}".strip()
                         for d in cv.designs)  # fmt: skip
        if any("inconclusive" in (d.design.verdict, d.safe, d.writes) for d in cv.designs):
            undecided = True  # TLC timed out or failed: no verdict either way
        # (push: and no WRITE from freed blocks, NoWriteFromFreed; pull has no "writes").
        # A staged late handshake: the run's WRITEs from freed blocks, flagged
        writes = "unsafe" if sc.p_handshake_late else "safe"
        res.checks.append(Check(f"admitted by the clock, reads safe, writes {writes}{at}",
                                [(d.safe, d.writes or "safe") for d in cv.designs]
                                == [("safe", writes)],
                                f"{cv.mapped.heartbeats} heartbeats, {len(cv.mapped.log)} "
                                f"clock events; {said}"))  # fmt: skip
    if not (sc.consumer and sc.admits and not sc.queued):
        # Not where local requests share D's run slots: Decode.tla has P/D requests only.
        return undecided, admitted or []
    # the decode engines that took p's requests (xPyD: not every one need)
    d_ids = [d for d in d_ids if d in s.decodes] if p else d_ids
    for d in d_ids:  # the decode engine against Decode.tla (spec/DecodeTrace.tla)
        name = f"decode side{f' {d}' if len(d_ids) > 1 else ''}{of} admitted by 0.32's design"
        try:
            dv = validate_decode(events, work / d if len(d_ids) > 1 else work, ("none",), d, p)
        except MappingError as exc:  # a recording the decode side cannot map: not admitted
            res.checks.append(Check(name, False, f"not mapped: {exc}"))
        else:
            said = "; ".join(f"{x.variant}: {x.verdict}" for x in dv.designs)
            res.checks.append(Check(name, dv.admitted == ["none"],
                                    f"{len(dv.mapped.log)} decode events; {said}"))  # fmt: skip
    return undecided, admitted or []


def _done(res: ScenarioResult, t0: float) -> ScenarioResult:
    res.seconds = time.monotonic() - t0
    return res


def print_result(r: ScenarioResult) -> None:
    print(f"{r.name}: {r.verdict.upper()} in {r.seconds:.0f} s; {r.events} events, "
          f"validated in {r.validate_s:.1f} s {r.detail}")  # fmt: skip
    for c in r.checks:
        print(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", nargs="*",
                   help=f"scenarios (default: the CPU ones): {', '.join(SCENARIOS)}")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("build/scenario"))
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--attempts", type=int, default=2, help="runs of a scenario that timed out")


def run(args: argparse.Namespace) -> int:
    unknown = [n for n in args.names if n not in SCENARIOS]
    if unknown:
        print(f"kvspec scenario: unknown {', '.join(unknown)}; known: {', '.join(SCENARIOS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    results = []
    for name in args.names or [n for n, s in SCENARIOS.items() if s.device == "cpu" and s.default]:
        for attempt in range(max(1, args.attempts)):
            r = run_scenario(SCENARIOS[name], args.out / name)
            if r.verdict != "inconclusive":
                break
            print(f"{name}: attempt {attempt + 1} timed out ({r.detail}); retrying")
        print_result(r)
        results.append(r)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=2))
    if any(r.verdict == "fail" for r in results):
        return 1
    return 2 if any(r.verdict == "inconclusive" for r in results) else 0
