"""The report's charts: `figures(data)` turns the gathered aggregates (warehouse/report_data.py) into Plotly
figure specs (plain dicts in Plotly's JSON schema), one function per chart; `pipeline.report` lays out the
page around them. Pure."""

from __future__ import annotations

import html
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


def esc(x) -> str:
    """Text as HTML (Plotly reads its labels as markup too)."""
    return html.escape("" if x is None else str(x))


def finite(v) -> float | None:
    """A JSON-safe number (NaN/inf -> None, which Plotly draws as a gap)."""
    if v is None:
        return None
    v = float(v)
    return v if math.isfinite(v) else None


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
                "name": esc(method),  # Plotly reads its labels as markup: text only
                "legendgroup": method,
                "visible": _visible(i, focus, method),
                "x": [r["turn"] for r in rs],
                "y": [finite(r["mean_adv"]) for r in rs],
                "error_y": {"type": "data", "array": [finite(r["ci95"]) for r in rs], "visible": True},
                "customdata": [[r["n"], finite(r["share_positive"])] for r in rs],
                "hovertemplate": f"<b>{esc(method)}</b><br>turn %{{x}}<br>mean %{{y:.4g}} ± %{{error_y.array:.3g}}"
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
                "name": esc(method),  # Plotly reads its labels as markup: text only
                "visible": _visible(i, focus, method) if i != 0 or focus is None else True,
                "x": [finite(r["x"]) for r in rs],
                "width": [finite(r["width"]) for r in rs],
                "y": [int(r["tokens"]) / total for r in rs],
                "customdata": [int(r["tokens"]) for r in rs],
                "opacity": 0.55,
                "marker": {"color": colours[method]},
                "hovertemplate": f"<b>{esc(method)}</b><br>advantage ≈ %{{x:.3g}}<br>%{{y:.2%}} of tokens"
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
                "x": [esc(f"{r['method']} · r{r['round']}") for r in rs],
                "y": [finite(r["mean_adv"]) for r in rs],
                "error_y": {"type": "data", "array": [finite(r["ci95"]) for r in rs], "visible": True},
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
        z[i][j] = z[j][i] = finite(r["share_sign_differs"])
        n[i][j] = n[j][i] = int(r["tokens"] or 0)
    trace = {
        "type": "heatmap",
        "x": [esc(m) for m in methods],
        "y": [esc(m) for m in methods],
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
            "y": [finite(r[key]) for r in reward],
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
                "name": esc(method),  # Plotly reads its labels as markup: text only
                "visible": _visible(i, focus, method),
                "x": [r["round"] for r in rs],
                "y": [finite(r["mean_abs_adv"]) for r in rs],
                "line": {"color": colours[method]},
                "hovertemplate": f"<b>{esc(method)}</b><br>round %{{x}}<br>mean |turn advantage| %{{y:.4g}}"
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
                    "name": esc(method),  # Plotly reads its labels as markup: text only
                    "legendgroup": method,
                    "showlegend": p == 0,
                    "x": list(range(len(rs))),
                    "y": [finite(r.get(key)) for r in rs],
                    "customdata": [[r["round"], r["step"]] for r in rs],
                    "xaxis": f"x{ax}",
                    "yaxis": f"y{ax}",
                    "line": {"color": colours[method]},
                    "hovertemplate": f"<b>{esc(method)}</b><br>round %{{customdata[0]}} step %{{customdata[1]}}"
                    f"<br>{label} %{{y:.4g}}<extra></extra>",
                }
            )
    return {"data": traces, "layout": layout}


def categories_figure(rows: list[dict]) -> dict:
    cats = ("progress", "keep", "regression", "delayed", "neutral")
    labels = [esc(f"{r['method']} · r{r['round']}") for r in rows]
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
        v = finite(r["w"])
        if v is not None:
            by[esc(f"{r['method']} · r{r['round']}")].append(round(v, 5))
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
