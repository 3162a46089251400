"""`kvspec record`: the configuration that makes a vLLM engine record its connector calls,
and a summary of a recording. Recording itself happens inside the engine
(kvspec.record.connectors); this command never starts one (`kvspec scenario` does)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from kvspec.record.log import DIR_ENV, RecordError, read_dir

MODULE = "kvspec.record.connectors"
CONNECTORS = ("NixlConnector", "MultiConnector")


def kv_transfer_config(connector: str, kv_role: str, extra: dict[str, object]) -> dict[str, object]:
    """vLLM's kv_transfer_config for a recording `connector` (its children, if any, in
    `extra["kv_connector_extra_config"]`, exactly as without recording)."""
    return {"kv_connector": connector, "kv_connector_module_path": MODULE, "kv_role": kv_role,
            **extra}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connector", choices=CONNECTORS, default="NixlConnector")
    p.add_argument("--kv-role", default="kv_both")
    p.add_argument("--dir", type=Path, default=Path("kvspec-record"),
                   help="where the engine's processes write their NDJSON")  # fmt: skip
    p.add_argument("--summary", action="store_true", help="summarise the recording in --dir")
    p.add_argument(
        "--compact",
        type=Path,
        metavar="OUT",
        help="write --dir without its idle producer steps to OUT (same spec log)",
    )


def run(args: argparse.Namespace) -> int:
    if args.summary or args.compact:
        try:
            events = read_dir(args.dir)
            if args.compact:
                from kvspec.record.compact import compact, write_dir

                kept = compact(events)
                write_dir(kept, args.compact)
                print(f"{len(events)} events -> {len(kept)} in {args.compact}")
                return 0
        except (RecordError, ValueError) as exc:
            print(f"kvspec record: {exc}", file=sys.stderr)
            return 2
        calls = Counter((e.engine, e.role, e.call) for e in events)
        for (engine, role, call), n in sorted(calls.items()):
            print(f"{engine:24} {role:9} {call:22} {n}")
        return 0
    cfg = kv_transfer_config(args.connector, args.kv_role, {})
    print(f"export {DIR_ENV}={args.dir.resolve()}")
    print(f"--kv-transfer-config '{json.dumps(cfg)}'")
    print("# then: kvspec validate " + str(args.dir))
    return 0
