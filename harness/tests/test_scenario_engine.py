"""kvspec.scenario_engine's client loop (`_generate`) on a fake vLLM engine: the client
aborts at once, or from a timer while the loop waits in step() for the engine core (the
pd-handshake-fail-abort window). No wall clock is raced: the fake step() returns only
once the abort it waits for has been made, whenever that is."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from kvspec.scenario_engine import _generate


@dataclass
class _Out:
    request_id: str
    finished: bool = True
    kv_transfer_params: Any = None
    outputs: list[Any] = field(default_factory=lambda: [_Completion()])


@dataclass
class _Completion:
    token_ids: tuple[int, ...] = (7,)
    finish_reason: str = "error"


class _Engine:
    """step() blocks, as vLLM's does while no output comes, until an abort arrived."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.abort_seen = threading.Event()
        self.in_step = threading.Event()
        self.during_step: bool | None = None

    def add_request(self, rid: str, prompt: Any, sp: Any) -> None:
        self.added.append(rid)

    def abort_request(self, ids: list[str]) -> None:
        if threading.current_thread() is not threading.main_thread():
            # the timer's abort: ordered after the client entered step(), whatever the
            # timer's delay and the machine's load
            assert self.in_step.wait(timeout=120), "the client never stepped"
        self.during_step = self.in_step.is_set()
        self.aborted += ids
        self.abort_seen.set()

    def step(self) -> list[_Out]:
        self.in_step.set()
        assert self.abort_seen.wait(timeout=120), "the timer never aborted"
        return [_Out(r) for r in self.added if r not in self.aborted]


class _LLM:
    def __init__(self) -> None:
        self.llm_engine = _Engine()


def test_an_immediate_abort_comes_before_any_step() -> None:
    llm = _LLM()
    out = _generate(llm, [[1], [2]], [None, None], "d", {1})
    assert llm.llm_engine.aborted == ["d1"] and llm.llm_engine.during_step is False
    assert out[0]["finish"] == "error" and out[1].get("aborted")


def test_a_timed_abort_lands_while_the_client_waits_in_step() -> None:
    llm = _LLM()
    out = _generate(llm, [[1], [2]], [None, None], "d", {1}, abort_after_s=0.01)
    assert llm.llm_engine.aborted == ["d1"]
    assert llm.llm_engine.during_step is True  # the client was in step() when it came
    assert out[0]["finish"] == "error" and out[1].get("aborted")


class _FastEngine(_Engine):
    """step() answers at once: d0 finishes before the timer fires; d1 still waits for
    its KV (no output) until aborted."""

    def step(self) -> list[_Out]:
        self.in_step.set()
        return [_Out("d0")]


class _FastLLM:
    def __init__(self) -> None:
        self.llm_engine = _FastEngine()


def test_a_timed_abort_is_made_before_the_answer_even_if_the_rest_finished_first() -> None:
    llm = _FastLLM()
    out = _generate(llm, [[1], [2]], [None, None], "d", {1}, abort_after_s=0.05)
    assert llm.llm_engine.aborted == ["d1"]  # joined: made before _generate returned
    assert out[1].get("aborted")


class _SilentEngine(_Engine):
    """No output ever comes (a push D waiting for a WRITE that cannot come): a step()
    would wait for ever."""

    def abort_request(self, ids: list[str]) -> None:
        self.aborted += ids  # from the timer thread; nothing waits for a step

    def step(self) -> list[_Out]:
        raise AssertionError("stepped: with every request aborted no output may come")


class _SilentLLM:
    def __init__(self) -> None:
        self.llm_engine = _SilentEngine()


def test_with_every_request_aborted_later_the_client_never_steps() -> None:
    llm = _SilentLLM()
    out = _generate(llm, [[1], [2]], [None, None], "d", {0, 1}, abort_after_s=0.01)
    assert llm.llm_engine.aborted == ["d0", "d1"]  # joined: made before the answer
    assert all(o.get("aborted") for o in out)
