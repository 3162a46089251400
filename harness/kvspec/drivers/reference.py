"""The reference driver: runs kvspec.model, so it conforms to the spec by construction.

Why a driver over the model: it validates traces and the replay machinery without vLLM,
and negative controls (kvspec.drivers.broken) bend it to prove that replay catches bugs.
"""

from __future__ import annotations

from kvspec.codec import to_values
from kvspec.drivers.base import Driver, MissingAction
from kvspec.matrix import ModelRow
from kvspec.model import Action, Model, initial_state
from kvspec.tlcvalue import Value


class ReferenceDriver(Driver):
    """Each action method applies the model function of the same name."""

    def __init__(self, row: ModelRow, model: Model | None = None) -> None:
        super().__init__(row)
        self.model = model or self.make_model(row)
        self.state = initial_state(row)

    def make_model(self, row: ModelRow) -> Model:
        """The transition function; negative controls return a bent one."""
        return Model(row)

    def enabled(self) -> list[Action]:
        return [a for a, _ in self.model.successors(self.state)]

    def observe(self) -> dict[str, Value]:
        return to_values(self.row, self.state)

    def _do(self, a: Action) -> None:
        nxt = self.model.apply(self.state, a)
        if nxt is None:
            raise MissingAction(f"{a} is not enabled in the reference model")
        self.state = nxt

    def schedule(self) -> None:
        self._do(Action("schedule"))

    def execute_model(self) -> None:
        self._do(Action("execute_model"))

    def update_from_output(self) -> None:
        self._do(Action("update_from_output"))

    def abort(self, r: int) -> None:
        self._do(Action("abort", r))

    def consumer_start_load_kv(self, r: int, w: int) -> None:
        self._do(Action("consumer_start_load_kv", r, w))

    def consumer_get_finished(self, r: int, w: int) -> None:
        self._do(Action("consumer_get_finished", r, w))

    def push_write(self, r: int, w: int) -> None:
        self._do(Action("push_write", r, w))

    def push_match(self, r: int, w: int) -> None:
        self._do(Action("push_match", r, w))

    def push_deferred(self, r: int, w: int) -> None:
        self._do(Action("push_deferred", r, w))

    def push_write_done(self, r: int, w: int) -> None:
        self._do(Action("push_write_done", r, w))

    def heartbeat(self, r: int) -> None:
        self._do(Action("heartbeat", r))

    def lease_expire(self, r: int, w: int) -> None:
        self._do(Action("lease_expire", r, w))

    def store_complete(self, r: int, w: int) -> None:
        self._do(Action("store_complete", r, w))
