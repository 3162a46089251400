"""The spec's vocabulary: its action names and parameters, its variables, and the frozen
state types the Python model (kvspec.model), the codec and the drivers share.

Kept apart from the transition functions so that a driver or the codec can name an action
or a variable without importing the model, and so that model.py stays the actions alone.
"""

from __future__ import annotations

from dataclasses import dataclass

# name -> parameter names, in the order the TLA+ operator takes them. A parameter is a
# request id `r` (1..NReq) or a vLLM global rank `w` (0..W-1, see matrix.Topology).
ACTIONS: dict[str, tuple[str, ...]] = {
    "schedule": (),
    "execute_model": (),
    "update_from_output": (),
    "abort": ("r",),
    "consumer_start_load_kv": ("r", "w"),
    "consumer_get_finished": ("r", "w"),
    "push_write": ("r", "w"),
    "push_match": ("r", "w"),
    "push_deferred": ("r", "w"),
    "push_write_done": ("r", "w"),
    "heartbeat": ("r",),
    "lease_expire": ("r", "w"),
    "store_complete": ("r", "w"),
}

# The spec's VARIABLES, in declaration order.
VARIABLES = (
    "req", "needSend", "notProc", "finReqs", "steps", "toProcess", "lease", "expired",
    "notif", "replQ", "extra", "store", "stored", "pend", "unsub", "jobs", "fence", "rd",
    "hb", "agg", "emits", "lateFinish", "clobbered", "published",
)  # fmt: skip

# req[r] values whose blocks are kept after the request finished (a delayed free): a
# finished prefill NIXL still serves, or an aborted request a delaying child (HF3FS) keeps,
# with ("aborted-held") or without ("aborted-empty") blocks.
DELAYED = ("sending", "aborted-held", "aborted-empty")
# req[r] values that hold KV blocks (count against Capacity).
HOLDING = ("running", "sending", "aborted-held")


@dataclass(frozen=True, order=True)
class Action:
    """One action instance: the operator name and its parameter values."""

    name: str
    r: int | None = None
    w: int | None = None

    @property
    def args(self) -> tuple[int, ...]:
        return tuple(v for v in (self.r, self.w) if v is not None)

    def params(self) -> dict[str, int]:
        return dict(zip(ACTIONS[self.name], self.args, strict=True))

    def __str__(self) -> str:
        args = ", ".join(map(str, self.args))
        return f"{self.name}({args})" if args else self.name

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of __str__: 'lease_expire(1, 0)' -> Action('lease_expire', 1, 0)."""
        name, _, rest = text.strip().partition("(")
        name = name.strip()
        if name not in ACTIONS:
            raise ValueError(f"unknown action {name!r}; known: {', '.join(ACTIONS)}")
        vals = [int(x) for x in rest.rstrip(") ").split(",") if x.strip()]
        names = ACTIONS[name]
        if len(vals) != len(names):
            raise ValueError(f"{name} takes {len(names)} parameters, got {len(vals)}")
        kw = dict(zip(names, vals, strict=True))
        return Action(name, kw.get("r"), kw.get("w"))


Reqs = frozenset[int]
PerRank = tuple[Reqs, ...]  # index w in 0..W-1
EMPTY: Reqs = frozenset()


@dataclass(frozen=True)
class Step:
    """One element of `steps`: a scheduled step's connector metadata and its outputs."""

    batch: Reqs
    toSend: Reqs
    notProc: Reqs
    fin: Reqs  # scheduler_output.finished_req_ids
    jobs: Reqs  # OffloadingConnectorMetadata.store_jobs (one job per request)
    flush: Reqs  # OffloadingConnectorMetadata.jobs_to_flush
    reused: Reqs  # requests whose freed block this step's batch is allocated
    ran: bool
    out: PerRank
    ack: PerRank  # per rank: OffloadingWorkerMetadata.completed_jobs


@dataclass(frozen=True)
class State:
    """The spec's 24 variables. Functions over Reqs are tuples indexed by r - 1."""

    req: tuple[str, ...]
    needSend: Reqs
    notProc: Reqs
    finReqs: Reqs
    steps: tuple[Step, ...]
    toProcess: PerRank
    lease: PerRank
    expired: PerRank
    notif: PerRank
    replQ: PerRank
    extra: PerRank
    store: PerRank
    stored: PerRank
    pend: PerRank
    unsub: PerRank
    jobs: tuple[int, ...]
    fence: Reqs
    rd: tuple[tuple[str, ...], ...]  # rd[r - 1][w]
    hb: Reqs
    agg: tuple[int, ...]
    emits: tuple[int, ...]
    lateFinish: bool
    clobbered: bool
    published: frozenset[int]


@dataclass(frozen=True)
class RankResult:
    """RankStep(w, m)'s record: one rank's new per-rank state and its report."""

    toProcess: Reqs
    lease: Reqs
    expired: Reqs
    replQ: Reqs
    extra: Reqs
    store: Reqs
    stored: Reqs
    pend: Reqs
    unsub: Reqs
    clobbered: bool
    out: Reqs
    ack: Reqs
