"""The credit report: one self-contained HTML file (no network needed) with Plotly charts (hover, zoom, legend
toggles), summary tables, a trajectory viewer that colours each assistant token by its advantage (rose
positive, blue-grey negative, as Figure 1 of the C3 paper) and a group view (the samples of one prompt side by
side).

Pure: `figures(data)` (pipeline/report_figures.py) turns the gathered aggregates (warehouse/report_data.py) into
Plotly figure specs and `build_report(data, plotly_js)` lays out the page around them; the caller passes the
plotly.js bundle to inline (flows/run.py reads it from the plotly package)."""

from __future__ import annotations

import base64
import hashlib
import json
import math

from pipeline.report_figures import esc, figures, finite


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        return f"{v:.4g}"
    return esc(v)


def table_html(rows: list[dict], cols: list[str] | None = None, title: str = "") -> str:
    if not rows:
        return (
            f"<h3>{esc(title)}</h3><p class='muted'>no rows</p>" if title else "<p class='muted'>no rows</p>"
        )
    cols = cols or list(rows[0])
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(c))}</td>" for c in cols) + "</tr>" for r in rows)
    t = f"<h3>{esc(title)}</h3>" if title else ""
    return f"{t}<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


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
    payload = json.dumps(_clean(value), default=finite, separators=(",", ":"), allow_nan=False)
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
        inner = f"<div class='empty muted'>{esc(note)}</div>" if fig is None else ""
        boxes.append(
            f"<div class='chart-box' data-chart='{esc(key)}'><div id='fig-{esc(key)}' class='plot'>{inner}</div></div>"
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
        f"<h1>creditflow credit report</h1><p class='muted'>lake {esc(data['lake'])} · rounds {esc(data['rounds'])}"
        f" · charts: hover for values, drag to zoom, double-click to reset, click a legend entry to hide or show it</p>"
        + "".join(sections)
        + _json_script("report-data", {k: data.get(k) for k in VIEWER_KEYS})
        + _json_script("report-figures", fig_map)
        + f"<script>{JS}</script></body></html>"
    )
