"""The report's sweep sections: `kvspec lease`, `clock`, `decode` and `blocks` results
(their JSON) and the decode side's counterexamples drawn as a round trip, one lane per engine
part: D's scheduler, D's workers, the producer ranks (the ITF files `kvspec decode` keeps
under its --out directory)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvspec.decode_traces import plain
from kvspec.itf import value_from_itf

# Decode.tla variables per lane, in the order they are shown.
LANES = {
    # hbOff: push's proposed registration timeout; hfl: receives a worker reports failed
    "D scheduler": ("st", "fRecv", "fFail", "sendPend", "crashed", "steps", "hbOff"),
    "D workers": ("reg", "xf", "h", "hfl"),
    "producer ranks": ("pin", "pst"),
}
# Map entries not worth a cell: an empty set or map, False, 0, "none" (as _short prints them).
_EMPTY = (":{}", ":[]", ":False", ":0", ":none")


def _short(v: Any) -> str:
    """A compact text for a plain value: sets as {..}, maps as k:v, empty parts dropped."""
    if isinstance(v, dict):
        parts = [f"{k}:{_short(x)}" for k, x in sorted(v.items(), key=str)]
        return "[" + " ".join(p for p in parts if not p.endswith(_EMPTY)) + "]"
    if isinstance(v, frozenset):
        return "{" + ",".join(sorted(map(str, v))) + "}"
    return str(v)


def _lane(state: Mapping[str, Any], prev: Mapping[str, Any] | None, names: tuple[str, ...]) -> str:
    """The lane's variables that changed since the previous state (all at step 0)."""
    shown = [n for n in names if n in state and (prev is None or state[n] != prev.get(n))]
    return "; ".join(f"{n} {_short(state[n])}" for n in shown) or "-"


def decode_lanes(doc: Mapping[str, Any]) -> list[dict[str, str]]:
    """One row per step of a Decode.tla ITF trace: the action and each lane's changes."""
    rows: list[dict[str, str]] = []
    prev: dict[str, Any] | None = None
    for i, st in enumerate(doc.get("states", [])):
        state = {k: plain(value_from_itf(v)) for k, v in st.items() if k != "#meta"}
        action = str(st.get("#meta", {}).get("action", "init" if i == 0 else "?"))
        row = {"step": str(i), "action": "init" if i == 0 else action}
        row.update({lane: _lane(state, prev, names) for lane, names in LANES.items()})
        rows.append(row)
        prev = state
    return rows


def _rows(data: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "name": r["name"],
            "constants": ", ".join(f"{k}={v}" for k, v in dict(r.get("constants", {})).items()),
            "requests": r.get("requests", 1),
            "verdicts": dict(r.get("verdicts", {})),
            "unexpected": list(r.get("unexpected", [])),
            "inconclusive": list(r.get("inconclusive", [])),
        }
        for r in data
    ]


def _load(path: Path) -> list[Mapping[str, Any]] | None:  # a JSON list, else None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, list) else None


def offload_line(path: Path) -> str | None:
    """`kvspec blocks --offload-probe --json` (build/offload-probe.json) as one line: the
    installed vLLM's offload fence on D and whether the matrix agrees; None when absent."""
    from kvspec.versions import offload_verdict

    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    return f"vLLM {doc.get('vllm', '?')}: {offload_verdict(doc)}"


def release_rows(path: Path) -> list[dict[str, str]] | None:
    """`make versions` (build/versions.json) as release -> the designs it conforms to
    (producer side, `kvspec conform`), the first divergence elsewhere, the decode side's
    verdict; None when the sweep was not run."""
    data = _load(path)
    if data is None:
        return None
    rows = []
    for r in data:
        lines = [str(x) for x in r.get("summary", [])]
        conforms = [ln.split(" conforms to ", 1)[1] for ln in lines if " conforms to " in ln]
        diverges = [ln.split(" does not conform to ", 1)[1] for ln in lines
                    if " does not conform to " in ln]  # fmt: skip
        rows.append({
            "release": str(r.get("release", "?")),
            "conforms": "; ".join(conforms) or str(r.get("error") or "none"),
            "diverges": "; ".join(diverges) or "-",
            "decode": str(r.get("decode", "not run")),
            "blocks": str(r.get("blocks", "not run")),
            "offload": str(r.get("offload", "not run")),
        })  # fmt: skip
    return rows


def recorded_rows(path: Path) -> list[dict[str, str]] | None:
    """The committed real-engine recordings validated per side (`bench/validate.py --json`,
    build/recorded.json): which designs admit each, "rejected by every design", or why the
    side was not mapped; None when it was not run."""
    data = _load(path)
    if data is None:
        return None
    rows = []
    for r in data:
        said = [str(x) for x in r.get("admitted", [])]
        if said and said[0].startswith("not mapped"):
            verdict = said[0]
        else:
            verdict = "admitted by " + ", ".join(said) if said else "rejected by every design"
        rows.append({"recording": str(r.get("recording", "?")), "side": str(r.get("side", "?")),
                     "events": str(r.get("events", 0)), "verdict": verdict})  # fmt: skip
    return rows


def sweeps_context(
    lease_json: Path, decode_json: Path, decode_dir: Path,
    versions_json: Path = Path("build/versions.json"),
    clock_json: Path = Path("build/clock.json"),
    recorded_json: Path = Path("build/recorded.json"),
    blocks_json: Path = Path("build/blocks.json"),
    offload_json: Path = Path("build/offload-probe.json"),
) -> dict[str, Any]:  # fmt: skip
    """{lease, clock, decode, blocks, releases, recorded, offload}: rows (None when that
    sweep's JSON is missing) and, for decode, each violated invariant's counterexample as
    lanes; offload: the installed vLLM's offload fence on D (`kvspec blocks
    --offload-probe`, a line; None when it was not run)."""
    out: dict[str, Any] = {"releases": release_rows(versions_json),
                           "recorded": recorded_rows(recorded_json),
                           "offload": offload_line(offload_json)}  # fmt: skip
    sweeps = (("lease", lease_json), ("clock", clock_json), ("decode", decode_json),
              ("blocks", blocks_json))  # fmt: skip
    for name, path in sweeps:
        data = _load(path)
        out[name] = {
            "rows": None if data is None else _rows(data),
            "properties": sorted({p for r in data or [] for p in r.get("verdicts", {})}),
            "json": str(path),
        }
    cexes = []
    for r in _load(decode_json) or []:
        for prop, verdict in sorted(dict(r.get("verdicts", {})).items()):
            f = decode_dir / str(r["name"]) / f"{prop}.itf.json"
            if verdict == "violated" and not prop.startswith("Reach") and f.is_file():
                steps = decode_lanes(json.loads(f.read_text()))
                cexes.append({"row": r["name"], "property": prop, "steps": steps})
    out["decode"]["cexes"] = cexes
    out["lanes"] = list(LANES)
    return out
