"""The one codec between model states (kvspec.model.State) and the values TLC prints
(kvspec.tlcvalue) or traces store (ITF JSON, kvspec.itf).

`to_values` shapes a state exactly as TLC prints it: functions over 1..NReq are sequences,
functions over ranks are `Fn` (their domain starts at 0), sets are frozensets, the step
records are `Record`s. `from_values` is its inverse and rejects any other shape.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvspec.itf import JSON, value_from_itf, value_to_itf
from kvspec.matrix import ModelRow
from kvspec.tlcvalue import Fn, Record, Value, make_fn
from kvspec.vocab import VARIABLES, PerRank, Reqs, State, Step


def _ranks_fn(w: int, per_rank: PerRank) -> Value:
    # make_fn keeps a 0..W-1 domain as an Fn: TLC prints it as (0 :> .. @@ 1 :> ..).
    return make_fn((x, per_rank[x]) for x in range(w))


_PER_RANK = (
    "toProcess", "lease", "expired", "notif", "replQ", "extra", "store", "stored", "pend",
    "unsub",
)  # fmt: skip


def to_values(row: ModelRow, s: State) -> dict[str, Value]:
    """The state as tlcvalue Values, shaped exactly as TLC prints them."""
    w = row.topology.world_size
    steps = tuple(
        Record.of(
            {
                "batch": st.batch,
                "toSend": st.toSend,
                "notProc": st.notProc,
                "fin": st.fin,
                "jobs": st.jobs,
                "flush": st.flush,
                "reused": st.reused,
                "ran": st.ran,
                "out": _ranks_fn(w, st.out),
                "ack": _ranks_fn(w, st.ack),
            }
        )
        for st in s.steps
    )
    values: dict[str, Value] = {
        "req": s.req,
        "needSend": s.needSend,
        "notProc": s.notProc,
        "finReqs": s.finReqs,
        "steps": steps,
        "hb": s.hb,
        "agg": s.agg,
        "emits": s.emits,
        "lateFinish": s.lateFinish,
        "clobbered": s.clobbered,
        "jobs": s.jobs,
        "fence": s.fence,
        "published": s.published,
        "rd": tuple(make_fn((x, row_rd[x]) for x in range(w)) for row_rd in s.rd),
    }
    for name in _PER_RANK:
        values[name] = _ranks_fn(w, getattr(s, name))
    return {k: values[k] for k in VARIABLES}


def _reqs(v: Value) -> Reqs:
    if not isinstance(v, frozenset) or not all(type(x) is int for x in v):
        raise ValueError(f"expected a set of request ids, got {v!r}")
    return frozenset(x for x in v if type(x) is int)


def _fn_dict(v: Value) -> dict[Value, Value]:
    # A function over 0..W-1 is an Fn; TLC never prints it as a sequence (domain has 0).
    if isinstance(v, Fn):
        return v.as_dict()
    raise ValueError(f"expected a function over ranks, got {v!r}")


def _per_rank(w: int, v: Value) -> PerRank:
    d = _fn_dict(v)
    return tuple(_reqs(d[x]) for x in range(w))


def _int(v: Value) -> int:
    if type(v) is not int:
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def _seq(v: Value, n: int | None = None) -> tuple[Value, ...]:
    if not isinstance(v, tuple) or (n is not None and len(v) != n):
        want = f"a {n}-element sequence" if n is not None else "a sequence"
        raise ValueError(f"expected {want}, got {v!r}")
    return v


def from_values(row: ModelRow, values: Mapping[str, Value]) -> State:
    """Inverse of `to_values` (for TLC dumps and ITF traces); raises ValueError on shape."""
    w, n = row.topology.world_size, row.requests
    missing = set(VARIABLES) - set(values)
    if missing:
        raise ValueError(f"state lacks variables {sorted(missing)}")
    steps: list[Step] = []
    for rec in _seq(values["steps"]):
        if not isinstance(rec, Record):
            raise ValueError(f"steps element is not a record: {rec!r}")
        steps.append(
            Step(
                _reqs(rec["batch"]),
                _reqs(rec["toSend"]),
                _reqs(rec["notProc"]),
                _reqs(rec["fin"]),
                _reqs(rec["jobs"]),
                _reqs(rec["flush"]),
                _reqs(rec["reused"]),
                bool(rec["ran"]),
                _per_rank(w, rec["out"]),
                _per_rank(w, rec["ack"]),
            )  # fmt: skip
        )
    pub = values["published"]
    if not isinstance(pub, frozenset):
        raise ValueError(f"published is not a set: {pub!r}")
    per_rank = {k: _per_rank(w, values[k]) for k in _PER_RANK}
    return State(
        req=tuple(str(x) for x in _seq(values["req"], n)),
        needSend=_reqs(values["needSend"]),
        notProc=_reqs(values["notProc"]),
        finReqs=_reqs(values["finReqs"]),
        steps=tuple(steps),
        rd=tuple(tuple(str(_fn_dict(x)[y]) for y in range(w)) for x in _seq(values["rd"], n)),
        hb=_reqs(values["hb"]),
        agg=tuple(_int(x) for x in _seq(values["agg"], n)),
        emits=tuple(_int(x) for x in _seq(values["emits"], n)),
        lateFinish=bool(values["lateFinish"]),
        clobbered=bool(values["clobbered"]),
        jobs=tuple(_int(x) for x in _seq(values["jobs"], n)),
        fence=_reqs(values["fence"]),
        published=_reqs(pub),
        **per_rank,
    )


def to_itf(row: ModelRow, s: State) -> dict[str, JSON]:
    """The state as an ITF variable map (what traces store and replay compares)."""
    return {k: value_to_itf(v) for k, v in to_values(row, s).items()}


def from_itf(row: ModelRow, state: Mapping[str, JSON]) -> State:
    """An ITF state (keys starting with '#' ignored) as a model State."""
    return from_values(row, {k: value_from_itf(v) for k, v in state.items() if k[:1] != "#"})
