"""The driver interface shared by the reference model and the real-vLLM cluster.

The spec's action vocabulary is `kvspec.model.ACTIONS`: a driver has one method per action,
same name and parameters (`r` a request id, `w` a vLLM global rank, see matrix.Topology).

`observe()` returns the implementation's state projected onto the spec's variables, as
kvspec.tlcvalue values shaped exactly as TLC prints them: functions over 1..NReq are tuples
(sequences), functions over ranks are `Fn`, sets are frozensets, records are `Record`.
Comparison goes through `kvspec.itf.value_to_itf`, so both sides use one canonical JSON.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self

from kvspec.matrix import ModelRow
from kvspec.model import Action
from kvspec.tlcvalue import Value


class MissingAction(Exception):
    """The implementation cannot take a step the spec allows (Mocket's 'missing action').

    Raised only from the implementation's state (a guard that is false), never because a
    wait ran out: that is a WaitTimeout."""


class WaitTimeout(Exception):
    """A wait for the implementation's asynchronous work (a READ, a notification, a
    handshake) expired. A timeout, never a verdict: on a loaded machine a healthy step can
    outlast any limit, so the trace is retried with a longer one, then called inconclusive."""

    def __init__(self, what: str, limit_s: float) -> None:
        super().__init__(f"{what} did not happen in {limit_s}s")
        self.what = what
        self.limit_s = limit_s


def first_line(exc: BaseException, limit: int = 300) -> str:
    """`exc` as one report line: its type and its message's first line (an errored replay,
    kvspec conform / decode --conform; the traceback goes to the log)."""
    msg = str(exc).splitlines()[0][:limit] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


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
        """Run one action by calling the method of the same name. Raises MissingAction when
        the implementation cannot take it, WaitTimeout when a wait for it expired."""
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

    # Push mode (Transfer = "push"). Not abstract while the real-vLLM driver has no push
    # cluster: a driver without it cannot take these steps, which is a missing action.
    def push_write(self, r: int, w: int) -> None:
        raise MissingAction(f"push_write({r}, {w}): this driver does not drive push mode")

    def push_match(self, r: int, w: int) -> None:
        raise MissingAction(f"push_match({r}, {w}): this driver does not drive push mode")

    def push_deferred(self, r: int, w: int) -> None:
        raise MissingAction(f"push_deferred({r}, {w}): this driver does not drive push mode")

    def push_write_done(self, r: int, w: int) -> None:
        raise MissingAction(f"push_write_done({r}, {w}): this driver does not drive push mode")

    @abstractmethod
    def heartbeat(self, r: int) -> None: ...

    @abstractmethod
    def lease_expire(self, r: int, w: int) -> None: ...

    @abstractmethod
    def store_complete(self, r: int, w: int) -> None: ...
