"""The `detect` annotation stage: run the enabled detectors on a batch and lay their hits out as the
`spans` table, char ranges mapped to token ranges through `token_offsets` (one vectorised searchsorted)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import Config
from pipeline.detect.registry import DETECTORS, DetectSettings, Hit, StepView, TrajView, parse_meta
from pipeline.detect.text import turn_range
from pipeline.stages import NO_IO, StageIO, StageOutput, batch_stage
from schemas.spans import SCHEMA as SPANS_SCHEMA

# the stock sentence of a rule whose hits carry no reason of their own
RULE_REASONS = {
    "search_r1.no_action": "the turn has no complete <search> or <answer> block",
    "search_r1.both_tags": "the turn has both a <search> and an <answer> block",
    "search_r1.multiple": "the turn has more than one <search> or <answer> block",
    "react.no_action": "the turn has no Action line",
    "react.unparseable": "the executed Action is not one of search[..], lookup[..], finish[..]",
    "react.unexecuted_actions": "Action lines after the first: the harness runs only the first, so these "
    "never ran",
    "webshop.malformed": "not <think>..</think><action>..</action>",
    "webshop.cjk": "CJK characters in the turn",
    "webshop.unparseable": "the action is neither search[..] nor click[..]",
    "webshop.impermissible": "the action is not among the available actions",
    "tool.unknown_name": "the called tool is not in the tool list",
    "tool.invalid_json": "the call's arguments are not a JSON object",
    "tool.schema": "the call's arguments break the tool's JSON schema",
    "tool.error_return": "the tool returned an error for this call",
}


def _col(table: pa.Table, name: str, default=None) -> list:
    if name in table.column_names:
        return table.column(name).to_pylist()
    return [default] * table.num_rows


def sorted_steps(steps: pa.Table) -> pa.Table:
    """Steps in (traj_id, step_idx) order; no copy when they already are."""
    order = pc.sort_indices(
        steps.select(["traj_id", "step_idx"]), sort_keys=[("traj_id", "ascending"), ("step_idx", "ascending")]
    )
    order_np = order.to_numpy()
    if len(order_np) and np.any(np.diff(order_np) != 1):
        return steps.take(order)
    return steps


def traj_views(trajectories: pa.Table, steps: pa.Table) -> list[TrajView]:
    """Plain-Python views of the batch (steps sorted by (traj_id, step_idx)) for the detectors."""
    views: dict[str, TrajView] = {}
    for tid, fmt, meta, reward in zip(
        _col(trajectories, "traj_id"),
        _col(trajectories, "action_format"),
        _col(trajectories, "meta"),
        _col(trajectories, "reward", 0.0),
        strict=True,
    ):
        views[tid] = TrajView(tid, fmt, parse_meta(meta), [], float(reward or 0.0))
    cols = zip(
        _col(steps, "traj_id"),
        _col(steps, "step_idx"),
        _col(steps, "role"),
        _col(steps, "turn"),
        _col(steps, "content", ""),
        _col(steps, "tool_calls"),
        _col(steps, "tool_call_id"),
        _col(steps, "is_error", False),
        strict=True,
    )
    for tid, idx, role, turn, content, calls, call_id, is_error in cols:
        view = views.get(tid)
        if view is None:
            view = views[tid] = TrajView(tid, None, {}, [])
        view.steps.append(StepView(idx, role, turn, content or "", calls, call_id, bool(is_error)))
    return list(views.values())


def run_detectors(views: list[TrajView], settings: DetectSettings) -> list[tuple[str, Hit, float]]:
    """(traj_id, hit, severity) for every enabled detector; unknown detector names are errors."""
    unknown = [n for n in settings.enabled if n not in DETECTORS]
    if unknown:
        raise KeyError(f"unknown detector(s) {unknown}; registered: {sorted(DETECTORS)}")
    out = []
    for view in views:
        for name in settings.enabled:
            det = DETECTORS[name]
            for hit in det.fn(view, settings):
                sev = hit.severity
                if sev is None:
                    sev = settings.severities.get(hit.behavior, det.default_severity)
                out.append((view.traj_id, hit, float(sev)))
    return out


def char_to_token(steps: pa.Table, rows: np.ndarray, char_start: np.ndarray, char_end: np.ndarray):
    """Token range [start, end) within each step covering chars [char_start, char_end): the token holding
    char_start up to the first token starting at or after char_end. Vectorised over all spans."""
    offs = steps.column("token_offsets").combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(offs), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat = pc.list_flatten(offs).to_numpy(zero_copy_only=False).astype(np.int64)
    parent = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    width = int(max(flat.max(initial=0), char_end.max(initial=0))) + 2
    keys = parent * width + flat  # globally sorted: steps in row order, offsets ascending within a step
    lo = np.searchsorted(keys, rows * width + char_start, side="right") - 1 - first[rows]
    hi = np.searchsorted(keys, rows * width + char_end, side="left") - first[rows]
    n = lengths[rows]
    lo = np.clip(lo, 0, n)
    hi = np.clip(hi, 0, n)
    hi = np.where((hi <= lo) & (char_end > char_start) & (lo < n), lo + 1, hi)
    return lo.astype(np.int32), np.maximum(hi, lo).astype(np.int32)


def spans_table(
    trajectories: pa.Table,
    steps: pa.Table,
    hits: list[tuple[str, Hit, float]],
    settings: DetectSettings,
    views: list[TrajView] | None = None,
) -> pa.Table:
    """The spans table of the hits; `steps` sorted by (traj_id, step_idx) (see `sorted_steps`)."""
    if not hits:
        return SPANS_SCHEMA.empty_table()
    row_of = {k: i for i, k in enumerate(zip(_col(steps, "traj_id"), _col(steps, "step_idx"), strict=True))}
    rows_a = np.fromiter((row_of[(tid, h.step_idx)] for tid, h, _ in hits), dtype=np.int64, count=len(hits))
    cs_a = np.array([-1 if h.char_start is None else h.char_start for _, h, _ in hits], dtype=np.int64)
    ce_a = np.array([-1 if h.char_end is None else h.char_end for _, h, _ in hits], dtype=np.int64)
    whole = np.flatnonzero((cs_a < 0) | (settings.span_mode == "turn"))
    if len(whole):
        if views is not None:
            step_of = {(v.traj_id, st.step_idx): st for v in views for st in v.steps}
            texts = [step_of[(hits[i][0], hits[i][1].step_idx)].content for i in whole]
        else:
            texts = steps.column("content").take(pa.array(rows_a[whole])).to_pylist()
        ranges = np.array([turn_range(t or "", settings.exclude_think) for t in texts], dtype=np.int64)
        cs_a[whole], ce_a[whole] = ranges[:, 0], ranges[:, 1]
    take = pa.array(rows_a)
    turn_col = pc.fill_null(steps.column("turn").combine_chunks().take(take), 0)
    round_col = (
        pc.fill_null(steps.column("round").combine_chunks().take(take), 0)
        if "round" in steps.column_names
        else pa.array(np.zeros(len(hits), dtype=np.int32))
    )
    tok_lo, tok_hi = char_to_token(steps, rows_a, cs_a, ce_a)
    table = pa.table(
        {
            "round": pc.cast(round_col, pa.int32()),
            "traj_id": pa.array([t for t, _, _ in hits], pa.string()),
            "step_idx": pa.array([h.step_idx for _, h, _ in hits], pa.int32()),
            "turn": pc.cast(turn_col, pa.int32()),
            "token_start": pa.array(tok_lo, pa.int32()),
            "token_end": pa.array(tok_hi, pa.int32()),
            "char_start": pa.array(cs_a, pa.int32()),
            "char_end": pa.array(ce_a, pa.int32()),
            "behavior": pa.array([h.behavior for _, h, _ in hits], pa.string()),
            "severity": pa.array([s for _, _, s in hits], pa.float64()),
            "rule": pa.array([h.rule for _, h, _ in hits], pa.string()),
            "evidence": pa.array([h.evidence for _, h, _ in hits], pa.string()),
            "reason": pa.array([h.reason or RULE_REASONS.get(h.rule) for _, h, _ in hits], pa.string()),
        },
        schema=SPANS_SCHEMA,
    )
    return table


def detect_spans(
    trajectories: pa.Table, steps: pa.Table, settings: DetectSettings | None = None
) -> tuple[pa.Table, dict[str, float]]:
    settings = settings or DetectSettings()
    steps = sorted_steps(steps)
    views = traj_views(trajectories, steps)
    hits = run_detectors(views, settings)
    table = spans_table(trajectories, steps, hits, settings, views)
    notes: dict[str, float] = {"spans": float(table.num_rows)}
    for behavior, n in Counter(h.behavior for _, h, _ in hits).items():
        notes[f"spans.{behavior}"] = float(n)
    notes["trajectories_flagged"] = float(len({t for t, _, _ in hits}))
    return table, notes


@batch_stage("detect", order=10, produces=("spans",), settings=("detect",))
def detect(
    trajectories: pa.Table,
    steps: pa.Table,
    config: Config,
    inputs: dict[str, pa.Table],
    io: StageIO = NO_IO,
) -> StageOutput:
    """C3 rule detectors -> spans (no effects: `io` is accepted like every stage's and unused)."""
    table, notes = detect_spans(trajectories, steps, config.settings(DetectSettings))
    return StageOutput(tables={"spans": table}, notes=notes)
