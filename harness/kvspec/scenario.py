"""`kvspec scenario NAME`: real vLLM engines (one process each, kvspec.scenario_engine) run a
prefill/decode exchange over NIXL with recording connectors; the recording is validated
against the spec (kvspec.validate) and the end state is checked: the producer's and the
consumer's free blocks are back to their baseline and the decode outputs equal a local
run of the same prompts.

Every wait on an engine has a deadline; one that passes is a timeout, and the scenario is
then "inconclusive", never "fail" (a loaded machine is not a bug); so is an engine killed by
a signal. An engine that exits by itself crashed: the scenario fails, naming its error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.record.log import DIR_ENV, Event, read_dir
from kvspec.scenario_catalogue import MODEL_CONFIGS, SCENARIOS, Scenario
from kvspec.scenario_proc import EngineExited, EngineProc, EngineTimeout
from kvspec.validate import validate_events


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class ScenarioResult:
    name: str
    verdict: str  # "pass" | "fail" | "inconclusive"
    seconds: float
    events: int = 0
    validate_s: float = 0.0
    admitted: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    detail: str = ""

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name, "verdict": self.verdict, "seconds": round(self.seconds, 1),
            "events": self.events, "validate_s": round(self.validate_s, 2),
            "admitted": self.admitted, "detail": self.detail,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prompts(n: int) -> list[list[int]]:
    """n distinct prompts of 40 tokens (two 32-token blocks, the second partial)."""
    return [[3 + (7 * i + j) % 500 for j in range(40)] for i in range(n)]


def frees_of(events: list[Event], engine: str) -> tuple[int | None, int | None, set[str]]:
    """(free blocks at the first add_request, after the last free, requests freed)."""
    mine = [e for e in events if e.engine == engine and e.role == "scheduler"]
    base = next((e.result.get("free") for e in mine if e.call == "add_request"), None)
    frees = [e for e in mine if e.call == "free_blocks"]
    last = frees[-1].result.get("free") if frees else None
    return base, last, {r for e in frees for r in e.reqs}


def wait_until(pred: Callable[[], bool], timeout_s: float, *,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> bool:  # fmt: skip
    deadline = clock() + timeout_s
    while not pred():
        if clock() >= deadline:
            return False
        sleep(0.5)
    return True


def _engine(sc: Scenario, eid: str, model: Path, rec: Path, logs: Path,
            cmd: list[str] | None, grace_s: float) -> EngineProc:  # fmt: skip
    env = {**os.environ, DIR_ENV: str(rec), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1",
           # vLLM logs to stdout by default; stdout is the engine's answer channel
           "VLLM_LOGGING_STREAM": "ext://sys.stderr",
           # one compute thread per engine, unbound: two engines share the machine
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
    args = cmd or [sys.executable, "-m", "kvspec.scenario_engine"]

    args = [*args, "--model", str(model), "--engine-id", eid, "--connector", sc.connector,
            "--tp", str(sc.tp if eid.startswith("P") else sc.d_tp), "--lease", str(sc.lease),
            "--device", sc.device,
            "--child", sc.child, *(["--sync"] if sc.sync else []),
            # each engine's ExampleConnector gets a fresh directory of its own: D's child
            # then finds nothing P stored (Decode.tla's multi-nixl-example)
            "--storage", str(logs / f"example-{eid}")]  # fmt: skip
    if eid.startswith("P") and sc.pcp > 1:
        args += ["--pcp", str(sc.pcp)]
    if eid.startswith("D") and sc.queued:
        args += ["--max-seqs", "1"]
    blocks = sc.kv_blocks if eid.startswith("P") else sc.d_kv_blocks
    if blocks:
        args += ["--num-blocks", str(blocks)]
    if eid.startswith("D") and sc.load_policy:
        args += ["--load-failure", sc.load_policy]

    return EngineProc(args, env, logs / f"{eid}.log", grace_s)


def run_scenario(sc: Scenario, out: Path, *, start_s: float = 600, step_s: float = 300,
                 engine_cmd: list[str] | None = None,
                 grace_s: float = 10) -> ScenarioResult:  # fmt: skip
    t0 = time.monotonic()
    model = out / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIGS[sc.model]))
    rec = out / "record"
    for f in rec.glob("*.ndjson"):
        f.unlink()
    p_ids, d_ids = sc.engine_ids()
    for eid in p_ids + d_ids:  # the ExampleConnector children's stores (MultiConnector)
        shutil.rmtree(out / f"example-{eid}", ignore_errors=True)
    res = ScenarioResult(sc.name, "inconclusive", 0.0)
    engines = [_engine(sc, eid, model, rec, out, engine_cmd, grace_s) for eid in p_ids + d_ids]
    try:
        for e in engines:
            e.ask(None, start_s)  # the "ready" line
        ps = prompts(sc.requests)
        if len(p_ids) > 1 or len(d_ids) > 1:
            _xpyd(sc, engines[:len(p_ids)], engines[len(p_ids):], ps, res, step_s)
        else:
            _one_pair(sc, engines, ps, res, step_s)

        def p_freed() -> bool:
            # Polled every 0.5 s while the producer busy-loops (~300 events/s): count the
            # free lines of P's scheduler file, do not parse the whole recording each time.
            text = "".join(f.read_text() for f in rec.glob("P*-scheduler-*.ndjson"))
            return text.count('"call": "free_blocks"') >= (sc.requests - len(sc.abort)) * sc.p_n

        if not wait_until(p_freed, step_s):
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


def _one_pair(sc: Scenario, engines: list[EngineProc], ps: list[list[int]],
              res: ScenarioResult, step_s: float) -> None:  # fmt: skip
    """One producer, at most one decode engine: P prefills, D decodes what P handed on."""
    ask_p = {"cmd": "generate", "prompts": ps, "max_tokens": 1, "remote_decode": True,
             "tag": "p", "abort": list(sc.abort), "n": sc.p_n}  # fmt: skip
    handed: list[dict[str, Any]] = []
    if sc.kv_blocks and sc.consumer:
        pre, handed = _hand_on(engines[0], engines[1], ask_p, ps, sc.max_tokens, step_s)
    else:
        pre = engines[0].ask(ask_p, step_s)
    # an aborted request has no kv_transfer_params: the consumer gets the others
    kept = [n for n, o in enumerate(pre["outputs"]) if o.get("params")]
    ps = [ps[n] for n in kept]
    params = [pre["outputs"][n]["params"] for n in kept]
    if sc.dead_port:
        params = [{**x, "remote_port": free_port()} for x in params]
    if sc.consumer:
        d = engines[1]
        fill = [[5 + i] * 8 for i in range(sc.queued)]
        if handed:
            got: dict[str, Any] = {"outputs": handed}
        else:
            got = d.ask({"cmd": "generate", "prompts": fill + ps, "params": [None]
                         * len(fill) + params, "max_tokens": [sc.filler_tokens]
                         * len(fill) + [sc.max_tokens] * len(ps), "tag": "d",
                         "abort": [len(fill) + n for n in sc.d_abort],
                         "abort_after_s": sc.d_abort_after_s},
                        step_s)  # fmt: skip
            got["outputs"] = got["outputs"][len(fill):]
        ref = d.ask({"cmd": "generate", "prompts": ps, "max_tokens": sc.max_tokens,
                     "tag": "local"}, step_s)  # fmt: skip
        res.checks.append(_outputs_check(sc, got["outputs"], ref["outputs"]))


def _xpyd(sc: Scenario, producers: list[EngineProc], consumers: list[EngineProc],
          ps: list[list[int]], res: ScenarioResult, step_s: float) -> None:  # fmt: skip
    """Several producers or decode engines: request n is prefilled on producer
    n % len(producers) and decoded on engine n % len(consumers), every engine of a kind
    asked at once (a proxy's round robin); the local reference runs on the first D."""
    if sc.abort or sc.d_abort or sc.kv_blocks or sc.queued or sc.dead_port or sc.p_n > 1:
        raise ValueError(f"{sc.name}: xPyD scenarios spread plain requests only")
    pre = _fan_out(producers, ps, lambda n: {"max_tokens": 1, "remote_decode": True}, "p",
                   step_s)  # fmt: skip
    params = [o["params"] for o in pre]
    if not consumers:
        return
    got = _fan_out(consumers, ps, lambda n: {"params": [params[n]],
                                             "max_tokens": sc.max_tokens}, "d", step_s)  # fmt: skip
    ref = consumers[0].ask({"cmd": "generate", "prompts": ps, "max_tokens": sc.max_tokens,
                            "tag": "local"}, step_s)  # fmt: skip
    res.checks.append(_outputs_check(sc, got, ref["outputs"]))


def _fan_out(engines: list[EngineProc], ps: list[list[int]],
             args: Callable[[int], dict[str, Any]], tag: str,
             step_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Each engine generates its share of the prompts (request n on engine n % len),
    all asked before any answer is awaited; the outputs in prompt order. `args(n)`:
    request n's generate arguments (a one-element "params" list, if any). Engine i's
    request ids start with tag, i + 1 and "r" ("d2r0": the second D engine's first)."""
    share = [list(range(i, len(ps), len(engines))) for i in range(len(engines))]
    for i, (e, ns) in enumerate(zip(engines, share, strict=True)):
        if ns:
            each = [args(n) for n in ns]
            cmd: dict[str, Any] = {"cmd": "generate", "prompts": [ps[n] for n in ns],
                                   "max_tokens": [a["max_tokens"] for a in each],
                                   "tag": f"{tag}{i + 1}r"}  # fmt: skip
            if "params" in each[0]:
                cmd["params"] = [a["params"][0] for a in each]
            cmd["remote_decode"] = bool(each[0].get("remote_decode"))
            e.send(cmd)
    outs: dict[int, dict[str, Any]] = {}
    for e, ns in zip(engines, share, strict=True):
        if ns:
            outs |= dict(zip(ns, e.ask(None, step_s)["outputs"], strict=True))
    return [outs[n] for n in range(len(ps))]


def _outputs_check(sc: Scenario, got: list[dict[str, Any]],
                   ref: list[dict[str, Any]]) -> Check:  # fmt: skip
    """D's outputs against a local run of the same prompts; where D's load fails under the
    "fail" policy, every request must end in error instead (FinishReason.ERROR)."""
    kept = [n for n in range(len(got)) if n not in sc.d_abort]  # D's aborts: no output
    if (sc.dead_port or sc.refused) and sc.load_policy != "recompute":
        reasons = [got[n].get("finish") for n in kept]
        return Check("D failed every request (kv_load_failure_policy fail)",
                     reasons == ["error"] * len(kept), f"finish reasons {reasons}")
    same = [got[n]["tokens"] for n in kept] == [ref[n]["tokens"] for n in kept]
    return Check("decode outputs equal a local run", same,
                 f"P/D {got[0]['tokens']} local {ref[0]['tokens']}")


def _hand_on(p: EngineProc, d: EngineProc, ask_p: dict[str, Any], ps: list[list[int]],
             max_tokens: int, step_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """P streams each request as it finishes its prefill; each goes to D at once (D
    decodes it, its READ lets P free the blocks the next request waits for). Returns P's
    final answer and D's outputs in prompt order. Without this, P's generate would wait
    for a free that only D's READ, after generate, can bring: until the lease."""
    line = p.ask({**ask_p, "stream": True}, step_s)
    handed: dict[int, dict[str, Any]] = {}
    while "stream" in line:
        n = int(line["stream"])
        params = line["output"]["params"]
        if params:  # an aborted request has none: nothing to hand on
            got = d.ask({"cmd": "generate", "prompts": [ps[n]], "params": [params],
                         "max_tokens": max_tokens, "tag": f"d{n}_"}, step_s)  # fmt: skip
            handed[n] = got["outputs"][0]
        line = p.ask(None, step_s)
    return line, [handed[n] for n in sorted(handed)]


def _judge(sc: Scenario, rec: Path, out: Path, res: ScenarioResult) -> ScenarioResult:
    events = read_dir(rec)
    p_ids, d_ids = sc.engine_ids()
    for eid in p_ids + d_ids:
        base, last, freed = frees_of(events, eid)
        res.checks.append(Check(f"{eid} free blocks back to baseline", base is not None
                                and base == last, f"baseline {base}, end {last}, "
                                f"{len(freed)} requests freed"))  # fmt: skip
    t = time.monotonic()
    res.events = len(events)
    undecided = False
    for n, p in enumerate(p_ids):  # each producer's completion is its own (xPyD)
        no_verdict, admitted = _validate_producer(sc, events, out / "validate", res,
                                                  p if len(p_ids) > 1 else None, d_ids)  # fmt: skip
        undecided |= no_verdict
        # the designs that admit every producer's log
        res.admitted = admitted if n == 0 else [x for x in res.admitted if x in admitted]
    res.validate_s = time.monotonic() - t
    if undecided and not all(c.ok for c in res.checks):
        res.verdict = "inconclusive"
    else:
        res.verdict = "pass" if all(c.ok for c in res.checks) else "fail"
    return res


def _validate_producer(sc: Scenario, events: list[Event], work: Path, res: ScenarioResult,
                       p: str | None, d_ids: list[str]) -> tuple[bool, list[str]]:  # fmt: skip
    """Producer p's sides (p None: the recording's only producer): KVTrace, the clock, and
    each decode engine's share of p (Decode.tla's 0.32 design). Adds res's checks.
    Returns (TLC gave no verdict somewhere: timed out or failed, the designs admitting
    p's KVTrace log)."""
    from kvspec.record.mapping import MappingError, engines_of
    from kvspec.validate_clock import validate_clock
    from kvspec.validate_decode import validate_decode

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
        res.checks.append(Check(f"admitted by {', '.join(sc.admits)}{of}",
                                set(sc.admits) <= set(v.admitted),
                                "admitted: " + (", ".join(v.admitted) or "none")))  # fmt: skip
    # The producer against the lease clock, heartbeats included (spec/ClockTrace.tla),
    # where the clock can map the run (the mapping says why not: one place decides);
    # once per decode engine where P feeds several (KVClock has one: project_log)
    undecided = False
    try:
        mine = engines_of(events, p)[1]
    except MappingError:
        mine = []
    for c in mine if len(mine) > 1 else [None]:
        at = f"{of} ({c}'s requests)" if c else of
        try:
            cv = validate_clock(events, work / (c or ""), ("v0.30-shipped",), sc.lease or 30,
                                p, c)  # fmt: skip
        except MappingError as exc:
            res.detail += f" clock{at}: not validated: {exc}"
            continue
        said = "; ".join(f"{d.design.variant}: {d.design.verdict} {d.safe}" for d in cv.designs)
        if any("inconclusive" in (d.design.verdict, d.safe) for d in cv.designs):
            undecided = True  # TLC timed out or failed: no verdict either way
        res.checks.append(Check(f"admitted by the clock, reads safe{at}",
                                [d.safe for d in cv.designs] == ["safe"],
                                f"{cv.mapped.heartbeats} heartbeats, {len(cv.mapped.log)} "
                                f"clock events; {said}"))  # fmt: skip
    if not (sc.consumer and sc.admits and not sc.queued):
        # Not where local requests share D's run slots: Decode.tla has P/D requests only.
        return undecided, admitted or []
    # the decode engines that took p's requests (xPyD: not every one need)
    d_ids = [d for d in d_ids if d in mine] if p else d_ids
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
