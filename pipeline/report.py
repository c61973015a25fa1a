"""The credit report: one self-contained HTML file (no network needed) with Plotly charts (hover, zoom, legend
toggles), summary tables, a trajectory viewer that colours each assistant token by its advantage (rose
positive, blue-grey negative, as Figure 1 of the C3 paper) and a group view (the samples of one prompt side by
side).

Pure: `figures(data)` turns the gathered aggregates (warehouse/report_data.py) into Plotly figure specs
(plain dicts in Plotly's JSON schema) and `build_report(data, plotly_js)` lays out the page around them; the
caller passes the plotly.js bundle to inline (flows/run.py reads it from the plotly package)."""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from collections import defaultdict
from typing import Any

PALETTE = [
    "#b5475d",
    "#3f6e8c",
    "#c98b2b",
    "#4f8a5b",
    "#7a5195",
    "#8c564b",
    "#2a9d8f",
    "#e76f51",
    "#6c757d",
    "#264653",
    "#9c6644",
    "#5e60ce",
    "#d62728",
    "#17becf",
    "#bcbd22",
    "#1f77b4",
]
MAX_VISIBLE = 6  # lines drawn at first in a chart of many methods; the rest are one legend click away


def _esc(x) -> str:
    return html.escape("" if x is None else str(x))


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        return f"{v:.4g}"
    return _esc(v)


def _num(v) -> float | None:
    """A JSON-safe number (NaN/inf -> None, which Plotly draws as a gap)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def table_html(rows: list[dict], cols: list[str] | None = None, title: str = "") -> str:
    if not rows:
        return (
            f"<h3>{_esc(title)}</h3><p class='muted'>no rows</p>" if title else "<p class='muted'>no rows</p>"
        )
    cols = cols or list(rows[0])
    head = "".join(f"<th>{_esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    t = f"<h3>{_esc(title)}</h3>" if title else ""
    return f"{t}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _colours(methods: list[str]) -> dict[str, str]:
    return {m: PALETTE[i % len(PALETTE)] for i, m in enumerate(methods)}


def _layout(title: str, xtitle: str, ytitle: str, **extra) -> dict[str, Any]:
    layout: dict[str, Any] = {
        "title": {"text": title, "x": 0.01, "font": {"size": 15}},
        "xaxis": {"title": {"text": xtitle}, "zeroline": False},
        "yaxis": {"title": {"text": ytitle}, "zeroline": True, "nticks": 8},
        "legend": {"orientation": "v", "font": {"size": 11}},
        "margin": {"l": 64, "r": 16, "t": 44, "b": 52},
        "height": 380,
        "hovermode": "closest",
        "template": {"layout": {"plot_bgcolor": "#fff", "paper_bgcolor": "#fff"}},
    }
    layout["xaxis"]["gridcolor"] = layout["yaxis"]["gridcolor"] = "#eee"
    layout.update(extra)
    return layout


def _visible(i: int, focus: str | None, method: str) -> bool | str:
    """Few lines at first: the default method and the first MAX_VISIBLE; the others wait in the legend."""
    return True if i < MAX_VISIBLE or method == focus else "legendonly"


def _by_method(rows: list[dict], key: str = "method") -> tuple[list[tuple[str, list[dict]]], dict[str, str]]:
    """Rows grouped by method (sorted) and a colour per method."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r[key] or "(none)"].append(r)
    return sorted(groups.items()), _colours(sorted(groups))


def turn_figure(rows: list[dict], round_: int, focus: str | None) -> dict:
    """Mean turn credit per method with 95% intervals, and below it how many turns each point rests on."""
    by_method, colours = _by_method(rows)
    traces = []
    for i, (method, rs) in enumerate(by_method):
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": _esc(method),  # Plotly reads its labels as markup: text only
                "legendgroup": method,
                "visible": _visible(i, focus, method),
                "x": [r["turn"] for r in rs],
                "y": [_num(r["mean_adv"]) for r in rs],
                "error_y": {"type": "data", "array": [_num(r["ci95"]) for r in rs], "visible": True},
                "customdata": [[r["n"], _num(r["share_positive"])] for r in rs],
                "hovertemplate": f"<b>{_esc(method)}</b><br>turn %{{x}}<br>mean %{{y:.4g}} ± %{{error_y.array:.3g}}"
                "<br>turns %{customdata[0]}<br>positive %{customdata[1]:.0%}<extra></extra>",
                "line": {"color": colours[method]},
            }
        )
    counts: dict[int, int] = {}
    for r in rows:  # every method covers the same turns; the largest count per turn is the number of turns
        counts[r["turn"]] = max(counts.get(r["turn"], 0), int(r["n"]))
    turns = sorted(counts)
    traces.append(
        {
            "type": "bar",
            "name": "turns (n)",
            "x": turns,
            "y": [counts[t] for t in turns],
            "xaxis": "x",
            "yaxis": "y2",
            "marker": {"color": "#bbb"},
            "hovertemplate": "turn %{x}: %{y} trajectories reach it<extra></extra>",
        }
    )
    layout = _layout(
        f"Per-turn credit by method, round {round_} (mean turn advantage, 95% interval)",
        "assistant turn",
        "mean turn advantage",
        height=460,
    )
    layout["yaxis"]["domain"] = [0.3, 1.0]
    layout["yaxis2"] = {
        "domain": [0.0, 0.2],
        "title": {"text": "n"},
        "gridcolor": "#eee",
        "rangemode": "tozero",
    }
    layout["xaxis"]["anchor"] = "y2"
    return {"data": traces, "layout": layout}


def histogram_figure(rows: list[dict], round_: int | None, focus: str | None) -> dict:
    by_method, colours = _by_method(rows)
    traces = []
    for i, (method, rs) in enumerate(by_method):
        total = sum(int(r["tokens"]) for r in rs) or 1
        traces.append(
            {
                "type": "bar",
                "name": _esc(method),  # Plotly reads its labels as markup: text only
                "visible": _visible(i, focus, method) if i != 0 or focus is None else True,
                "x": [_num(r["x"]) for r in rs],
                "width": [_num(r["width"]) for r in rs],
                "y": [int(r["tokens"]) / total for r in rs],
                "customdata": [int(r["tokens"]) for r in rs],
                "opacity": 0.55,
                "marker": {"color": colours[method]},
                "hovertemplate": f"<b>{_esc(method)}</b><br>advantage ≈ %{{x:.3g}}<br>%{{y:.2%}} of tokens"
                "<br>(%{customdata} tokens)<extra></extra>",
            }
        )
    layout = _layout(
        f"Token advantage distribution per method, round {round_}",
        "token advantage",
        "share of the method's assistant tokens",
        barmode="overlay",
    )
    layout["yaxis"]["tickformat"] = ".0%"
    return {"data": traces, "layout": layout}


def outcome_figure(rows: list[dict]) -> dict:
    traces = []
    for outcome, colour in (("success", "#4f8a5b"), ("failure", "#b5475d")):
        rs = [r for r in rows if r["outcome"] == outcome]
        traces.append(
            {
                "type": "bar",
                "name": outcome,
                "x": [_esc(f"{r['method']} · r{r['round']}") for r in rs],
                "y": [_num(r["mean_adv"]) for r in rs],
                "error_y": {"type": "data", "array": [_num(r["ci95"]) for r in rs], "visible": True},
                "customdata": [[r["trajectories"], r["n"]] for r in rs],
                "marker": {"color": colour},
                "hovertemplate": f"{outcome}<br>%{{x}}<br>mean turn advantage %{{y:.4g}} ± %{{error_y.array:.3g}}"
                "<br>%{customdata[0]} trajectories, %{customdata[1]} turns<extra></extra>",
            }
        )
    layout = _layout(
        "Success vs failure: mean turn advantage (95% interval)", "", "mean turn advantage", barmode="group"
    )
    layout["xaxis"]["tickangle"] = -40
    layout["margin"]["b"] = 120
    layout["height"] = 440
    return {"data": traces, "layout": layout}


def disagreement_figure(rows: list[dict], round_: int | None) -> dict:
    methods = sorted({r["method_a"] for r in rows} | {r["method_b"] for r in rows})
    idx = {m: i for i, m in enumerate(methods)}
    z: list[list[float | None]] = [[0.0 if a == b else None for b in methods] for a in methods]
    n: list[list[int]] = [[0 for _ in methods] for _ in methods]
    for r in rows:
        i, j = idx[r["method_a"]], idx[r["method_b"]]
        z[i][j] = z[j][i] = _num(r["share_sign_differs"])
        n[i][j] = n[j][i] = int(r["tokens"] or 0)
    trace = {
        "type": "heatmap",
        "x": [_esc(m) for m in methods],
        "y": [_esc(m) for m in methods],
        "z": z,
        "customdata": n,
        "zmin": 0,
        "zmax": max([v for row in z for v in row if v is not None] + [0.05]),
        "colorscale": "Reds",
        "colorbar": {"title": {"text": "share"}, "tickformat": ".0%"},
        "hovertemplate": "%{y} vs %{x}<br>sign differs on %{z:.1%} of %{customdata} tokens<extra></extra>",
    }
    if len(methods) <= 12:
        trace["texttemplate"] = "%{z:.0%}"
    side = max(380, 90 + 26 * len(methods))
    layout = _layout(
        f"Sign disagreement between methods, round {round_} (share of assistant tokens)",
        "",
        "",
        height=side,
    )
    layout["xaxis"]["tickangle"] = -40
    layout["yaxis"]["autorange"] = "reversed"
    layout["margin"].update(l=140, b=120)
    return {"data": [trace], "layout": layout}


def trends_figure(credit: list[dict], reward: list[dict], focus: str | None) -> dict:
    """Reward and success rate over rounds (left axis of the top panel) and each method's mean |turn
    advantage| (bottom panel)."""
    traces: list[dict[str, Any]] = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "name": name,
            "x": [r["round"] for r in reward],
            "y": [_num(r[key]) for r in reward],
            "yaxis": "y2",
            "line": {"color": colour, "dash": "dot" if key == "success_rate" else "solid"},
            "customdata": [r["trajectories"] for r in reward],
            "hovertemplate": f"round %{{x}}<br>{name} %{{y:.3g}}<br>%{{customdata}} trajectories<extra></extra>",
        }
        for name, key, colour in (
            ("mean reward", "mean_reward", "#222"),
            ("success rate", "success_rate", "#4f8a5b"),
        )
    ]
    by_method, colours = _by_method(credit)
    for i, (method, rs) in enumerate(by_method):
        rs = sorted(rs, key=lambda r: r["round"])
        traces.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": _esc(method),  # Plotly reads its labels as markup: text only
                "visible": _visible(i, focus, method),
                "x": [r["round"] for r in rs],
                "y": [_num(r["mean_abs_adv"]) for r in rs],
                "line": {"color": colours[method]},
                "hovertemplate": f"<b>{_esc(method)}</b><br>round %{{x}}<br>mean |turn advantage| %{{y:.4g}}"
                "<extra></extra>",
            }
        )
    layout = _layout("Trends over rounds", "round", "mean |turn advantage|", height=460)
    layout["yaxis"]["domain"] = [0.0, 0.58]
    layout["yaxis2"] = {"domain": [0.68, 1.0], "title": {"text": "reward"}, "gridcolor": "#eee"}
    layout["xaxis"]["dtick"] = 1
    return {"data": traces, "layout": layout}


TRAIN_PANELS = (
    ("loss", "loss"),
    ("pg_loss", "policy loss"),
    ("entropy", "entropy"),
    ("grad_norm", "grad norm"),
)


def train_figure(rows: list[dict]) -> dict:
    """The trainer's curves (train_metrics): one panel per quantity, one line per method, over optimizer steps
    counted across rounds."""
    by_method, colours = _by_method(rows)
    traces = []
    layout = _layout("Training curves (train_metrics)", "", "", height=520)
    for p, (key, label) in enumerate(TRAIN_PANELS):
        ax = "" if p == 0 else str(p + 1)
        col, row = p % 2, p // 2
        layout[f"xaxis{ax}"] = {
            "domain": [0.0, 0.46] if col == 0 else [0.54, 1.0],
            "anchor": f"y{ax}",
            "title": {"text": "optimizer step (all rounds)" if row == 1 else ""},
            "gridcolor": "#eee",
        }
        layout[f"yaxis{ax}"] = {
            "domain": [0.58, 1.0] if row == 0 else [0.0, 0.4],
            "anchor": f"x{ax}",
            "title": {"text": label},
            "gridcolor": "#eee",
        }
        for method, rs in by_method:
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": _esc(method),  # Plotly reads its labels as markup: text only
                    "legendgroup": method,
                    "showlegend": p == 0,
                    "x": list(range(len(rs))),
                    "y": [_num(r.get(key)) for r in rs],
                    "customdata": [[r["round"], r["step"]] for r in rs],
                    "xaxis": f"x{ax}",
                    "yaxis": f"y{ax}",
                    "line": {"color": colours[method]},
                    "hovertemplate": f"<b>{_esc(method)}</b><br>round %{{customdata[0]}} step %{{customdata[1]}}"
                    f"<br>{label} %{{y:.4g}}<extra></extra>",
                }
            )
    return {"data": traces, "layout": layout}


def categories_figure(rows: list[dict]) -> dict:
    cats = ("progress", "keep", "regression", "delayed", "neutral")
    labels = [_esc(f"{r['method']} · r{r['round']}") for r in rows]
    traces = [
        {
            "type": "bar",
            "name": c,
            "x": labels,
            "y": [int(r[c] or 0) for r in rows],
            "marker": {"color": PALETTE[i]},
            "hovertemplate": f"%{{x}}<br>{c}: %{{y}} turns<extra></extra>",
        }
        for i, c in enumerate(cats)
    ]
    layout = _layout("TCPO credit categories (turns)", "", "turns", barmode="stack")
    layout["xaxis"]["tickangle"] = -40
    layout["margin"]["b"] = 110
    return {"data": traces, "layout": layout}


def weights_figure(rows: list[dict]) -> dict:
    by: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        v = _num(r["w"])
        if v is not None:
            by[_esc(f"{r['method']} · r{r['round']}")].append(round(v, 5))
    colours = _colours(sorted(by))
    traces = [
        {
            "type": "histogram",
            "name": name,
            "x": vs,
            "histnorm": "probability",
            "opacity": 0.6,
            "nbinsx": 30,
            "marker": {"color": colours[name]},
        }
        for name, vs in sorted(by.items())
    ]
    layout = _layout("IAPO routing weights w per action", "w", "share of actions", barmode="overlay")
    layout["xaxis"]["nticks"] = 8
    layout["xaxis"]["tickformat"] = ".3g"
    return {"data": traces, "layout": layout}


def figures(data: dict) -> list[tuple[str, str, dict | None]]:
    """Every chart of the report in page order: (key, note when empty, figure or None when no data)."""
    focus = data.get("default_method")
    out: list[tuple[str, str, dict | None]] = []
    by_round: dict[int, list[dict]] = defaultdict(list)
    for r in data.get("by_turn", []):
        by_round[r["round"]].append(r)
    for rnd in sorted(by_round):
        out.append((f"turns-r{rnd}", "", turn_figure(by_round[rnd], rnd, focus)))
    hist = data.get("histograms") or []
    out.append(
        (
            "histograms",
            "no advantages",
            histogram_figure(hist, data.get("hist_round"), focus) if hist else None,
        )
    )
    outcomes = data.get("outcomes") or []
    out.append(("outcomes", "no advantages", outcome_figure(outcomes) if outcomes else None))
    dis = data.get("disagreement") or []
    out.append(
        (
            "disagreement",
            "one method only: nothing to compare",
            disagreement_figure(dis, data.get("hist_round")) if dis else None,
        )
    )
    rt = data.get("reward_trends") or []
    out.append(
        ("trends", "no rounds", trends_figure(data.get("credit_trends") or [], rt, focus) if rt else None)
    )
    train = data.get("train") or []
    out.append(
        (
            "train",
            "no train_metrics in this lake yet (`creditflow loop`, or `creditflow train --lake`, writes them)",
            train_figure(train) if train else None,
        )
    )
    cats = data.get("categories") or []
    out.append(("categories", "no TCPO method in this lake", categories_figure(cats) if cats else None))
    weights = data.get("weights") or []
    out.append(("weights", "no IAPO method in this lake", weights_figure(weights) if weights else None))
    return out


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;max-width:1500px}
h1{margin-bottom:4px} .muted{color:#777} table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right} th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(620px,1fr));gap:16px}
.chart-box{border:1px solid #eee;border-radius:6px;padding:4px;min-height:120px}
.chart-box .empty{padding:12px}
#viewer{border:1px solid #ccc;border-radius:6px;padding:12px;margin-top:8px}
.step{margin:6px 0;padding:6px 8px;border-left:4px solid #ddd;white-space:pre-wrap;font-family:ui-monospace,Menlo,monospace;font-size:12px;line-height:1.6}
.step.assistant{border-color:#b5475d} .step.user{border-color:#3f6e8c;background:#f7f9fb} .step.tool{border-color:#c98b2b;background:#fcfaf5}
.step.system{border-color:#999;background:#f6f6f6;max-height:120px;overflow:auto}
.role{font-weight:bold;font-family:system-ui;font-size:11px;color:#555;display:block}
.tok{border-radius:2px} .tok.span{text-decoration:underline wavy #d00;text-underline-offset:3px}
.edge{display:inline-block;margin:2px 6px;padding:1px 6px;border-radius:10px;font-size:11px;font-family:system-ui}
.edge.pos{background:#e7f2ea} .edge.neg{background:#f6e3e3}
.controls{display:flex;gap:12px;align-items:center;flex-wrap:wrap} select{font-size:13px}
.legend span{padding:2px 6px;margin-right:4px;font-size:11px}
#group-view{display:grid;gap:8px;grid-auto-flow:column;grid-auto-columns:minmax(260px,1fr);overflow-x:auto;margin-top:8px}
.sample{border:1px solid #ccc;border-radius:6px;padding:6px;min-width:0}
.sample.win{border-top:4px solid #4f8a5b} .sample.lose{border-top:4px solid #b5475d}
.sample .step{font-size:11px;max-height:340px;overflow:auto}
.sample .step.user,.sample .step.tool,.sample .step.system{max-height:90px}
"""

JS = r"""
const DATA = JSON.parse(document.getElementById('report-data').textContent);
const FIGS = JSON.parse(document.getElementById('report-figures').textContent);
const CONFIG = {displaylogo: false, responsive: true, showLink: false, scrollZoom: false};
for (const [key, fig] of Object.entries(FIGS)) {
  const el = document.getElementById('fig-' + key);
  if (el) Plotly.newPlot(el, fig.data, fig.layout, CONFIG);
}
const trajSel = document.getElementById('traj');
const methodSel = document.getElementById('method');
const compareSel = document.getElementById('compare');
const groupSel = document.getElementById('group');
const groupMethodSel = document.getElementById('group-method');
DATA.trajectories.forEach((t, i) => {
  if (t.group_only) return;
  const o = document.createElement('option');
  o.value = i; o.textContent = `round ${t.round} · ${t.traj_id} · reward ${t.reward}`;
  trajSel.appendChild(o);
});
DATA.groups.forEach((g, i) => {
  const o = document.createElement('option');
  o.value = i; o.textContent = `round ${g.round} · group ${g.group_id} · ${g.members.length} samples`;
  groupSel.appendChild(o);
});
function colour(a, scale) {
  if (!a) return 'transparent';
  const x = Math.max(-1, Math.min(1, a / scale));
  const alpha = (0.12 + 0.78 * Math.abs(x)).toFixed(3);
  return x > 0 ? `rgba(214,80,112,${alpha})` : `rgba(84,110,138,${alpha})`;
}
function advOf(t, method, step, j) {
  const m = t.adv[method]; if (!m) return 0;
  const v = m[String(step.i)]; if (v === undefined) return 0;
  return Array.isArray(v) ? (v[j] || 0) : v;
}
function fillMethods(sel, methods, withNone) {
  const prev = sel.value; sel.replaceChildren();
  if (withNone) { const o = document.createElement('option'); o.value=''; o.textContent='(none)'; sel.appendChild(o); }
  methods.forEach(m => { const o = document.createElement('option'); o.value = m; o.textContent = m; sel.appendChild(o); });
  if ([...sel.options].some(o => o.value === prev) && prev) sel.value = prev;
  else if (!withNone && methods.includes(DATA.default_method)) sel.value = DATA.default_method;
}
function scaleOf(ts, methods) {
  let scale = 1e-9;
  for (const t of ts) for (const s of t.steps) { if (s.role !== 'assistant') continue;
    s.pieces.forEach((_, j) => { for (const m of methods) if (m) scale = Math.max(scale, Math.abs(advOf(t, m, s, j))); }); }
  return scale;
}
function el(tag, cls, text) {  // every value from data enters the page as text, never as markup
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function edgesDiv(t) {
  const e = el('div', 'edges');
  e.appendChild(el('span', 'muted', 'dependency edges: '));
  if (!t.edges.length) e.appendChild(el('span', 'muted', 'none'));
  for (const x of t.edges) {
    const s = el('span', 'edge ' + (x.sign > 0 ? 'pos' : 'neg'), `turn ${x.src_turn} → ${x.dst_turn} (${x.type})`);
    s.title = String(x.info_unit || '');
    e.appendChild(s);
  }
  return e;
}
function stepsInto(box, t, rows, scale) {
  const spanAt = {};
  for (const sp of t.spans) { (spanAt[sp.step_idx] = spanAt[sp.step_idx] || []).push(sp); }
  for (const s of t.steps) {
    for (const m of (s.role === 'assistant' ? rows : [null])) {
      const div = document.createElement('div'); div.className = 'step ' + s.role;
      const label = document.createElement('span'); label.className = 'role';
      label.textContent = s.role + (s.turn ? ` · turn ${s.turn}` : '') + (s.score !== null && s.score !== undefined ? ` · verifier ${s.score}` : '') + (s.err ? ' · ERROR' : '') + (m && rows.length > 1 ? ` · ${m}` : '');
      div.appendChild(label);
      const spans = spanAt[s.i] || [];
      s.pieces.forEach((p, j) => {
        const el = document.createElement('span'); el.className = 'tok'; el.textContent = p;
        if (m) { const a = advOf(t, m, s, j); el.style.background = colour(a, scale); el.dataset.adv = a; el.title = `${m}: ${a}`; }
        const sp = spans.find(x => j >= x.token_start && j < x.token_end);
        if (sp) { el.classList.add('span'); el.title += ` | ${sp.behavior} (s=${sp.severity}) ${sp.rule}`; }
        div.appendChild(el);
      });
      box.appendChild(div);
    }
  }
}
function render() {
  if (trajSel.value === '') return;
  const t = DATA.trajectories[trajSel.value];
  const method = methodSel.value, other = compareSel.value;
  const rows = other ? [method, other] : [method];
  const box = document.getElementById('viewer'); box.replaceChildren();
  const head = el('div');
  head.append(el('b', '', t.traj_id), ` · group ${t.group_id} · reward `, el('b', '', t.reward), ` · ${t.source || ''}`);
  box.appendChild(head);
  if (t.edges.length) box.appendChild(edgesDiv(t));
  stepsInto(box, t, rows, scaleOf([t], rows));
}
function renderGroup() {
  const box = document.getElementById('group-view'); box.replaceChildren();
  if (groupSel.value === '') return;
  const g = DATA.groups[groupSel.value];
  const ts = g.members.map(i => DATA.trajectories[i]);
  const m = groupMethodSel.value;
  const scale = scaleOf(ts, [m]);  // one scale for the whole group: samples compare by colour
  for (const t of ts) {
    const col = document.createElement('div');
    col.className = 'sample ' + (t.reward > 0 ? 'win' : 'lose');
    const head = el('div');
    head.append(el('b', '', `sample ${t.sample_idx ?? ''}`), ` · ${t.traj_id} · reward `, el('b', '', t.reward));
    col.appendChild(head);
    col.appendChild(edgesDiv(t));
    stepsInto(col, t, [m], scale);
    box.appendChild(col);
  }
}
function methodsOf(t) { return Object.keys(t.adv); }
trajSel.addEventListener('change', () => { const t = DATA.trajectories[trajSel.value]; fillMethods(methodSel, methodsOf(t), false); fillMethods(compareSel, methodsOf(t), true); render(); });
methodSel.addEventListener('change', render);
compareSel.addEventListener('change', render);
groupSel.addEventListener('change', () => { const g = DATA.groups[groupSel.value]; fillMethods(groupMethodSel, methodsOf(DATA.trajectories[g.members[0]]), false); renderGroup(); });
groupMethodSel.addEventListener('change', renderGroup);
if (trajSel.options.length) {  // open on a trajectory that has the default method, coloured by it
  const first = [...trajSel.options].find(o => DATA.trajectories[o.value].adv[DATA.default_method]);
  if (first) trajSel.value = first.value;
  trajSel.dispatchEvent(new Event('change'));
}
if (groupSel.options.length) {
  const g = [...groupSel.options].find(o => DATA.trajectories[DATA.groups[o.value].members[0]].adv[DATA.default_method]);
  if (g) groupSel.value = g.value;
}
if (groupSel.options.length) groupSel.dispatchEvent(new Event('change'));
"""

SUMMARY_COLS = [
    "round",
    "method",
    "trajectories",
    "assistant_tokens",
    "mean_adv",
    "min_adv",
    "max_adv",
    "positive_tokens",
    "negative_tokens",
]


def _clean(value):
    """JSON-safe: NaN and infinities become null (JSON has neither); other non-JSON scalars become floats."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


VIEWER_KEYS = ("trajectories", "groups", "default_method")


_JSON_HTML = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


def _json_script(element_id: str, value) -> str:
    """Data as JSON in a script element the browser never runs; no `<`, `>` or `&` in it (escaped as `\\u003c`
    ...), so no value can close the element or open a comment or a script inside it."""
    payload = json.dumps(_clean(value), default=_num, separators=(",", ":"), allow_nan=False)
    return f"<script type='application/json' id='{element_id}'>{payload.translate(_JSON_HTML)}</script>"


def _sha256(script: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"


def content_security_policy(*scripts: str) -> str:
    """The page's policy: only the two inline scripts it carries run (by hash: no other script element, no
    inline event handler, no eval); nothing is fetched or sent (connect, images and fonts other than data:,
    frames, forms, base, workers all 'none')."""
    return (
        "default-src 'none'; script-src "
        + " ".join(_sha256(s) for s in scripts)
        + "; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:; connect-src 'none'; media-src 'none'; object-src 'none'; "
        "frame-src 'none'; child-src 'none'; worker-src 'none'; manifest-src 'none'; base-uri 'none'; "
        "form-action 'none'"
    )


def build_report(data: dict, plotly_js: str) -> str:
    """The whole report as one HTML string; `plotly_js` is the plotly.js bundle, inlined."""
    figs = figures(data)
    summary = data["summary"]
    sections = [
        "<h2>Credit by method</h2>"
        + table_html(summary, [c for c in SUMMARY_COLS if not summary or c in summary[0]])
    ]
    spread = data.get("spread") or []
    if spread:
        sections.append(
            table_html(
                [
                    {
                        "method": r["method"],
                        "within-trajectory share of variance": (r["within_var"] or 0) / r["total_var"]
                        if r["total_var"]
                        else 0.0,
                        "mean within-trajectory std": r["mean_within_std"],
                    }
                    for r in spread
                ],
                title=f"How much each method's credit varies within a trajectory (round {data.get('hist_round')};"
                f" the viewer opens on {data.get('default_method')})",
            )
        )
    boxes = []
    for key, note, fig in figs:
        inner = f"<div class='empty muted'>{_esc(note)}</div>" if fig is None else ""
        boxes.append(
            f"<div class='chart-box' data-chart='{_esc(key)}'><div id='fig-{_esc(key)}' class='plot'>{inner}</div></div>"
        )
    sections.append("<h2>Where the credit went</h2><div class='grid'>" + "".join(boxes) + "</div>")
    sections.append("<h2>Detector spans (C3)</h2>" + table_html(data["behaviors"]))
    if data["quarantine"]:
        sections.append("<h2>Quarantine</h2>" + table_html(data["quarantine"]))
    legend = (
        "<span class='legend'><span style='background:rgba(214,80,112,.7)'>positive</span>"
        "<span style='background:rgba(84,110,138,.7);color:#fff'>negative</span>"
        "<span style='text-decoration:underline wavy #d00'>detector span</span></span>"
    )
    sections.append(
        "<h2>Trajectory viewer</h2>"
        "<div class='controls'><label>trajectory <select id='traj'></select></label>"
        "<label>method <select id='method'></select></label>"
        "<label>compare with <select id='compare'></select></label>" + legend + "</div>"
        "<div id='viewer'></div>"
    )
    sections.append(
        "<h2>Group view: the samples of one prompt</h2>"
        "<div class='controls'><label>group <select id='group'></select></label>"
        "<label>method <select id='group-method'></select></label>" + legend + "</div>"
        "<div id='group-view'></div>"
    )
    fig_map = {key: fig for key, _, fig in figs if fig is not None}
    csp = content_security_policy(plotly_js, JS)  # quotes are single: it sits in a double-quoted attribute
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<meta http-equiv='Content-Security-Policy' content=\"{csp}\">"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>creditflow report</title><style>{CSS}</style><script>{plotly_js}</script></head><body>"
        f"<h1>creditflow credit report</h1><p class='muted'>lake {_esc(data['lake'])} · rounds {_esc(data['rounds'])}"
        f" · charts: hover for values, drag to zoom, double-click to reset, click a legend entry to hide or show it</p>"
        + "".join(sections)
        + _json_script("report-data", {k: data.get(k) for k in VIEWER_KEYS})
        + _json_script("report-figures", fig_map)
        + f"<script>{JS}</script></body></html>"
    )
