"""The driver interface shared by the reference model and the real-vLLM cluster.

The spec's action vocabulary (spec/KVCompletion.tla) is fixed here: `ACTIONS` lists each
action with its parameters. A parameter is a request id `r` (1..NReq) or a rank `w`
(0..W-1, PCP innermost: pcp = w % PCP, tp = (w // PCP) % TP, pp = w // (PCP * TP)).

`observe()` returns the implementation's state projected onto the spec's variables, as
kvspec.tlcvalue values shaped exactly as TLC prints them: functions over 1..NReq are tuples
(sequences), functions over ranks are `Fn`, sets are frozensets, records are `Record`.
Comparison goes through `kvspec.itf.value_to_itf`, so both sides use one canonical JSON.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Self

from kvspec.matrix import ModelRow
from kvspec.tlcvalue import Value

# name -> parameter names, in the order the TLA+ operator takes them.
ACTIONS: dict[str, tuple[str, ...]] = {
    "schedule": (),
    "execute_model": (),
    "update_from_output": (),
    "abort": ("r",),
    "consumer_start_load_kv": ("r", "w"),
    "consumer_get_finished": ("r", "w"),
    "heartbeat": ("r",),
    "lease_expire": ("r", "w"),
    "store_complete": ("r", "w"),
}

VARIABLES = (
    "req",
    "needSend",
    "notProc",
    "steps",
    "toProcess",
    "lease",
    "expired",
    "notif",
    "replQ",
    "extra",
    "store",
    "stored",
    "rd",
    "hb",
    "agg",
    "emits",
    "lateFinish",
    "published",
)


@dataclass(frozen=True, order=True)
class Action:
    """One action instance: the operator name and its parameter values."""

    name: str
    r: int | None = None
    w: int | None = None

    def params(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.r is not None:
            out["r"] = self.r
        if self.w is not None:
            out["w"] = self.w
        return out

    def __str__(self) -> str:
        args = ", ".join(str(v) for v in self.params().values())
        return f"{self.name}({args})" if args else self.name

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of __str__: 'lease_expire(1, 0)' -> Action('lease_expire', 1, 0)."""
        name, _, rest = text.partition("(")
        if name not in ACTIONS:
            raise ValueError(f"unknown action {name!r}; known: {', '.join(ACTIONS)}")
        vals = [int(x) for x in rest.rstrip(")").split(",") if x.strip()]
        names = ACTIONS[name]
        if len(vals) != len(names):
            raise ValueError(f"{name} takes {len(names)} parameters, got {len(vals)}")
        kw = dict(zip(names, vals, strict=True))
        return Action(name, kw.get("r"), kw.get("w"))


class MissingAction(Exception):
    """The implementation cannot take a step the spec allows (Mocket's 'missing action')."""


class Driver(ABC):
    """Executes spec actions on an implementation of one matrix model."""

    def __init__(self, row: ModelRow) -> None:
        self.row = row

    @abstractmethod
    def enabled(self) -> list[Action]:
        """Actions the implementation can take now, sorted."""

    @abstractmethod
    def observe(self) -> dict[str, Value]:
        """Implementation state projected onto the spec's VARIABLES."""

    def step(self, action: Action) -> None:
        """Run one action by calling the method of the same name."""
        method = getattr(self, action.name)
        method(**action.params())

    def close(self) -> None:  # noqa: B027 - optional hook; pure models hold no resources
        """Release every resource (agents, sockets, threads). Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # One method per spec action; drivers override all of them.
    @abstractmethod
    def schedule(self) -> None: ...

    @abstractmethod
    def execute_model(self) -> None: ...

    @abstractmethod
    def update_from_output(self) -> None: ...

    @abstractmethod
    def abort(self, r: int) -> None: ...

    @abstractmethod
    def consumer_start_load_kv(self, r: int, w: int) -> None: ...

    @abstractmethod
    def consumer_get_finished(self, r: int, w: int) -> None: ...

    @abstractmethod
    def heartbeat(self, r: int) -> None: ...

    @abstractmethod
    def lease_expire(self, r: int, w: int) -> None: ...

    @abstractmethod
    def store_complete(self, r: int, w: int) -> None: ...
