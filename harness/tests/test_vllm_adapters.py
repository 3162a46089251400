"""The version adapters (drivers/vllm_adapters.py): a name is taken from the first location
that imports, and a vLLM without it is one line naming the symbol, where it was looked for
and the supported range (no vLLM import needed: the table is the function's argument)."""

from __future__ import annotations

import json

import pytest
from kvspec.drivers.vllm_adapters import SUPPORTED, Unsupported, resolve

TABLE = {
    "moved": (("kvspec_no_such_module", "dumps"), ("json", "dumps")),
    "gone": (("json", "no_such_attr"), ("kvspec_no_such_module", "x")),
    "module": (("json", None),),
}


def test_the_first_location_that_imports_wins() -> None:
    assert resolve("moved", TABLE) is json.dumps
    assert resolve("module", TABLE) is json


def test_a_missing_symbol_is_one_line_with_where_and_the_range() -> None:
    with pytest.raises(Unsupported) as exc:
        resolve("gone", TABLE)
    msg = str(exc.value)
    assert "\n" not in msg and "has no gone" in msg and SUPPORTED in msg
    assert "json:no_such_attr" in msg and "kvspec_no_such_module:x" in msg


def test_a_dataclass_is_built_from_the_fields_it_declares() -> None:
    # vllm 0.34.0's ModelRunnerOutput has no req_id_to_index (its scheduler indexes
    # req_ids); older releases' schedulers read it. One call builds both.
    import dataclasses

    from kvspec.drivers.vllm_adapters import with_known_fields

    @dataclasses.dataclass
    class New:
        req_ids: list[str]

    @dataclasses.dataclass
    class Old:
        req_ids: list[str]
        req_id_to_index: dict[str, int]

    fields = {"req_ids": ["a"], "req_id_to_index": {"a": 0}}
    assert with_known_fields(New, **fields) == New(["a"])
    assert with_known_fields(Old, **fields) == Old(["a"], {"a": 0})


def test_the_x86_triton_check_is_waived_only_while_a_config_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vllm 0.34.0's CPU platform refuses a VllmConfig on x86 without triton-cpu (its model
    # runner's kernels); the drivers run no model. The flag reads True inside, False after,
    # even when the build raises; a release or host with Triton is untouched.
    import sys
    from types import SimpleNamespace

    from kvspec.drivers.vllm_adapters import runner_check_waived

    tu = SimpleNamespace(HAS_TRITON=False)
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", tu)
    with runner_check_waived():
        assert tu.HAS_TRITON is True
    assert tu.HAS_TRITON is False
    with pytest.raises(RuntimeError), runner_check_waived():
        raise RuntimeError("the config failed")
    assert tu.HAS_TRITON is False
    has = SimpleNamespace(HAS_TRITON=True)
    monkeypatch.setitem(sys.modules, "vllm.triton_utils", has)
    with runner_check_waived():
        assert has.HAS_TRITON is True
    assert has.HAS_TRITON is True
