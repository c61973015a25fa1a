"""The `verl-batch` adapter's rows that carry a `creditflow_steps` record (`pipeline.step_records`, written by
creditflow's own `export --layout verl`): their steps as they were (roles, turns, contents, tool calls and
errors, scores, values), the token ids and trained tokens' logprobs from the batch's arrays. A helper of
pipeline/ingest/verl_batch.py, not an adapter."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from pipeline import step_records
from schemas import steps as steps_schema


def with_step_records(a, keep, kept_traj, steps, ids, mask, lp_flat, tok_row, stats):
    """The steps of the rows whose `creditflow_steps` record (`pipeline.step_records`, written by creditflow's
    own verl export) matches their tokens: roles, turns, contents, tool calls and errors as they were, the token
    ids and trained tokens' logprobs from the arrays; other rows keep the response_mask's steps (their meta says
    why). Returns (steps, {kept row: (trajectory fields or None, note)})."""
    if step_records.NAME not in a:
        return steps, {}
    raw = np.asarray(a[step_records.NAME])
    if raw.shape[:1] != (len(a["responses"]),):
        stats["creditflow_steps"] = {"ignored": "not one record per row"}
        return steps, {}
    bounds = np.searchsorted(tok_row, np.arange(len(keep) + 1))
    records: dict[int, tuple] = {}
    used: list[tuple[int, list[dict]]] = []
    for i, r in enumerate(keep.tolist()):
        s, e = int(bounds[i]), int(bounds[i + 1])
        try:
            fields, rec_steps = step_records.decode(raw[r], e - s, mask[s:e] == 1)
        except step_records.StepRecordError as exc:
            records[i] = (None, str(exc))
            continue
        records[i] = (fields, "")
        used.append((i, rec_steps))
    stats["creditflow_steps"] = {"used": len(used), "ignored": len(records) - len(used)}
    if not used:
        return steps, records
    rows = np.asarray([i for i, _ in used], dtype=np.int64)
    sel = np.concatenate([np.arange(bounds[i], bounds[i + 1]) for i in rows.tolist()])
    flat_steps = [st for _, sts in used for st in sts]
    n = np.asarray([st["n"] for st in flat_steps], dtype=np.int64)
    off = pa.array(np.concatenate([[0], np.cumsum(n)]).astype(np.int32))
    lp = lp_flat[sel].astype(np.float32) if lp_flat is not None else np.zeros(len(sel), np.float32)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)
    lp_valid = np.zeros(len(flat_steps), bool)
    for k, st in enumerate(flat_steps):
        if st["role"] == "assistant":
            lp_valid[k] = lp_flat is not None and st["has_logprobs"]
        elif st["logprobs"] is not None:
            lp[starts[k] : starts[k] + st["n"]] = st["logprobs"]
            lp_valid[k] = True
    traj_of = np.repeat(kept_traj[rows], [len(sts) for _, sts in used])
    rec = pa.table(
        {
            "traj_id": pa.array(traj_of, pa.string()),
            "step_idx": pa.array(
                np.concatenate([np.arange(len(sts)) for _, sts in used]).astype(np.int32), pa.int32()
            ),
            "role": pa.array([st["role"] for st in flat_steps], pa.string()),
            "turn": pa.array([st["turn"] for st in flat_steps], pa.int32()),
            "content": pa.array([st["content"] for st in flat_steps], pa.string()),
            "tool_calls": pa.array(
                [st["tool_calls"] for st in flat_steps], steps_schema.SCHEMA.field("tool_calls").type
            ),
            "tool_call_id": pa.array([st["tool_call_id"] for st in flat_steps], pa.string()),
            "is_error": pa.array([st["is_error"] for st in flat_steps], pa.bool_()),
            "token_ids": pa.ListArray.from_arrays(off, pa.array(ids[sel].astype(np.int32))),
            "token_offsets": pa.ListArray.from_arrays(
                off, pa.array(np.asarray([o for st in flat_steps for o in st["offsets"]], np.int32))
            ),
            "logprobs": lists_or_null(off.to_numpy(), lp, lp_valid),
            "logprob_source": pa.array(
                [st["logprob_source"] if lp_valid[k] else None for k, st in enumerate(flat_steps)],
                pa.string(),
            ),
            "values": pa.array([st["values"] for st in flat_steps], pa.list_(pa.float32())),
            "verifier_score": pa.array([st["verifier_score"] for st in flat_steps], pa.float64()),
        }
    )
    keep_mask = ~np.isin(steps.column("traj_id").to_numpy(zero_copy_only=False), kept_traj[rows])
    return pa.concat_tables([steps.filter(pa.array(keep_mask)), rec.cast(steps.schema)]), records


def lists_or_null(offsets: np.ndarray, values: np.ndarray, valid: np.ndarray) -> pa.Array:
    """list<float32> with list k = values[offsets[k]:offsets[k + 1]] where valid[k], else null; a null list holds
    no values (a null backed by values is read differently by list_flatten and list_parent_indices)."""
    counts = np.diff(np.asarray(offsets, np.int64)).astype(np.int64)
    keep = np.repeat(np.asarray(valid, bool), counts.tolist())
    kept = np.concatenate([[0], np.cumsum(np.where(valid, counts, 0))]).astype(np.int32)
    return pa.ListArray.from_arrays(
        pa.array(kept),
        pa.array(np.asarray(values, np.float32)[keep]),
        mask=pa.array(~np.asarray(valid, bool)),
    )
