"""The design-review artifact: ``report/index.html`` and ``report/REPORT.md``.

``build_report`` renders the results of the other stages (check, conform, traces, mutants;
the last three optional) with the jinja2 templates in ``kvspec/templates``. The HTML is
self-contained: inline CSS, inline SVG sequence diagrams (``kvspec.diagram``), no scripts,
no network. ``kvspec.review`` is the pipeline behind ``kvspec review`` that feeds it.

A missing input (``None``) or one of the form ``{"not_run": "reason"}`` makes its section
say "not run" and how to run it.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from kvspec.diagram import render_steps, render_svg
from kvspec.itf import JSON

COMMANDS = {
    "check": "kvspec check --json build/check/results.json",
    "conform": "kvspec conform --driver vllm --json build/conform.json",
    "traces": "kvspec traces --check --json build/traces.json",
    "mutants": "kvspec mutants --json build/mutants.json",
    "review": "make review",
}
REACHABILITY_PREFIX = "Reach"


# ---------------------------------------------------------------- context


def _num(v: JSON, digits: int = 1) -> str:
    if isinstance(v, bool) or v is None:
        return "-"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def _topology(t: JSON) -> str:
    if isinstance(t, Mapping):
        return f"tp{t.get('tp', '?')} pp{t.get('pp', '?')} pcp{t.get('pcp', '?')}"
    return str(t or "-")


def _slug(*parts: str) -> str:
    raw = "-".join(parts)
    return "cex-" + "".join(c if c.isalnum() or c in "-_" else "-" for c in raw)


def _not_run(data: Mapping[str, JSON] | None, what: str) -> str | None:
    if data is None:
        return f"no {what} results"
    reason = data.get("not_run")
    return str(reason) if reason else None


def _check_context(check: Mapping[str, JSON]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    cexes: list[dict[str, Any]] = []
    results = check.get("results") or []
    seen_ids: set[str] = set()
    for res in results:
        model = str(res.get("model", "?"))
        prop = str(res.get("property", "?"))
        expected = str(res.get("expected", "-"))
        verdict = str(res.get("verdict", "error"))
        mismatch = verdict != expected
        cex_id = None
        doc = res.get("counterexample")
        if verdict == "violated" and isinstance(doc, Mapping):
            cex_id = _slug(model, prop)
            while cex_id in seen_ids:
                cex_id += "-x"
            seen_ids.add(cex_id)
            topo = res.get("topology") if isinstance(res.get("topology"), Mapping) else None
            title = f"{model}: {prop} ({res.get('variant', '?')}, {res.get('composition', '?')}, "
            title += f"{_topology(res.get('topology'))})"
            entry: dict[str, Any] = {
                "id": cex_id,
                "title": title,
                "expected": expected,
                "verdict": verdict,
                "mismatch": mismatch,
                "witness": prop.startswith(REACHABILITY_PREFIX) and not mismatch,
                "repro": f"kvspec check --only {model}",
                "svg": None,
                "error": None,
                "steps": [],
                "n_steps": len(doc.get("states") or []),
            }
            try:
                entry["svg"] = Markup(render_svg(doc, topology=topo, prop=prop, standalone=False))
                entry["steps"] = render_steps(doc, topology=topo, prop=prop)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
            cexes.append(entry)
        rows.append(
            {
                "model": model,
                "variant": str(res.get("variant", "-")),
                "composition": str(res.get("composition", "-")),
                "topology": _topology(res.get("topology")),
                "property": prop,
                "expected": expected,
                "verdict": verdict,
                "mismatch": mismatch,
                "states": _num(res.get("distinct_states")),
                "seconds": _num(res.get("seconds")),
                "cex_id": cex_id,
            }
        )
    # Unexpected results first, then real violations, then the vacuity witnesses.
    cexes.sort(key=lambda c: (not c["mismatch"], c["witness"]))
    summary = {
        "models": len({r["model"] for r in rows}),
        "checks": len(rows),
        "mismatches": sum(1 for r in rows if r["mismatch"]),
        "violated": len(cexes),
    }
    return {"rows": rows, "cexes": cexes, "summary": summary, "design": design_matrix(results)}


def design_matrix(results: list[Mapping[str, JSON]]) -> dict[str, Any]:
    """The variant x composition x topology view: one cell per model, naming the properties
    it violates (vacuity guards left out) and flagging any verdict not as expected."""
    comps: list[str] = []
    cells: dict[tuple[str, str], dict[str, Any]] = {}
    order: list[str] = []
    for res in results:
        comp = str(res.get("composition", "-"))
        if comp not in comps:
            comps.append(comp)
        row_key = f"{res.get('variant', '-')} | {_topology(res.get('topology'))}"
        if res.get("async_scheduling"):
            row_key += " | async"
        if row_key not in order:
            order.append(row_key)
        cell = cells.setdefault(
            (row_key, comp), {"violated": [], "mismatch": False, "models": set()}
        )
        cell["models"].add(str(res.get("model", "?")))
        prop = str(res.get("property", "?"))
        if res.get("verdict") != res.get("expected"):
            cell["mismatch"] = True
        if res.get("verdict") == "violated" and not prop.startswith(REACHABILITY_PREFIX):
            cell["violated"].append(prop)
        elif res.get("verdict") in ("error", "timeout"):
            cell["violated"].append(f"{prop}: {res.get('verdict')}")
    rows = []
    for key in order:
        out: list[dict[str, Any] | None] = []
        for comp in comps:
            found = cells.get((key, comp))
            if found is None:
                out.append(None)
                continue
            text = ", ".join(sorted(set(found["violated"]))) or "all hold"
            out.append(
                {
                    "text": text,
                    "bad": bool(found["violated"]),
                    "mismatch": found["mismatch"],
                    "models": sorted(found["models"]),
                }
            )
        rows.append({"key": key, "cells": out})
    return {"compositions": comps, "rows": rows}


def _divergence(d: JSON) -> str | None:
    if d is None:
        return None
    if isinstance(d, Mapping):
        return "\n".join(
            f"{k}: {json.dumps(v, sort_keys=True) if not isinstance(v, str) else v}"
            for k, v in d.items()
        )
    return str(d)


def _conform_verdict(
    ok: bool, no_divergence: bool, all_counted: bool, inconclusive: int, errored: int = 0
) -> str:
    """A variant whose only non-conforming traces timed out (or raised: errored) has no
    divergence: it is inconclusive (errored) on them, not diverging."""
    if ok:
        return "conforms"
    if no_divergence and all_counted and (inconclusive or errored):
        parts = [f"inconclusive on {inconclusive}"] if inconclusive else []
        return ", ".join(parts + ([f"errored on {errored}"] if errored else []))
    return "diverges"


def _conform_context(conform: Mapping[str, JSON] | None) -> dict[str, Any]:
    reason = _not_run(conform, "conformance")
    if reason or conform is None:
        return {"not_run": reason}
    variants = []
    raw = conform.get("variants") or {}
    for name, v in sorted(raw.items()):
        traces, ok_n = v.get("traces", 0), v.get("conforming", 0)
        inconclusive = v.get("inconclusive", 0)  # timed out on every attempt: no verdict
        errored = v.get("errored", 0)  # the replay raised: no verdict either
        div = _divergence(v.get("first_divergence"))
        ok = div is None and ok_n == traces
        variants.append(
            {
                "name": name,
                "traces": traces,
                "conforming": ok_n,
                "ok": ok,
                "verdict": _conform_verdict(
                    ok, div is None, ok_n + inconclusive + errored == traces, inconclusive,
                    errored,
                ),
                "divergence": div or _divergence(v.get("first_timeout")),
            }
        )
    return {
        "not_run": None,
        "vllm": conform.get("vllm", "?"),
        "device": conform.get("device", "?"),
        "impl_patch": conform.get("impl_patch"),
        "variants": variants,
    }


def _traces_context(traces: Mapping[str, JSON] | None) -> dict[str, Any]:
    reason = _not_run(traces, "trace coverage")
    if reason or traces is None:
        return {"not_run": reason}
    raw = traces.get("models", traces)
    items: list[tuple[str, Mapping[str, JSON]]] = []
    if isinstance(raw, list):
        items = [(str(m.get("model", m.get("name", "?"))), m) for m in raw]
    elif isinstance(raw, Mapping):
        items = [(str(k), v) for k, v in raw.items() if isinstance(v, Mapping)]
    models = []
    for name, m in items:
        total, covered = int(m.get("edges_total", 0) or 0), int(m.get("edges_covered", 0) or 0)
        pct = round(100.0 * covered / total, 1) if total else 0.0
        models.append(
            {
                "model": name,
                "total": total,
                "covered": covered,
                "pct": pct,
                "traces": _num(m.get("traces")),
                "steps": _num(m.get("steps")),
            }
        )
    return {"not_run": None, "models": models}


def _mutants_context(mutants: Mapping[str, JSON] | None) -> dict[str, Any]:
    reason = _not_run(mutants, "mutation")
    if reason or mutants is None:
        return {"not_run": reason}
    rows = []
    for m in mutants.get("mutants") or []:
        rows.append(
            {
                "name": m.get("name", "?"),
                "description": m.get("description", ""),
                "target": m.get("target", ""),
                "killed": bool(m.get("killed")),
                "trace": m.get("trace") or "-",
                "step": "-" if m.get("step") is None else m.get("step"),
                "seconds": _num(m.get("seconds")),
            }
        )
    killed = sum(1 for r in rows if r["killed"])
    rate = mutants.get("kill_rate")
    if not isinstance(rate, int | float):
        rate = killed / len(rows) if rows else 0.0
    return {
        "not_run": None,
        "rows": rows,
        "killed": killed,
        "total": len(rows),
        "kill_rate": f"{100.0 * float(rate):.0f}%",
    }


def _repro(ctx: Mapping[str, Any]) -> list[str]:
    lines = [
        "make review                      # the whole pipeline: check, conform, report",
        COMMANDS["check"],
    ]
    flagged = [r for r in ctx["rows"] if r["mismatch"]]
    seen: set[str] = set()
    for r in flagged:
        if r["model"] not in seen:
            seen.add(r["model"])
            lines.append(f"kvspec check --only {r['model']}   # {r['property']}: unexpected")
    lines += [COMMANDS["conform"], COMMANDS["traces"], COMMANDS["mutants"]]
    lines.append("kvspec review --out report/")
    return lines


def _md_cell(v: object) -> str:
    return str(v).replace("|", "\\|").replace("\n", "<br>")


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("kvspec", "templates"),
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2", "html")),
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["md"] = _md_cell
    return env


_NO_SWEEPS: dict[str, Any] = {
    "lease": {"rows": None}, "clock": {"rows": None}, "decode": {"rows": None, "cexes": []},
    "blocks": {"rows": None},
}  # fmt: skip


def build_report(
    check: dict[str, Any],
    conform: dict[str, Any] | None,
    traces: dict[str, Any] | None,
    mutants: dict[str, Any] | None,
    versions: dict[str, str],
    out: Path,
    sweeps: dict[str, Any] | None = None,
) -> None:
    """Write ``out/index.html`` and ``out/REPORT.md`` from the stages' JSON results
    (`sweeps`: kvspec.report_sweeps.sweeps_context, the lease and decode sweeps)."""
    ctx: dict[str, Any] = _check_context(check)
    vers = dict(versions)
    if check.get("tlc") and "TLC" not in vers:
        vers = {"TLC": str(check["tlc"]), **vers}
    if conform and conform.get("vllm") and "vLLM" not in vers:
        vers["vLLM"] = str(conform["vllm"])
    ctx.update(
        conform=_conform_context(conform),
        traces=_traces_context(traces),
        mutants=_mutants_context(mutants),
        sweeps=sweeps or _NO_SWEEPS,
        versions=vers,
        commands=COMMANDS,
        generated=_dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    )
    from kvspec.bugs import bugs_context, observed_verdicts

    ctx["bugs"] = bugs_context(observed_verdicts(check.get("results") or [], sweeps or {}))
    ctx["repro"] = _repro(ctx)
    env = _env()
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html").write_text(env.get_template("index.html.j2").render(ctx))
    (out / "REPORT.md").write_text(env.get_template("REPORT.md.j2").render(ctx))
