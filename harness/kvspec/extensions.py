"""Extension traces: named action scripts (conformance/extensions.toml) run on the spec.

The conformance traces (conformance/matrix.toml) are one-request and synchronous; the
mutation campaign also needs paths they cannot take. Each script names the row it runs on
and its actions ("lease_expire(1, 0)", `Action.parse` syntax); `trace_from_actions` runs
it on the reference model, so a trace's states are the spec's and a script that leaves
the spec's paths is an error, not a false kill.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from kvspec.matrix import COMPOSITIONS, TIMINGS, VARIANTS, ModelRow, Topology
from kvspec.model import Action
from kvspec.replay import SpecTrace, trace_from_actions

EXTENSIONS_FILE = Path(__file__).resolve().parents[2] / "conformance" / "extensions.toml"
KEYS = frozenset(
    ("name", "why", "variants", "model", "composition", "topology", "requests", "capacity",
     "async_scheduling", "transfer", "timing", "actions")
)  # fmt: skip


@dataclass(frozen=True)
class Extension:
    name: str
    why: str
    variants: tuple[str, ...]  # the base designs it runs on
    shape: ModelRow  # the row, named after its model, for variants[0]
    actions: tuple[Action, ...]

    def row(self, variant: str) -> ModelRow:
        return replace(self.shape, name=f"x-{variant}-{self.shape.name}", variant=variant)

    def trace(self, variant: str) -> SpecTrace:
        """The spec's path (raises ValueError if an action is not enabled on it)."""
        row = self.row(variant)
        return trace_from_actions(row, list(self.actions), f"{row.name}/{self.name}")


def _positive(raw: object, where: str, key: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise ValueError(f"{where}: {key} must be a positive integer, got {raw!r}")
    return raw


def _extension(raw: dict[str, object], where: str) -> Extension:
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(unknown)}; use {', '.join(sorted(KEYS))}"
        )
    variants = raw.get("variants")
    if not isinstance(variants, list) or not variants or not set(variants) <= set(VARIANTS):
        raise ValueError(f"{where}: variants must be a non-empty list of {', '.join(VARIANTS)}")
    comp = raw.get("composition")
    if comp not in COMPOSITIONS:
        raise ValueError(f"{where}: composition {comp!r} unknown; use {', '.join(COMPOSITIONS)}")
    topo = raw.get("topology")
    if not isinstance(topo, dict):
        raise ValueError(f"{where}: topology must be a table {{tp = 1, pp = 1, pcp = 2}}")
    async_sched = raw.get("async_scheduling", False)
    if not isinstance(async_sched, bool):
        raise ValueError(f"{where}: async_scheduling must be true or false")
    transfer = raw.get("transfer", "pull")
    if transfer not in ("pull", "push"):
        raise ValueError(f'{where}: transfer must be "pull" or "push", got {transfer!r}')
    timing = raw.get("timing", "guarded")
    if timing not in TIMINGS:
        raise ValueError(f"{where}: timing must be one of {', '.join(TIMINGS)}, got {timing!r}")
    actions = raw.get("actions")
    if not isinstance(actions, list) or not actions:
        raise ValueError(f"{where}: actions must be a non-empty list of strings")
    try:
        parsed = tuple(Action.parse(str(a)) for a in actions)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    shape = ModelRow(
        name=str(raw.get("model")),
        variant=str(variants[0]),
        composition=str(comp),
        topology=Topology(*(_positive(topo.get(k, 1), where, k) for k in ("tp", "pp", "pcp"))),
        requests=_positive(raw.get("requests"), where, "requests"),
        capacity=_positive(raw.get("capacity"), where, "capacity"),
        async_scheduling=async_sched,
        transfer=str(transfer),
        timing=str(timing),
    )
    return Extension(str(raw["name"]), str(raw.get("why", "")), tuple(variants), shape, parsed)


def load_extensions(path: Path = EXTENSIONS_FILE) -> list[Extension]:
    """The scripts of `path`, in file order; each [[extension]] inherits [defaults]."""
    data = tomllib.loads(path.read_text())
    defaults = data.get("defaults", {})
    out: list[Extension] = []
    for i, raw in enumerate(data.get("extension", [])):
        where = f"{path}: extension {raw.get('name', f'#{i + 1}')!r}"
        if "name" not in raw or "model" not in {**defaults, **raw}:
            raise ValueError(f"{where}: needs a name and a model")
        out.append(_extension({**defaults, **raw}, where))
    names = [x.name for x in out]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"{path}: duplicate extension name(s) {', '.join(dups)}")
    shapes: dict[str, ModelRow] = {}
    for x in out:
        # A model name stands for one shape: trace names must not mislead.
        shape = replace(x.shape, variant="")
        if shapes.setdefault(x.shape.name, shape) != shape:
            raise ValueError(f"{path}: model {x.shape.name!r} has two shapes; rename one")
    return out


def extension_traces(variant: str, path: Path = EXTENSIONS_FILE) -> list[SpecTrace]:
    """The traces of the scripts that run on `variant`, in file order."""
    return [x.trace(variant) for x in load_extensions(path) if variant in x.variants]
