"""The credit report: one self-contained HTML file (no network needed) with summary tables, SVG plots and
a trajectory viewer that colours each assistant token by its advantage (rose positive, blue-grey negative,
as Figure 1 of the C3 paper), with a method switcher and the detector spans and dependency edges on it."""

from __future__ import annotations

import html
import json
import math
from collections import defaultdict

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
]


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


def line_chart(
    series: dict[str, list[tuple[float, float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    width: int = 640,
    height: int = 300,
) -> str:
    """Lines (x, y) per series, as inline SVG."""
    pts = [p for s in series.values() for p in s if p[1] is not None and math.isfinite(p[1])]
    if not pts:
        return f"<h3>{_esc(title)}</h3><p class='muted'>no data</p>"
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(0.0, min(p[1] for p in pts)), max(0.0, max(p[1] for p in pts))
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    ml, mr, mt, mb = 56, 150, 24, 40
    W, H = width - ml - mr, height - mt - mb

    def sx(x):
        return ml + (x - x0) / (x1 - x0) * W

    def sy(y):
        return mt + (1 - (y - y0) / (y1 - y0)) * H

    parts = [
        f"<svg class='chart' viewBox='0 0 {width} {height}' width='{width}' height='{height}' role='img'>"
    ]
    parts.append(
        f"<line x1='{ml}' y1='{sy(0):.1f}' x2='{ml + W}' y2='{sy(0):.1f}' stroke='#999' stroke-dasharray='3,3'/>"
    )
    parts.append(f"<line x1='{ml}' y1='{mt}' x2='{ml}' y2='{mt + H}' stroke='#333'/>")
    parts.append(f"<line x1='{ml}' y1='{mt + H}' x2='{ml + W}' y2='{mt + H}' stroke='#333'/>")
    for frac in (0, 0.5, 1):
        yv = y0 + frac * (y1 - y0)
        parts.append(
            f"<text x='{ml - 6}' y='{sy(yv) + 4:.1f}' text-anchor='end' class='tick'>{yv:.3g}</text>"
        )
    xs = sorted({p[0] for p in pts})
    step = max(1, len(xs) // 10)
    for xv in xs[::step]:
        parts.append(
            f"<text x='{sx(xv):.1f}' y='{mt + H + 16}' text-anchor='middle' class='tick'>{xv:g}</text>"
        )
    parts.append(
        f"<text x='{ml + W / 2}' y='{height - 6}' text-anchor='middle' class='axis'>{_esc(xlabel)}</text>"
    )
    parts.append(
        f"<text x='14' y='{mt + H / 2}' text-anchor='middle' class='axis' transform='rotate(-90 14 {mt + H / 2})'>{_esc(ylabel)}</text>"
    )
    for i, (name, s) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        s = [p for p in s if p[1] is not None and math.isfinite(p[1])]
        if not s:
            continue
        d = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(s))
        parts.append(
            f"<path d='{d}' fill='none' stroke='{color}' stroke-width='2'><title>{_esc(name)}</title></path>"
        )
        for x, y in s:
            parts.append(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.5' fill='{color}'/>")
        ly = mt + 12 + i * 14
        parts.append(
            f"<rect x='{ml + W + 10}' y='{ly - 8}' width='10' height='10' fill='{color}'/>"
            f"<text x='{ml + W + 24}' y='{ly + 1}' class='tick'>{_esc(name)}</text>"
        )
    parts.append("</svg>")
    return f"<h3>{_esc(title)}</h3>" + "".join(parts)


def bar_chart(
    groups: dict[str, dict[str, float]], title: str, ylabel: str, width: int = 640, height: int = 300
) -> str:
    """Stacked bars: one bar per group, one segment per category."""
    if not groups:
        return f"<h3>{_esc(title)}</h3><p class='muted'>no data</p>"
    cats = sorted({c for g in groups.values() for c in g})
    totals = [sum(max(v, 0) for v in g.values()) for g in groups.values()]
    top = max(totals) or 1.0
    ml, mr, mt, mb = 56, 150, 24, 70
    W, H = width - ml - mr, height - mt - mb
    bw = W / max(len(groups), 1)
    parts = [
        f"<svg class='chart' viewBox='0 0 {width} {height}' width='{width}' height='{height}' role='img'>"
    ]
    parts.append(f"<line x1='{ml}' y1='{mt + H}' x2='{ml + W}' y2='{mt + H}' stroke='#333'/>")
    for i, (gname, g) in enumerate(groups.items()):
        y = mt + H
        for j, c in enumerate(cats):
            v = max(g.get(c, 0.0), 0.0)
            h = v / top * H
            y -= h
            parts.append(
                f"<rect x='{ml + i * bw + 4:.1f}' y='{y:.1f}' width='{bw - 8:.1f}' height='{h:.1f}' "
                f"fill='{PALETTE[j % len(PALETTE)]}'><title>{_esc(gname)} {_esc(c)}: {v:g}</title></rect>"
            )
        parts.append(
            f"<text x='{ml + i * bw + bw / 2:.1f}' y='{mt + H + 14}' text-anchor='end' class='tick' "
            f"transform='rotate(-30 {ml + i * bw + bw / 2:.1f} {mt + H + 14})'>{_esc(gname)}</text>"
        )
    parts.append(f"<text x='{ml - 6}' y='{mt + 4}' text-anchor='end' class='tick'>{top:g}</text>")
    parts.append(
        f"<text x='14' y='{mt + H / 2}' text-anchor='middle' class='axis' transform='rotate(-90 14 {mt + H / 2})'>{_esc(ylabel)}</text>"
    )
    for j, c in enumerate(cats):
        ly = mt + 12 + j * 14
        parts.append(
            f"<rect x='{ml + W + 10}' y='{ly - 8}' width='10' height='10' fill='{PALETTE[j % len(PALETTE)]}'/>"
            f"<text x='{ml + W + 24}' y='{ly + 1}' class='tick'>{_esc(c)}</text>"
        )
    parts.append("</svg>")
    return f"<h3>{_esc(title)}</h3>" + "".join(parts)


def histogram(values_by_series: dict[str, list[float]], title: str, xlabel: str, bins: int = 30) -> str:
    allv = [v for vs in values_by_series.values() for v in vs if v is not None and math.isfinite(v)]
    if not allv:
        return f"<h3>{_esc(title)}</h3><p class='muted'>no data</p>"
    lo, hi = min(allv), max(allv)
    if hi == lo:
        hi = lo + 1e-9
    width_bin = (hi - lo) / bins
    series = {}
    for name, vs in values_by_series.items():
        counts = [0] * bins
        for v in vs:
            if v is None or not math.isfinite(v):
                continue
            counts[min(int((v - lo) / width_bin), bins - 1)] += 1
        total = max(sum(counts), 1)
        series[name] = [(lo + (i + 0.5) * width_bin, c / total) for i, c in enumerate(counts)]
    return line_chart(series, title, xlabel, "share of actions")


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{margin-bottom:4px} .muted{color:#777} table{border-collapse:collapse;margin:8px 0 16px;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right} th{background:#f4f4f4} td:first-child,th:first-child{text-align:left}
.chart .tick{font-size:10px;fill:#444} .chart .axis{font-size:11px;fill:#222}
.grid{display:flex;flex-wrap:wrap;gap:16px}
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
"""

JS = r"""
const DATA = JSON.parse(document.getElementById('report-data').textContent);
const trajSel = document.getElementById('traj');
const methodSel = document.getElementById('method');
const compareSel = document.getElementById('compare');
DATA.trajectories.forEach((t, i) => {
  const o = document.createElement('option');
  o.value = i; o.textContent = `round ${t.round} · ${t.traj_id} · reward ${t.reward}`;
  trajSel.appendChild(o);
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
function fillMethods() {
  const t = DATA.trajectories[trajSel.value];
  for (const sel of [methodSel, compareSel]) {
    const prev = sel.value; sel.innerHTML = '';
    if (sel === compareSel) { const o = document.createElement('option'); o.value=''; o.textContent='(none)'; sel.appendChild(o); }
    Object.keys(t.adv).forEach(m => { const o = document.createElement('option'); o.value = m; o.textContent = m; sel.appendChild(o); });
    if ([...sel.options].some(o => o.value === prev)) sel.value = prev;
  }
}
function render() {
  const t = DATA.trajectories[trajSel.value];
  const method = methodSel.value, other = compareSel.value;
  let scale = 1e-9;
  for (const s of t.steps) { if (s.role !== 'assistant') continue;
    s.pieces.forEach((_, j) => { scale = Math.max(scale, Math.abs(advOf(t, method, s, j)), other ? Math.abs(advOf(t, other, s, j)) : 0); }); }
  const spanAt = {};
  for (const sp of t.spans) { (spanAt[sp.step_idx] = spanAt[sp.step_idx] || []).push(sp); }
  const box = document.getElementById('viewer'); box.innerHTML = '';
  const head = document.createElement('div');
  head.innerHTML = `<b>${t.traj_id}</b> · group ${t.group_id} · reward <b>${t.reward}</b> · ${t.source || ''}`;
  box.appendChild(head);
  if (t.edges.length) {
    const e = document.createElement('div'); e.innerHTML = '<span class="muted">dependency edges: </span>' +
      t.edges.map(x => `<span class="edge ${x.sign > 0 ? 'pos' : 'neg'}" title="${(x.info_unit||'').replace(/"/g,'&quot;')}">turn ${x.src_turn} → ${x.dst_turn} (${x.type})</span>`).join('');
    box.appendChild(e);
  }
  const rows = other ? [method, other] : [method];
  for (const s of t.steps) {
    for (const m of (s.role === 'assistant' ? rows : [null])) {
      const div = document.createElement('div'); div.className = 'step ' + s.role;
      const label = document.createElement('span'); label.className = 'role';
      label.textContent = s.role + (s.turn ? ` · turn ${s.turn}` : '') + (s.score !== null && s.score !== undefined ? ` · verifier ${s.score}` : '') + (s.err ? ' · ERROR' : '') + (m ? ` · ${m}` : '');
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
trajSel.addEventListener('change', () => { fillMethods(); render(); });
methodSel.addEventListener('change', render);
compareSel.addEventListener('change', render);
if (DATA.trajectories.length) { fillMethods(); render(); }
"""


def build_report(data: dict) -> str:
    """The whole report as one HTML string."""
    sections = []
    summary_cols = [
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
    sections.append(
        "<h2>Credit by method</h2>"
        + table_html(
            data["summary"], [c for c in summary_cols if not data["summary"] or c in data["summary"][0]]
        )
    )
    charts = []
    per_round: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in data["by_turn"]:
        per_round[r["round"]][r["method"]].append((r["turn"], r["mean_adv"]))
    for rnd, series in sorted(per_round.items()):
        charts.append(
            line_chart(
                dict(series),
                f"Per-turn credit by method (round {rnd})",
                "assistant turn",
                "mean token advantage",
            )
        )
    cats = {
        f"{r['method']} (r{r['round']})": {
            k: float(r[k] or 0) for k in ("progress", "keep", "regression", "delayed", "neutral")
        }
        for r in data["categories"]
    }
    charts.append(bar_chart(cats, "TCPO credit categories (turns)", "turns"))
    w_series: dict[str, list[float]] = defaultdict(list)
    for r in data["weights"]:
        w_series[f"{r['method']} (r{r['round']})"].append(r["w"])
    charts.append(histogram(dict(w_series), "IAPO routing weights w per action", "w"))
    trend: dict[str, list] = defaultdict(list)
    for r in data["summary"]:
        trend[r["method"]].append((r["round"], r.get("mean_adv")))
    if len({r["round"] for r in data["summary"]}) > 1:
        charts.append(
            line_chart(dict(trend), "Trend over rounds: mean advantage", "round", "mean token advantage")
        )
    sections.append(
        "<h2>Where the credit went</h2><div class='grid'>"
        + "".join(f"<div>{c}</div>" for c in charts)
        + "</div>"
    )
    sections.append("<h2>Detector spans (C3)</h2>" + table_html(data["behaviors"]))
    if data["quarantine"]:
        sections.append("<h2>Quarantine</h2>" + table_html(data["quarantine"]))
    viewer = (
        "<h2>Trajectory viewer</h2>"
        "<div class='controls'><label>trajectory <select id='traj'></select></label>"
        "<label>method <select id='method'></select></label>"
        "<label>compare with <select id='compare'></select></label>"
        "<span class='legend'><span style='background:rgba(214,80,112,.7)'>positive</span>"
        "<span style='background:rgba(84,110,138,.7);color:#fff'>negative</span>"
        "<span style='text-decoration:underline wavy #d00'>detector span</span></span></div>"
        "<div id='viewer'></div>"
    )
    sections.append(viewer)
    payload = json.dumps(data, default=float, separators=(",", ":")).replace("</", "<\\/")
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>creditflow report</title><style>{CSS}</style></head><body>"
        f"<h1>creditflow credit report</h1><p class='muted'>lake {_esc(data['lake'])} · rounds {_esc(data['rounds'])}</p>"
        + "".join(sections)
        + f"<script type='application/json' id='report-data'>{payload}</script><script>{JS}</script></body></html>"
    )
