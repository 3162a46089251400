"""How requests travel between a scenario's engines (kvspec.scenario runs them): one
producer and one decode engine (a plain round trip, KV pressure handed on as P streams),
several of each (xPyD, a proxy's round robin), a producer that crashes and restarts on
its address, and the shared pieces: prompts, the waits, the checks of outputs and of
free blocks."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvspec.record.log import Event
from kvspec.scenario_catalogue import Scenario
from kvspec.scenario_proc import EngineProc, EngineTimeout


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


def prompts(n: int, shift: int = 0) -> list[list[int]]:
    """n distinct prompts of 40 tokens (two 32-token blocks, the second partial); `shift`:
    other tokens of the fixtures' vocabulary (512)."""
    return [[3 + (7 * i + j + shift) % 500 for j in range(40)] for i in range(n)]


# The local reference's cache_salt: its prompts hash apart from the P/D run's, so with
# prefix caching on (vLLM's default) it computes its own KV instead of reusing the blocks
# D received, which would repeat any wrong KV D got (pd-push-p-handshake-late-reuse)
LOCAL_SALT = "kvspec-local-reference"


def local_reference(d: EngineProc, ps: list[list[int]], max_tokens: int,
                    step_s: float) -> dict[str, Any]:  # fmt: skip
    """D's own run of the prompts, no P: the outputs a P/D run must equal."""
    return d.ask({"cmd": "generate", "prompts": ps, "max_tokens": max_tokens, "tag": "local",
                  "salt": LOCAL_SALT}, step_s)  # fmt: skip


def warm_prefix(ps: list[list[int]]) -> list[list[int]]:
    """The local prompt that gives D request 1's first block (sc.d_prefix_hit): its first
    32 tokens, then 8 others, so only that block is shared."""
    return [ps[0][:32] + [(t + 100) % 500 + 3 for t in ps[0][32:40]]]


def shared_prompts(ps: list[list[int]]) -> list[list[int]]:
    """sc.shared_prefix: every prompt starts with the first's 32 tokens (one block)."""
    return [ps[0][:32] + p[32:] for p in ps]


def go_file(out: Path) -> Path:
    """The file a scenario creates to end P's held handshake (faults.late_go_file)."""
    return out / "p-handshake.go"


def frees_of(events: list[Event], engine: str) -> tuple[int | None, int | None, set[str]]:
    """(free blocks at the first add_request, after the last free, requests freed)."""
    mine = [e for e in events if e.engine == engine and e.role == "scheduler"]
    base = next((e.result.get("free") for e in mine if e.call == "add_request"), None)
    frees = [e for e in mine if e.call == "free_blocks"]
    last = frees[-1].result.get("free") if frees else None
    return base, last, {r for e in frees for r in e.reqs}


def failed_read_s(events: list[Event]) -> float | None:
    """Seconds from a decode engine posting a READ to its worker reporting that receive
    failed (the first such READ), None if no posted READ failed."""
    posted = {e.reqs[0]: e.t_ns for e in events if e.call == "read" and e.reqs
              and e.result.get("posted") is not False}  # fmt: skip
    fails = [e.t_ns - posted[r] for e in events if e.call == "get_transfer_results"
             for r in sorted(e.ids("failed_recving")) if r in posted]  # fmt: skip
    return min(fails) / 1e9 if fails else None


def producer_ids(events: list[Event]) -> dict[str, str]:
    """Each decode request named after the producer request it loads from: add_request's
    remote_request_id (push runs D's requests under P's ids; pull's D has ids of its own)."""
    return {e.reqs[0]: str(e.result["remote_request_id"]) for e in events
            if e.call == "add_request" and e.reqs and e.result.get("remote_request_id")}


def held_after_d_finished(events: list[Event], producer: str) -> dict[str, tuple[float, bool]]:
    """Per producer request: (seconds from its request_finished to the free of its
    blocks, whether that free came after the decode engine's request_finished of it: D
    finished the request, as an abort does, and its heartbeats stopped there). D's
    request is the one whose add_request names the producer's id (remote_request_id)."""
    mine = [e for e in events if e.engine == producer and e.role == "scheduler"]
    done = {e.reqs[0]: e.t_ns for e in mine if e.call == "request_finished" and e.reqs}
    freed = {r: e.t_ns for e in mine if e.call == "free_blocks" for r in e.reqs}
    d_of = producer_ids(events)  # (a producer's own add_request names no remote request)
    d_done = {d_of[e.reqs[0]]: e.t_ns for e in events if e.engine != producer
              and e.call == "request_finished" and e.reqs and e.reqs[0] in d_of}  # fmt: skip
    return {r: ((freed[r] - t) / 1e9, freed[r] > d_done.get(r, freed[r]))
            for r, t in done.items() if r in freed}


def heartbeat_extended(events: list[Event], producer: str) -> set[str]:
    """The producer's requests a heartbeat it handled named while it held them (the
    recorder's `heartbeat_recv`, its `held`: _handle_heartbeat extended their leases)."""
    return {str(r) for e in events if e.engine == producer and e.call == "heartbeat_recv"
            for r in e.result.get("held", ())}  # fmt: skip


def writes_after_free(events: list[Event], producer: str) -> list[float]:
    """Per WRITE a producer worker posted (push): seconds from the producer scheduler's
    free of that request's blocks to the WRITE's post, negative where the WRITE came
    first; a WRITE of a request the producer never freed is left out."""
    freed = {r: e.t_ns for e in events if e.engine == producer and e.role == "scheduler"
             and e.call == "free_blocks" for r in e.reqs}  # fmt: skip
    return [(e.t_ns - freed[e.reqs[0]]) / 1e9 for e in events if e.engine == producer
            and e.call == "write" and e.reqs and e.result.get("posted") is not False
            and e.reqs[0] in freed]  # fmt: skip


def wait_until(pred: Callable[[], bool], timeout_s: float, *,
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> bool:  # fmt: skip
    deadline = clock() + timeout_s
    while not pred():
        if clock() >= deadline:
            return False
        sleep(0.5)
    return True


def _one_pair(sc: Scenario, engines: list[EngineProc], ps: list[list[int]],
              res: ScenarioResult, step_s: float,
              p_frees: Callable[[], int] | None = None,
              p_writes: Callable[[], int] | None = None,
              go: Path | None = None) -> None:  # fmt: skip
    """One producer, at most one decode engine: P prefills, D decodes what P handed on
    (sc.late: once P freed them, p_frees counting P's frees; sc.p_handshake_late: P is
    nudged once it freed them and posted its WRITEs, p_writes counting those; with
    sc.p_reuse, P reuses the freed blocks first and `go` then ends its held handshake)."""
    ask_p = {"cmd": "generate", "prompts": ps, "max_tokens": 1, "remote_decode": True,
             "tag": "p", "abort": list(sc.abort), "n": sc.p_n}  # fmt: skip
    handed: list[dict[str, Any]] = []
    if sc.kv_blocks and sc.consumer:
        pre, handed = _hand_on(engines[0], engines[1], ask_p, ps, sc.max_tokens, step_s)
    elif sc.shared_prefix:  # one at a time: request 2 finds request 1's block cached
        pre = {"outputs": [engines[0].ask({**ask_p, "prompts": [p], "tag": f"p{n}_"},
                                          step_s)["outputs"][0] for n, p in enumerate(ps)]}
    else:
        pre = engines[0].ask(ask_p, step_s)
    # an aborted request has no kv_transfer_params: the consumer gets the others
    kept = [n for n, o in enumerate(pre["outputs"]) if o.get("params")]
    ps = [ps[n] for n in kept]
    params = [pre["outputs"][n]["params"] for n in kept]
    if sc.dead_port:
        params = [{**x, "remote_port": free_port()} for x in params]
    if sc.late and p_frees is not None and not wait_until(lambda: p_frees() >= len(kept),
                                                          step_s):  # fmt: skip
        raise EngineTimeout(f"P did not free its requests at its lease in {step_s:.0f} s")
    if sc.consumer:
        d = engines[1]
        # push mode: P's writer matches D's PUSH_REG to its finished blocks by request id,
        # less vLLM's random suffix (push_worker.py _pop_matching_registration), not by
        # kv_transfer_params: a proxy gives P and D the same id. Pull names P's by
        # remote_request_id, so D's own ids ("d0") show which side a trace event is from
        d_tag = "p" if sc.connector == "NixlPushConnector" else "d"
        fill = [[5 + i] * 8 for i in range(sc.queued)]
        if sc.d_prefix_hit:  # D's prefix cache gets request 1's first block
            d.ask({"cmd": "generate", "prompts": warm_prefix(ps), "max_tokens": 1,
                   "tag": "warm"}, step_s)  # fmt: skip
        if handed:
            got: dict[str, Any] = {"outputs": handed}
        else:
            d.send({"cmd": "generate", "prompts": fill + ps, "params": [None]
                    * len(fill) + params, "max_tokens": [sc.filler_tokens]
                    * len(fill) + [sc.max_tokens] * len(ps), "tag": d_tag,
                    "abort": [len(fill) + n for n in sc.d_abort],
                    "abort_after_s": sc.d_abort_after_s})  # fmt: skip
            if sc.p_handshake_late and p_frees is not None and p_writes is not None:
                _nudge_after_late_writes(sc, engines[0], len(kept), step_s, p_frees, p_writes,
                                         go)  # fmt: skip
            got = d.ask(None, step_s)
            got["outputs"] = got["outputs"][len(fill):]
        ref = local_reference(d, ps, sc.max_tokens, step_s)
        res.checks.append(_outputs_check(sc, got["outputs"], ref["outputs"]))


def _nudge_after_late_writes(sc: Scenario, p: EngineProc, n: int, step_s: float,
                             p_frees: Callable[[], int], p_writes: Callable[[], int],
                             go: Path | None = None) -> None:  # fmt: skip
    """Once P freed its n requests and posted their WRITEs, P gets one more request.
    Why: an idle P never steps, and P's step is what polls the WRITEs
    (`get_transfer_results` -> `_pop_done_transfers`, push_worker.py:808-825) and so
    progresses NIXL to deliver their notification to D; measured, without it D waited
    300 s for a WRITE P had posted. Any request P serves does this in a serving engine.
    A P/D one (held for a D that never comes, freed at its lease): the specs have no
    local requests, and a step of P's with none of theirs live is none they allow
    (KVCompletion `schedule` needs a request P holds)."""
    if not wait_until(lambda: p_frees() >= n, step_s):
        raise EngineTimeout(f"P did not free its {n} requests in {step_s:.0f} s")
    if sc.p_reuse and go is not None:
        # P prefills other P/D requests into the freed blocks (its pool holds no others),
        # then its held handshake ends. Held for a D that never reads them, they keep P
        # stepping (delayed frees count, scheduler.has_requests) until their lease: no nudge.
        p.ask({"cmd": "generate", "prompts": prompts(sc.p_reuse, shift=250), "max_tokens": 1,
               "remote_decode": True, "tag": "reuse"}, step_s)  # fmt: skip
        go.touch()
    # The held handshake ends at most a lease after it began, after P's match of D's
    # registration, so 2 s (+ polls) after the free; none by a lease later: D registered
    # after the free (measured on 2 cores: D's registration, or the client's hand-off,
    # held up until P's free in 3 of 5 runs), so nothing was parked to WRITE
    lease = sc.lease or 30
    if not wait_until(lambda: p_writes() >= n * sc.tp, lease + 30):
        raise EngineTimeout("P posted no WRITE a lease after its free: D's registration "
                            "reached P only after P freed the requests")
    if not sc.p_reuse:
        p.ask({"cmd": "generate", "prompts": [[7] * 8], "max_tokens": 1,
               "remote_decode": True, "tag": "nudge"}, step_s)  # fmt: skip


def _xpyd(sc: Scenario, producers: list[EngineProc], consumers: list[EngineProc],
          ps: list[list[int]], res: ScenarioResult, step_s: float) -> None:  # fmt: skip
    """Several producers or decode engines: request n is prefilled on producer
    n % len(producers) and decoded on engine n % len(consumers), every engine of a kind
    asked at once (a proxy's round robin); the local reference runs on the first D."""
    pre = _fan_out(producers, ps, {"max_tokens": 1, "remote_decode": True}, None, "p", step_s)
    if not consumers:
        return
    got = _fan_out(consumers, ps, {"max_tokens": sc.max_tokens}, [o["params"] for o in pre],
                   "d", step_s)  # fmt: skip
    ref = local_reference(consumers[0], ps, sc.max_tokens, step_s)
    res.checks.append(_outputs_check(sc, got, ref["outputs"]))


def _fan_out(engines: list[EngineProc], ps: list[list[int]], base: dict[str, Any],
             params: list[Any] | None, tag: str,
             step_s: float) -> list[dict[str, Any]]:  # fmt: skip
    """Each engine generates its share of the prompts (request n on engine n % len, with
    params[n] where given, and `base`'s generate arguments), all asked before any answer
    is awaited; the outputs in prompt order. Engine i's request ids start with tag, i + 1
    and "r" ("d2r0": the second D engine's first)."""
    share = [list(range(i, len(ps), len(engines))) for i in range(len(engines))]
    for i, (e, ns) in enumerate(zip(engines, share, strict=True)):
        if ns:
            cmd = {"cmd": "generate", "prompts": [ps[n] for n in ns], "tag": f"{tag}{i + 1}r",
                   **base} | ({"params": [params[n] for n in ns]} if params else {})  # fmt: skip
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
    if sc.stalls:
        reasons = [o.get("finish") or ("abort" if o.get("aborted") else None) for o in got]
        return Check("D never received P's requests (no WRITE came): its client aborted "
                     "them", reasons == ["abort"] * len(got),
                     f"finish reasons {reasons}")  # fmt: skip
    kept = [n for n in range(len(got)) if n not in sc.d_abort]  # D's aborts: no output
    if sc.p_reuse:  # the late WRITEs carried other prompts' KV (scenario_weights: it shows)
        differ = [got[n]["tokens"] != ref[n]["tokens"] for n in kept]
        return Check("D decoded other prompts' KV: outputs differ from a local run",
                     all(differ), " | ".join(f"P/D {got[n]['tokens']} local "
                                             f"{ref[n]['tokens']}" for n in kept))  # fmt: skip
    if (sc.dead_port or sc.refused) and sc.load_policy != "recompute":
        reasons = [got[n].get("finish") for n in kept]
        return Check("D failed every request (kv_load_failure_policy fail)",
                     reasons == ["error"] * len(kept), f"finish reasons {reasons}")
    if not sc.token_oracle:
        # On CPU this MLA fixture's tokens change with the batch a request runs in (seeded
        # weights, bfloat16 AMX_MLA: one prompt alone [467, 497, 255, 467], the same
        # beside another [448, 24, 467, 186]; float32 CPU_MLA's third token 337 alone, 54
        # in a pair), and D's decode batch is not the local run's. The KV D received is
        # checked byte for byte where P's is recorded (kv_bytes_check).
        done = [len(got[n]["tokens"]) == sc.max_tokens and got[n].get("finish") != "error"
                for n in kept]  # fmt: skip
        return Check("D decoded every request (MLA on CPU: no token oracle, see README)",
                     all(done), f"P/D {got[0]['tokens']} local {ref[0]['tokens']}")
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


def _read_request_1(sc: Scenario, p: EngineProc, d: EngineProc, ps: list[list[int]],
                    step_s: float, p_frees: Callable[[], int],
                    ) -> tuple[list[Any], dict[str, Any]]:  # fmt: skip
    """The crash flows' start: P prefills requests 1 and 2, D decodes request 1 and P frees
    it on D's notification. Returns (P's kv_transfer_params of both, D's answer)."""
    pre = p.ask({"cmd": "generate", "prompts": ps[:2], "max_tokens": 1, "remote_decode": True,
                 "tag": "p"}, step_s)  # fmt: skip
    params = [o["params"] for o in pre["outputs"]]
    first = d.ask({"cmd": "generate", "prompts": [ps[0]], "params": [params[0]],
                   "max_tokens": sc.max_tokens, "tag": "d"}, step_s)  # fmt: skip
    if not wait_until(lambda: p_frees() >= 1, step_s):
        raise EngineTimeout(f"P did not free request 1 in {step_s:.0f} s")
    return params, first


def _restart(sc: Scenario, engines: list[EngineProc], ps: list[list[int]],
             res: ScenarioResult, step_s: float, start_s: float,
             p2: Callable[[], EngineProc], p_frees: Callable[[], int]) -> None:  # fmt: skip
    """A producer crash and restart: P prefills requests 1 and 2, D decodes request 1 and P
    frees it on D's notification; P is killed (SIGKILL) holding request 2, and P2 starts
    on P's side-channel address with a new engine id and prefills request 3; D gets
    request 2 (its params name the dead P, whose agent D still holds) and request 3
    together. `engines`: [P, D], P2 appended once started (the caller closes them)."""
    p, d = engines
    params, first = _read_request_1(sc, p, d, ps, step_s, p_frees)
    p.kill()
    new = p2()
    engines.append(new)
    new.ask(None, start_s)  # the "ready" line
    pre3 = new.ask({"cmd": "generate", "prompts": [ps[2]], "max_tokens": 1,
                    "remote_decode": True, "tag": "q"}, step_s)  # fmt: skip
    got = d.ask({"cmd": "generate", "prompts": ps[1:3],
                 "params": [params[1], pre3["outputs"][0]["params"]],
                 "max_tokens": sc.max_tokens, "tag": "e"}, step_s)  # fmt: skip
    ref = local_reference(d, [ps[0], ps[2]], sc.max_tokens, step_s)
    outs = [first["outputs"][0], *got["outputs"]]
    res.checks.append(Check("requests 1 and 3 decode as a local run",
                            [outs[0]["tokens"], outs[2]["tokens"]]
                            == [r["tokens"] for r in ref["outputs"]],
                            f"P/D {outs[0]['tokens']} {outs[2]['tokens']}"))  # fmt: skip
    res.checks.append(Check("D failed request 2, whose producer crashed (fail policy)",
                            outs[1].get("finish") == "error",
                            f"finish reason {outs[1].get('finish')}"))  # fmt: skip


# D's polls of request 2's READ while P hangs, before P is killed: the READ is seen in
# flight (PROC) across steps, not only in the step that posted it
_IN_FLIGHT_STEPS = 3


def _crash_mid_read(sc: Scenario, engines: list[EngineProc], ps: list[list[int]],
                    res: ScenarioResult, step_s: float, p_frees: Callable[[], int],
                    d_count: Callable[[str], int],
                    sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
    """A producer crash during a READ: P prefills requests 1 and 2, D decodes request 1
    (its handshake with P done) and P frees it; P then hangs (SIGSTOP: its NIXL agent makes
    no progress, so over UCX's TCP transport a READ of it cannot complete: the scenario's
    engines run UCX_TLS=tcp), D gets request 2 and posts its READ,
    which stays in flight for `_IN_FLIGHT_STEPS` of D's steps and `sc.hang_s` seconds more;
    then P is killed (SIGKILL) and D's next poll of the READ fails. `d_count(call)`: D's
    worker events of that call so far. On CPU a READ of two blocks ends in milliseconds:
    only a hung P holds it open long enough to crash P during it."""
    p, d = engines
    params, first = _read_request_1(sc, p, d, ps, step_s, p_frees)
    reads = d_count("read")
    p.stop()
    d.send({"cmd": "generate", "prompts": [ps[1]], "params": [params[1]],
            "max_tokens": sc.max_tokens, "tag": "e"})  # fmt: skip
    if not wait_until(lambda: d_count("read") > reads, step_s):
        raise EngineTimeout(f"D posted no READ of request 2 in {step_s:.0f} s")
    polls = d_count("get_transfer_results")
    if not wait_until(lambda: d.answered()
                      or d_count("get_transfer_results") >= polls + _IN_FLIGHT_STEPS,
                      step_s):  # fmt: skip
        raise EngineTimeout(f"D did not step {_IN_FLIGHT_STEPS} times in {step_s:.0f} s")
    if d.answered():  # no READ in flight to crash P during: no verdict, run it again
        raise EngineTimeout("D's READ of request 2 ended while P was stopped (the transport "
                            "read P's memory without P's progress)")
    sleep(sc.hang_s)  # P hangs on (pd-p-hang): what D does meanwhile is in the recording
    p.kill()
    got = d.ask(None, step_s)
    ref = local_reference(d, [ps[0]], sc.max_tokens, step_s)
    res.checks.append(Check("request 1 decodes as a local run",
                            first["outputs"][0]["tokens"] == ref["outputs"][0]["tokens"],
                            f"P/D {first['outputs'][0]['tokens']}"))  # fmt: skip
    finish = got["outputs"][0].get("finish")
    res.checks.append(Check("D failed request 2, whose producer crashed during its READ "
                            "(fail policy)", finish == "error", f"finish reason {finish}"))
