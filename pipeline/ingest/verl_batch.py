"""`verl-batch`: a verl batch (the tensors and non-tensor arrays of a `DataProto`) saved as NumPy `.npz` (e.g.
`np.savez(path, **batch.batch, **batch.non_tensor_batch)`: object arrays such as `uid` are read by a loader that
only rebuilds arrays), as Parquet (one row per sample, one list column per tensor), or pickled by verl's own
`DataProto.save_to_disk` (read only with `--allow-pickle`; see warehouse/interop_sources.py), read without verl. Keys, as verl names them (verl/trainer/ppo/ray_trainer.py
and core_algos.py, volcengine/verl main, read 2025):

- `responses` (B, R) response token ids, `response_mask` (B, R) 1 on tokens the policy generated, 0 on tool /
  user observation tokens inside the response (multi-turn agent loop) and on padding; required;
- `prompts` (B, P) left-padded prompt ids; `attention_mask` (B, P + R) 1 on real tokens (optional: without it
  every prompt position is real and the response ends at its last trained token);
- `uid` (B,) the group id (verl's GRPO groups by it); required;
- reward: `token_level_scores`, else `rm_scores`, else `token_level_rewards` (B, R); reward = the row's sum;
- logprobs: `rollout_log_probs` (the sampler's), else `old_log_probs`; optional;
- `traj_id` (B,) optional (creditflow's own export writes it), else `<file stem>:<row>`.

Turns come from the 0->1 edges of `response_mask`: each maximal run of 1s among the real response tokens is one
assistant step (turn 1, 2, ...), each run of 0s between them one `tool` step (the observation), and the real
prompt tokens one `user` step. Token ids (and the logprobs of assistant steps) are kept exactly. Text: each token
is decoded on its own with the ingest tokenizer when it can decode (`tokenizer.decode([id])`), else rendered as
the placeholder `<id>`; a step's content is the concatenation of its token pieces, so its token offsets are
exact (the pieces' start chars). The rows then go through the `parquet` adapter's schema checks.

A file written by creditflow's own `export --layout verl` also holds `creditflow_steps` (`pipeline.step_records`:
per row its steps' roles, turns, contents, tool calls, tool errors, offsets, scores and values, and the
trajectory's fields): a row whose record matches its tokens (token counts, assistant steps = response_mask) gets
its steps and trajectory back as they were (the round trip export -> ingest -> process is lossless); a row whose
record does not match keeps the response_mask's steps, and its meta says why in one line (`creditflow_steps`).

Quarantined: a file without a required key or with ragged rows (one record for the file), and per row: an empty
uid, a non-finite reward, a response_mask value other than 0/1, a trained token on padding, a duplicate traj_id,
a real prompt/response token id that is not an integer in [0, 2^31) (never wrapped to int32), and what the shared
checks refuse (`pipeline.ingest.checks.token_rejects`: ids beyond the vocabulary, logprobs not finite or > 0).
"""

from __future__ import annotations

import json
from pathlib import PurePath

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.ingest.checks import checked_ids, checked_ids_text, token_id_problem
from pipeline.ingest.parquet import ingest_tables as canonical_ingest
from pipeline.ingest.records import (
    INVALID_TOKENS,
    INVALID_VALUE,
    MISSING_FIELD,
    NON_FINITE_REWARD,
    IngestResult,
    Reject,
    SourceRecord,
)
from pipeline.ingest.registry import AdapterSpec, register_adapter
from pipeline.ingest.tables import Rejected, quarantine_table
from pipeline.ingest.verl_records import lists_or_null, with_step_records
from schemas import steps as steps_schema
from schemas import trajectories as trajectories_schema

REWARD_KEYS = ("token_level_scores", "rm_scores", "token_level_rewards")
LOGPROB_KEYS = ("rollout_log_probs", "old_log_probs")


def _arrays(columns) -> dict[str, np.ndarray]:
    """npz dict or Arrow table -> dict of NumPy arrays (list columns stacked to 2-D; ragged raises)."""
    if isinstance(columns, dict):
        return {k: np.asarray(v) for k, v in columns.items()}
    out = {}
    for name in columns.column_names:
        col = columns.column(name).combine_chunks()
        if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            lens = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            if len(lens) and (lens != lens[0]).any():
                raise Reject(
                    INVALID_VALUE,
                    f"column {name!r} has rows of different lengths (expected a padded batch)",
                    name,
                )
            flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
            out[name] = flat.reshape(len(col), int(lens[0]) if len(lens) else 0)
        else:
            out[name] = np.asarray(
                col.to_pylist() if pa.types.is_string(col.type) else col.to_numpy(zero_copy_only=False)
            )
    return out


def _pieces(tokenizer, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Text piece of each unique id: (unique ids, pieces, inverse index of `ids`, decoded?)."""
    uniq, inv = np.unique(ids, return_inverse=True)
    decode = getattr(tokenizer, "decode", None)
    pieces = None
    if decode is not None and len(uniq):
        try:
            pieces = [decode([int(i)]) for i in uniq]
        except Exception:  # noqa: BLE001 -- ids outside the tokenizer's vocabulary: placeholders instead
            pieces = None
    decoded = pieces is not None
    if pieces is None:
        pieces = [f"<{int(i)}>" for i in uniq]
    return uniq, np.array(pieces, dtype=object), inv, decoded


def _row_raw(a: dict[str, np.ndarray], r: int) -> str:
    return json.dumps(
        {
            k: (v[r].tolist() if hasattr(v[r], "tolist") else v[r])
            for k, v in a.items()
            if v.ndim and len(v) > r
        },
        default=str,
    )


def _one_file(source_file: str, columns, tokenizer, rejected: list[Rejected], stats: dict):
    """One batch file -> (trajectories, steps) of its rows that pass the row checks (the others go to
    `rejected`): the batch's arrays, the row checks, the real tokens of the kept rows, their steps (runs of
    equal response_mask; the `creditflow_steps` records where they match) and their trajectories."""
    a = _arrays(columns)
    (reward_key, responses, responses_bad, prompts, prompts_bad, rmask, reward, logprobs, p_real, r_real, uid,
     uid_bad, traj_ids) = _read_batch(a, source_file)  # fmt: skip
    id_checks = (
        ("prompts", a.get("prompts"), prompts_bad, p_real),
        ("responses", a["responses"], responses_bad, r_real),
    )
    bad, reasons = _row_rejects(a, reward_key, reward, rmask, r_real, uid, uid_bad, id_checks)
    for r, rej in sorted(reasons.items()):
        rejected.append(Rejected(SourceRecord(source_file, f"row {r}", _row_raw(a, r)), rej, traj_ids[r]))
    keep = np.flatnonzero(~bad)
    tok_row, part, ids, new, mask, lp_flat = _flat_tokens(
        keep, prompts, responses, rmask, logprobs, p_real, r_real
    )
    kept_traj = traj_ids[keep]
    steps = _segment_steps(tok_row, part, ids, new, mask, lp_flat, kept_traj, tokenizer, stats)
    steps, records = with_step_records(a, keep, kept_traj, steps, ids, mask, lp_flat, tok_row, stats)
    trajectories = _trajectories_table(source_file, keep, kept_traj, uid, reward, p_real, r_real, records)
    return trajectories, steps


def _read_batch(a: dict[str, np.ndarray], source_file: str):
    """The arrays of a batch, checked for the required keys: ids (no silent wrap to int32) with their bad-id
    masks, the response mask, the reward (sum of the reward key's scores), the logprobs, which prompt and
    response positions are real tokens, the uids and the trajectory ids."""
    for key in ("responses", "response_mask", "uid"):
        if key not in a:
            raise Reject(MISSING_FIELD, f"verl batch has no {key!r}", key)
    reward_key = next((k for k in REWARD_KEYS if k in a), None)
    if reward_key is None:
        raise Reject(MISSING_FIELD, f"verl batch has no reward ({' / '.join(REWARD_KEYS)})", REWARD_KEYS[0])
    responses, responses_bad = checked_ids(a["responses"], "responses")  # no silent wrap to int32
    B, R = responses.shape
    prompts, prompts_bad = (
        checked_ids(a["prompts"], "prompts") if "prompts" in a else (np.zeros((B, 0), np.int64),) * 2
    )
    P = prompts.shape[1]
    rmask = a["response_mask"]
    scores = a[reward_key].astype(np.float64).reshape(B, -1) if B else np.zeros((0, 1))
    lp_key = next((k for k in LOGPROB_KEYS if k in a), None)
    logprobs = a[lp_key].astype(np.float32) if lp_key else None
    if "attention_mask" in a:
        attn = a["attention_mask"].astype(np.int64)
        p_real, r_real = attn[:, :P] == 1, attn[:, P : P + R] == 1
    else:
        p_real = np.ones((B, P), bool)
        last = np.where(rmask == 1, np.arange(R)[None, :], -1).max(axis=1) if R else np.full(B, -1)
        r_real = np.arange(R)[None, :] <= last[:, None]
    uid, uid_bad = checked_ids_text(a["uid"], "uid")  # None / NaN / objects are not made "None" / "nan"
    traj_ids = (
        np.asarray(a["traj_id"]).astype(str)
        if "traj_id" in a
        else np.array([f"{PurePath(source_file).stem}:{r}" for r in range(B)])
    )
    reward = scores.sum(axis=1)

    return (
        reward_key, responses, responses_bad, prompts, prompts_bad, rmask, reward, logprobs, p_real, r_real, uid,
        uid_bad, traj_ids,
    )  # fmt: skip


def _row_rejects(
    a, reward_key, reward, rmask, r_real, uid, uid_bad, id_checks
) -> tuple[np.ndarray, dict[int, Reject]]:
    """Rows that cannot be ingested (mask) and the first reason of each: a bad or empty uid, a non-finite
    reward, a response_mask other than 0/1 or 1 on padding, a real token id that is not an int32 id."""
    B = len(reward)
    bad = np.zeros(B, bool)
    reasons: dict[int, Reject] = {}

    def flag(rows, reject_of):
        for r in np.flatnonzero(rows & ~bad):
            reasons[int(r)] = reject_of(int(r))
        bad[rows] = True

    flag(
        uid_bad, lambda r: Reject(INVALID_VALUE, f"uid {a['uid'][r]!r} is not a string or an integer", "uid")
    )
    flag(np.char.str_len(uid.astype(str)) == 0, lambda r: Reject(MISSING_FIELD, "uid is empty", "uid"))
    flag(
        ~np.isfinite(reward),
        lambda r: Reject(NON_FINITE_REWARD, f"reward ({reward_key} sum) is {reward[r]}", reward_key),
    )
    flag(
        ~np.isin(rmask, (0, 1)).all(axis=1),
        lambda r: Reject(INVALID_VALUE, "response_mask has values other than 0/1", "response_mask"),
    )
    flag(
        ((rmask == 1) & ~r_real).any(axis=1),
        lambda r: Reject(INVALID_VALUE, "response_mask is 1 on a padding token", "response_mask"),
    )
    for name, raw, ids_bad, real in id_checks:
        hit = ids_bad.astype(bool) & real
        flag(
            hit.any(axis=1),
            lambda r, name=name, raw=raw, hit=hit: Reject(
                INVALID_TOKENS,
                token_id_problem(raw[r, np.argmax(hit[r])].item(), int(np.argmax(hit[r]))),
                name,
            ),
        )
    return bad, reasons


def _flat_tokens(keep, prompts, responses, rmask, logprobs, p_real, r_real):
    """The real tokens of the kept rows, flat: per row the prompt tokens, then the response tokens; with each
    token's row, part (prompt 0 / response 1), whether it starts a segment (the prompt, then runs of equal
    response_mask), its mask and its logprob."""
    # flat real tokens: per kept row the prompt tokens, then the response tokens
    p_row, p_col = np.nonzero(p_real[keep])
    r_row, r_col = np.nonzero(r_real[keep])
    p_ids = prompts[keep][p_row, p_col]
    r_ids = responses[keep][r_row, r_col]
    r_m = rmask[keep][r_row, r_col].astype(np.int8)
    # segments: the prompt (one per row with prompt tokens), then runs of equal mask in the response
    r_new = np.ones(len(r_row), bool)
    r_new[1:] = (r_row[1:] != r_row[:-1]) | (r_m[1:] != r_m[:-1])
    p_new = np.ones(len(p_row), bool)
    p_new[1:] = p_row[1:] != p_row[:-1]
    # order: by (row, part[prompt=0 / response=1], position)
    tok_row = np.concatenate([p_row, r_row])
    part = np.concatenate([np.zeros(len(p_row), np.int8), np.ones(len(r_row), np.int8)])
    pos = np.concatenate([p_col, r_col])
    order = np.lexsort((pos, part, tok_row))
    tok_row, part = tok_row[order], part[order]
    ids = np.concatenate([p_ids, r_ids])[order]
    new = np.concatenate([p_new, r_new])[order]
    mask = np.concatenate([np.zeros(len(p_row), np.int8), r_m])[order]
    lp_flat = (
        np.concatenate([np.zeros(len(p_row), np.float32), logprobs[keep][r_row, r_col]])[order]
        if logprobs is not None
        else None
    )
    return tok_row, part, ids, new, mask, lp_flat


def _segment_steps(tok_row, part, ids, new, mask, lp_flat, kept_traj, tokenizer, stats) -> pa.Table:
    """One step per segment: the prompt a user step, a masked run an assistant turn, an unmasked run a tool
    step; the text decoded by the tokenizer (or placeholders), offsets from the decoded pieces."""
    seg_start = np.flatnonzero(new)
    seg_end = np.append(seg_start[1:], len(ids)) if len(seg_start) else seg_start  # every row quarantined
    seg_row = tok_row[seg_start]
    seg_asst = mask[seg_start] == 1
    seg_prompt = part[seg_start] == 0
    n_seg = len(seg_start)
    row_first = np.flatnonzero(np.r_[True, seg_row[1:] != seg_row[:-1]]) if n_seg else np.array([], np.int64)
    seg_first = np.repeat(row_first, np.diff(np.append(row_first, n_seg)))
    step_idx = np.arange(n_seg) - seg_first
    asst_cum = np.cumsum(seg_asst)
    turn = asst_cum - np.where(seg_first > 0, asst_cum[seg_first - 1], 0) if n_seg else np.array([], np.int64)
    role = np.where(seg_prompt, "user", np.where(seg_asst, "assistant", "tool"))

    uniq, piece, inv, decoded = _pieces(tokenizer, ids)
    stats["text"] = "decoded" if decoded else "placeholder"
    plen = np.fromiter((len(p) for p in piece), np.int64, len(piece))[inv]
    cum = np.cumsum(plen) - plen  # char start of each token in the whole stream
    offsets = (
        (cum - cum[seg_start].repeat(seg_end - seg_start)).astype(np.int32)
        if len(ids)
        else np.zeros(0, np.int32)
    )
    tok_piece = piece[inv]
    content = ["".join(tok_piece[s:e]) for s, e in zip(seg_start, seg_end, strict=True)]

    tok_off = pa.array(np.append(seg_start, len(ids)).astype(np.int32))
    lp_valid = seg_asst if lp_flat is not None else np.zeros(n_seg, bool)
    steps = pa.table(
        {
            "traj_id": pa.array(kept_traj[seg_row], pa.string()),
            "step_idx": pa.array(step_idx.astype(np.int32)),
            "role": pa.array(role.astype(object), pa.string()),
            "turn": pa.array(turn.astype(np.int32), mask=turn == 0),
            "content": pa.array(content, pa.string()),
            "tool_calls": pa.nulls(n_seg, steps_schema.SCHEMA.field("tool_calls").type),
            "tool_call_id": pa.nulls(n_seg, pa.string()),
            "is_error": pa.array(np.zeros(n_seg, bool)),
            "token_ids": pa.ListArray.from_arrays(tok_off, pa.array(ids.astype(np.int32))),
            "token_offsets": pa.ListArray.from_arrays(tok_off, pa.array(offsets)),
            "logprobs": lists_or_null(
                np.append(seg_start, len(ids)),
                lp_flat if lp_flat is not None else np.zeros(len(ids), np.float32),
                lp_valid,
            ),
            "logprob_source": pa.array(
                np.full(len(lp_valid), "rollout", dtype=object), pa.string(), mask=~np.asarray(lp_valid, bool)
            ),
            "values": pa.nulls(n_seg, pa.list_(pa.float32())),
            "verifier_score": pa.nulls(n_seg, pa.float64()),
        }
    )
    return steps


def _trajectories_table(source_file, keep, kept_traj, uid, reward, p_real, r_real, records) -> pa.Table:
    """The kept rows' trajectories: group = uid, sample index = order in the group, reward; the fields of a
    matching `creditflow_steps` record where there is one (meta says why where it was ignored)."""
    kept_uid = uid[keep]
    order_in_group = np.zeros(len(keep), np.int32)
    seen: dict[str, int] = {}
    for i, g in enumerate(kept_uid):
        order_in_group[i] = seen.get(g, 0)
        seen[g] = order_in_group[i] + 1
    meta = [
        json.dumps({"uid": str(u), "row": int(r), "prompt_tokens": int(n)})
        for u, r, n in zip(kept_uid, keep, p_real[keep].sum(axis=1), strict=True)
    ]
    kept_reward = reward[keep].copy()
    n_real = p_real[keep].sum(axis=1) + r_real[keep].sum(axis=1)
    components: list = [None] * len(keep)
    action_format: list = [None] * len(keep)
    policy_version: list = [None] * len(keep)
    for i, got in records.items():
        fields, note = got
        if fields is None:  # the record could not be used: the row's steps come from its response_mask
            meta[i] = json.dumps({**json.loads(meta[i]), "creditflow_steps": f"ignored: {note}"})
            continue
        # the exported reward is float32 (token_level_scores): the record's float64 when it is the same value,
        # or when the row has no real token to hold it
        if fields["reward"] is not None and (
            np.float32(fields["reward"]) == np.float32(kept_reward[i]) or not n_real[i]
        ):
            kept_reward[i] = fields["reward"]
        if fields["sample_idx"] is not None:
            order_in_group[i] = fields["sample_idx"]
        components[i] = fields["reward_components"]
        action_format[i] = fields["action_format"]
        policy_version[i] = fields["policy_version"]
        original = _json_object(fields["meta"])
        row_meta = {**original, "verl_batch": json.loads(meta[i]), "exported_source": fields["source"]}
        if fields["cut"] is not None:  # the steps up to where the export cut the response
            row_meta["creditflow_steps"] = "cut at {} of {} tokens (the export's response length)".format(
                *fields["cut"]
            )
        meta[i] = json.dumps(row_meta)
    trajectories = pa.table(
        {
            "traj_id": pa.array(kept_traj, pa.string()),
            "group_id": pa.array(kept_uid, pa.string()),
            "sample_idx": pa.array(order_in_group),
            "reward": pa.array(kept_reward),
            "reward_components": pa.array(
                components, trajectories_schema.SCHEMA.field("reward_components").type
            ),
            "source": pa.array([f"verl-batch:{source_file}"] * len(keep), pa.string()),
            "action_format": pa.array(action_format, pa.string()),
            "policy_version": pa.array(policy_version, pa.string()),
            "meta": pa.array(meta, pa.string()),
        }
    )
    return trajectories


def _json_object(text) -> dict:
    try:
        got = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {"meta": text}
    return got if isinstance(got, dict) else {"meta": got}


def ingest_tables(sources, round_: int, tokenizer) -> IngestResult:
    rejected: list[Rejected] = []
    stats: dict = {}
    canonical = []
    n_rows = 0
    for source_file, columns in sources:
        try:
            t, s = _one_file(source_file, columns, tokenizer, rejected, stats)
        except Reject as rej:
            rejected.append(Rejected(SourceRecord(source_file, "$", f"<verl batch {source_file}>"), rej))
            continue
        n_rows += t.num_rows
        canonical.append((source_file, {"trajectories": t, "steps": s}))
    result = canonical_ingest(canonical, round_, tokenizer)
    q = result.quarantine
    q = q.set_column(
        q.column_names.index("stage"),
        q.schema.field("stage"),
        pa.array(["ingest:verl-batch"] * q.num_rows, pa.string()),
    )
    mine = quarantine_table(rejected, round_, "verl-batch")
    result.quarantine = pa.concat_tables([mine, q])
    result.stats.update(stats, records_read=n_rows + len(rejected))
    return result


register_adapter(
    AdapterSpec(
        name="verl-batch",
        kind="tables",
        action_format=None,
        description="verl-style batch (.npz or Parquet): prompts, responses, response_mask, uid, scores, log probs",
        extensions=(".npz", ".parquet", ".pkl"),
        ingest_tables=ingest_tables,
        options={"raw_files": True},
    )
)
