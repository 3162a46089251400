"""Counterexamples (ITF documents) as sequence diagrams and compact step lists.

Pure functions: an ITF trace of spec/KVCompletion.tla in, text out; what each step did comes
from ``kvspec.counterexample.analyze``. ``render_svg`` draws it as a sequence diagram (one
lane per component, one row per step), ``render_steps`` as one text line per step. A lasso
is marked "loop back to step k", its end by a "stuck" box; the end of a safety
counterexample by a "violated" box.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

from kvspec.counterexample import (
    CONSUMER,
    SCHEDULER,
    Analysis,
    Event,
    FinalKind,
    StepInfo,
    Tone,
    analyze,
    rank_lane,
)
from kvspec.itf import JSON

# ---------------------------------------------------------------- text


def render_steps(
    itf_doc: Mapping[str, JSON],
    *,
    topology: Mapping[str, int] | None = None,
    prop: str | None = None,
) -> list[str]:
    """One line per step (index, action, request, rank, what changed), then loop/final lines.

    Plain ASCII, no colour: usable in a console, Markdown code block or log.
    """
    a = analyze(itf_doc, topology=topology, prop=prop)
    lines = []
    for st in a.steps:
        what = "; ".join(st.changes) if st.changes else (st.events[0].text if st.events else "")
        mark = "*" if st.index == a.loop else " "
        r, w = _dash(st.r), _dash(st.w)
        lines.append(f"{mark}{st.index:>3} {st.action:<23} r={r:<2} w={w:<2} {what}")
    if a.loop_label is not None:
        lines.append(f"     ({a.loop_label})")
    return lines + [f"     {x}" for x in a.final]


def _dash(x: int | None) -> str:
    return "-" if x is None else str(x)


# ---------------------------------------------------------------- SVG

_FONT = "font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace"
_CHAR_W = 6.6  # px per character at font-size 11
_LANE_W = 170
_LEFT = 210  # step labels and the loop bracket
_TOP = 56
_LINE_H = 20
_PAD = 8
_LOOP = "#7b1fa2"
_COLORS: dict[Tone, tuple[str, str, str]] = {  # stroke, fill, text
    "normal": ("#1f4e8c", "#e8f0fb", "#123"),
    "ok": ("#2e7d32", "#e8f5e9", "#1b4d1e"),
    "bad": ("#c62828", "#fdecea", "#8e1b1b"),
    "muted": ("#8a8f98", "#f3f4f6", "#555"),
    "warn": ("#b26a00", "#fff4e0", "#6b4000"),
}
_FINAL_CLASS: dict[FinalKind, str] = {
    "stuck": "stuck-marker", "violation": "violation-marker", "end": "end-marker",
}  # fmt: skip


def _text_w(text: str) -> float:
    return len(text) * _CHAR_W + 12


def _t(
    x: float, y: float, text: str, *, anchor: str = "middle", color: str = "#123",
    size: int = 11, weight: str = "normal",
) -> str:  # fmt: skip
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" font-size="{size}" '
        f'font-weight="{weight}" fill="{color}" style="{_FONT}">{escape(text)}</text>'
    )


def _event_svg(e: Event, cy: float, lane_x: Mapping[str, float], ranks: Sequence[int]) -> str:
    stroke, fill, color = _COLORS[e.tone]
    x1, x2 = lane_x.get(e.src, lane_x[SCHEDULER]), lane_x.get(e.dst, lane_x[SCHEDULER])
    if e.kind == "arrow" and x1 != x2:
        d = 1 if x2 > x1 else -1
        # A heartbeat reaches every rank: a dot on each rank lane the arrow crosses.
        hb = e.src == CONSUMER and e.text.startswith("HB:")
        dots = [f'<circle cx="{lane_x[rank_lane(w)]:.1f}" cy="{cy + 4:.1f}" r="3" '
                f'fill="{stroke}"/>' for w in ranks if hb]  # fmt: skip
        return (
            f'<line class="arrow" x1="{x1:.1f}" y1="{cy + 4:.1f}" x2="{x2 - d * 3:.1f}" '
            f'y2="{cy + 4:.1f}" stroke="{stroke}" stroke-width="1.6"/>'
            f'<polygon points="{x2 - d * 10:.1f},{cy:.1f} {x2:.1f},{cy + 4:.1f} '
            f'{x2 - d * 10:.1f},{cy + 8:.1f}" fill="{stroke}"/>'
            + "".join(dots) + _t((x1 + x2) / 2, cy, e.text, color=color)
        )  # fmt: skip
    if e.kind == "mark":
        return (
            f'<polygon class="mark" points="{x1:.1f},{cy - 4:.1f} {x1 + 7:.1f},{cy + 3:.1f} '
            f'{x1:.1f},{cy + 10:.1f} {x1 - 7:.1f},{cy + 3:.1f}" fill="{stroke}"/>'
            + _t(x1 + 12, cy + 7, e.text, anchor="start", color=color)
        )
    bw = _text_w(e.text)
    bx = x1 - bw / 2 if e.src != SCHEDULER else max(x1 - bw / 2, _LEFT - 2)
    return (
        f'<rect class="box" x="{bx:.1f}" y="{cy - 7:.1f}" width="{bw:.1f}" '
        f'height="17" rx="3" fill="{fill}" stroke="{stroke}"/>'
        + _t(bx + bw / 2, cy + 5, e.text, color=color)
    )


def _step_svg(
    st: StepInfo, y: int, width: int, lane_x: Mapping[str, float], ranks: Sequence[int]
) -> tuple[str, int]:
    """One step's row and its height."""
    h = max(1, len(st.events)) * _LINE_H + 2 * _PAD
    shade = "#fafbfc" if st.index % 2 else "#ffffff"
    tip = escape(f"{st.index} {st.label}: " + ("; ".join(st.changes) or "no change"))
    events = [_event_svg(e, y + _PAD + j * _LINE_H + _LINE_H / 2 + 2, lane_x, ranks)
              for j, e in enumerate(st.events)]  # fmt: skip
    return (
        f'<g class="step" data-step="{st.index}" data-action="{escape(st.action)}">'
        f"<title>{tip}</title>"
        f'<rect class="row-bg" x="0" y="{y:.1f}" width="{width}" height="{h}" fill="{shade}"/>'
        + _t(8, y + _PAD + 14, f"{st.index:>2}", anchor="start", color="#888")
        + _t(30, y + _PAD + 14, st.label, anchor="start", weight="bold", color="#333")
        + "".join(events) + "</g>"
    ), h  # fmt: skip


def _loop_svg(a: Analysis, y0: int, bottom: int, width: int) -> str:
    """The band from the loop's target row to the end, with a bracket back up to it."""
    lx = _LEFT - 14
    return (
        f'<g class="loop-marker" data-loop="{a.loop}">'
        f'<rect x="0" y="{y0:.1f}" width="{width}" height="{bottom - y0:.1f}" '
        f'fill="{_LOOP}" fill-opacity="0.05"/>'
        f'<path d="M {lx + 10} {bottom - 4:.1f} H {lx} V {y0 + 6:.1f} H {lx + 6}" '
        f'fill="none" stroke="{_LOOP}" stroke-width="2"/>'
        f'<polygon points="{lx + 4},{y0 + 1:.1f} {lx + 13},{y0 + 6:.1f} '
        f'{lx + 4},{y0 + 11:.1f}" fill="{_LOOP}"/>'
        + _t(lx - 4, bottom - 6, a.loop_label or "", anchor="end", color=_LOOP, weight="bold")
        + "</g>"
    )


def _final_svg(a: Analysis, y: int, w: float) -> tuple[str, int]:
    """The stuck / violated / reached box and its height."""
    stroke, fill, color = _COLORS["muted" if a.final_kind == "end" else "bad"]
    h = len(a.final) * _LINE_H + 10
    lines = [_t(_LEFT + 22, y + 20 + j * _LINE_H, line, anchor="start", color=color,
                weight="bold", size=12) for j, line in enumerate(a.final)]  # fmt: skip
    return (
        f'<g class="final-marker {_FINAL_CLASS[a.final_kind]}">'
        f'<rect x="{_LEFT + 10}" y="{y:.1f}" width="{w:.1f}" height="{h}" rx="4" '
        f'fill="{fill}" stroke="{stroke}" stroke-width="2"/>' + "".join(lines) + "</g>"
    ), h


def _lane_svg(key: str, label: str, x: float, top_y: int, bottom: int) -> str:
    bw = min(_LANE_W - 10, _text_w(label))
    return (
        f'<g class="lane" data-lane="{escape(key)}">'
        f'<line x1="{x:.1f}" y1="{top_y + 26}" x2="{x:.1f}" y2="{bottom:.1f}" '
        f'stroke="#b0b6bf" stroke-dasharray="4 3"/>'
        f'<rect x="{x - bw / 2:.1f}" y="{top_y}" width="{bw:.1f}" height="24" rx="4" '
        f'fill="#263238"/>' + _t(x, top_y + 16, label, color="#fff", size=10) + "</g>"
    )


def render_svg(
    itf_doc: Mapping[str, JSON],
    *,
    topology: Mapping[str, int] | None = None,
    prop: str | None = None,
    title: str | None = None,
    standalone: bool = True,
) -> str:
    """The counterexample as an SVG sequence diagram.

    Structure (stable, tests rely on it): one ``<g class="lane" data-lane=KEY>`` per lane,
    one ``<g class="step" data-step=i data-action=NAME>`` per state (the initial state
    included), ``<g class="loop-marker" data-loop=k>`` for lassos and
    ``<g class="final-marker stuck-marker|violation-marker">`` at the end.
    ``standalone=False`` omits the XML namespace (for inline SVG in HTML).
    """
    a = analyze(itf_doc, topology=topology, prop=prop)
    top_y = _TOP if title else 12
    lane_x = {key: _LEFT + _LANE_W * (i + 0.5) for i, (key, _) in enumerate(a.lanes)}
    final_w = max([_LANE_W * len(a.lanes) - 20] + [_text_w(x) + 20 for x in a.final])
    width = max(_LEFT + _LANE_W * len(a.lanes) + 20, int(_LEFT + 30 + final_w))
    body: list[str] = []
    row_top: dict[int, int] = {}
    y = top_y + 34
    for st in a.steps:
        row_top[st.index] = y
        svg, h = _step_svg(st, y, width, lane_x, a.ranks)
        body.append(svg)
        y += h
    bottom = y
    if a.loop is not None:
        body.append(_loop_svg(a, row_top[a.loop], bottom, width))
    y += 10
    if a.final:
        svg, h = _final_svg(a, y, final_w)
        body.append(svg)
        y += h
    height = y + 16
    head = [_lane_svg(key, label, lane_x[key], top_y, bottom) for key, label in a.lanes]
    top = _t(8, 22, title, anchor="start", size=14, weight="bold", color="#222") if title else ""
    ns = ' xmlns="http://www.w3.org/2000/svg"' if standalone else ""
    return (
        f'<svg{ns} class="seqdiag" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">'
        f'<rect width="{width}" height="{height}" fill="#fff"/>'
        + top + "".join(body) + "".join(head) + "</svg>"
    )  # fmt: skip
