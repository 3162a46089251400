"""`kvspec check` scheduling (the verdicts themselves are checked by `make test`'s fast tier)."""

from __future__ import annotations

from kvspec.check import estimated_cost
from kvspec.matrix import load_matrix


def test_rows_start_longest_first() -> None:
    rows = load_matrix()
    order = [r.name for r in sorted(rows, key=estimated_cost, reverse=True)]
    # The measured long pole (TP2 x PCP2 + delaying child, ~100 s of TLC) must start first,
    # the cheapest PCP=1 TP=1 NIXL rows last.
    assert order[0] == "pcp2-tp2-fixed-offload-delaying"
    cheapest = {r.name for r in rows if estimated_cost(r) == min(map(estimated_cost, rows))}
    assert cheapest == {
        r.name
        for r in rows
        if r.name.startswith("pcp1-tp1-") and "nixl" in r.name and "offload" not in r.name
    }
