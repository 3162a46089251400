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
