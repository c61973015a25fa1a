"""Export layouts for the RL frameworks people run. Each turns the flat per-trajectory batch (one row per
trajectory: input_ids, loss_mask, old_logprobs, advantages, values, returns, turn_ids) into the padded arrays
the framework's update consumes, whole-column (NumPy fancy indexing over the flat tokens, no loop over tokens).

The prompt of a trajectory is everything before its first trained (assistant) token; the response is the
rest, so tool and user tokens between turns sit inside the response with mask 0, as in verl's and SkyRL's
multi-turn rollouts.

- verl:     prompts (left-padded), responses (right-padded), input_ids = [prompts | responses],
            attention_mask, position_ids, response_mask, old_log_probs, advantages, returns, values, uid,
            token_level_scores (the trajectory reward on its last real response token, so `creditflow ingest
            -f verl-batch` reads an export back)
- openrlhf: sequences (left-padded prompt + right-padded response), attention_mask, action_mask (over the
            last `num_actions` positions), action_log_probs, advantages, returns, values, action_ranges
            (per turn [start, end) within the response, padded with -1)
- skyrl:    sequences, attention_mask, loss_mask (assistant tokens of the response), response_mask (every
            real response token), action_log_probs, advantages, returns, values
Arrays are C-contiguous NumPy of one padded length, saved with `np.savez` (no pickle), so
`torch.from_numpy(np.load(f)[k])` needs no copy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LAYOUTS = ("flat", "verl", "openrlhf", "skyrl")


def _flat(table: pa.Table, name: str, dtype, fill=0) -> np.ndarray:
    col = table.column(name).combine_chunks()
    n_tok = int(pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0)
    if col.null_count == len(col):
        return np.full(n_tok, fill, dtype=dtype)
    if col.null_count:
        raise ValueError(f"column {name!r} is null on some trajectories only")
    return pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(dtype)


def _geometry(table: pa.Table):
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    n = len(lengths)
    tok_row = np.repeat(np.arange(n), lengths)
    tok_pos = np.arange(int(lengths.sum())) - starts[tok_row]
    mask = _flat(table, "loss_mask", np.int8)
    # prompt length: position of the first trained token (the whole row when it has none)
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, tok_row[mask == 1], tok_pos[mask == 1])
    prompt_len = np.minimum(first, lengths)
    return lengths, tok_row, tok_pos, mask, prompt_len


def to_padded(table: pa.Table, layout: str, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    if layout not in LAYOUTS or layout == "flat":
        raise ValueError(f"unknown padded layout {layout!r}; one of {LAYOUTS[1:]}")
    lengths, tok_row, tok_pos, mask, prompt_len = _geometry(table)
    n = len(lengths)
    resp_len = lengths - prompt_len
    P = int(prompt_len.max()) if n else 0
    R = max(int(resp_len.max()) if n else 0, 1)
    in_prompt = tok_pos < prompt_len[tok_row]
    p_col = (P - prompt_len[tok_row] + tok_pos)[in_prompt]
    p_row = tok_row[in_prompt]
    r_col = (tok_pos - prompt_len[tok_row])[~in_prompt]
    r_row = tok_row[~in_prompt]

    ids = _flat(table, "input_ids", np.int64)
    prompts = np.full((n, P), pad_token_id, dtype=np.int64)
    prompts[p_row, p_col] = ids[in_prompt]
    responses = np.full((n, R), pad_token_id, dtype=np.int64)
    responses[r_row, r_col] = ids[~in_prompt]
    prompt_attn = np.zeros((n, P), dtype=np.int64)
    prompt_attn[p_row, p_col] = 1
    response_real = np.zeros((n, R), dtype=np.int64)
    response_real[r_row, r_col] = 1

    def resp(name: str, dtype=np.float32) -> np.ndarray:
        out = np.zeros((n, R), dtype=dtype)
        out[r_row, r_col] = _flat(table, name, dtype)[~in_prompt]
        return out

    response_mask = resp("loss_mask", np.int64)
    old_lp, adv = resp("old_logprobs"), resp("advantages")
    has_returns = table.column("returns").null_count < table.num_rows
    returns = resp("returns") if has_returns else np.zeros((n, R), np.float32)
    values = resp("values") if table.column("values").null_count < table.num_rows else np.zeros((n, R), np.float32)
    sequences = np.concatenate([prompts, responses], axis=1)
    attention = np.concatenate([prompt_attn, response_real], axis=1)
    uid = np.asarray(table.column("group_id").to_pylist(), dtype=np.str_)
    traj_id = np.asarray(table.column("traj_id").to_pylist(), dtype=np.str_)
    common = {"uid": uid, "traj_id": traj_id}
    if layout == "verl":
        position_ids = np.clip(np.cumsum(attention, axis=1) - 1, 0, None)
        # verl's outcome reward: the scalar on the last real response token (as its reward managers place it)
        scores = np.zeros((n, R), dtype=np.float32)
        scores[np.arange(n), np.maximum(resp_len - 1, 0)] = table.column("reward").to_numpy(zero_copy_only=False)
        return {"prompts": prompts, "responses": responses, "input_ids": sequences, "attention_mask": attention,
                "position_ids": position_ids, "response_mask": response_mask, "old_log_probs": old_lp,
                "advantages": adv, "returns": returns, "values": values, "token_level_scores": scores, **common}
    if layout == "openrlhf":
        turns = resp("turn_ids", np.int64)
        max_turn = int(turns.max()) if turns.size else 0
        ranges = np.full((n, max(max_turn, 1), 2), -1, dtype=np.int64)
        if max_turn:
            rows, cols = np.nonzero(turns)
            k = turns[rows, cols] - 1
            big = np.iinfo(np.int64).max
            start = np.full((n, max_turn), big, dtype=np.int64)
            end = np.full((n, max_turn), -1, dtype=np.int64)
            np.minimum.at(start, (rows, k), cols)
            np.maximum.at(end, (rows, k), cols + 1)
            present = end >= 0
            ranges[..., 0] = np.where(present, start, -1)
            ranges[..., 1] = np.where(present, end, -1)
        return {"sequences": sequences, "attention_mask": attention, "action_mask": response_mask,
                "action_log_probs": old_lp, "advantages": adv, "returns": returns, "values": values,
                "action_ranges": ranges, "num_actions": np.asarray(R, dtype=np.int64), **common}
    return {"sequences": sequences, "attention_mask": attention, "loss_mask": response_mask,
            "response_mask": response_real, "action_log_probs": old_lp, "advantages": adv, "returns": returns,
            "values": values, **common}


def save_padded(arrays: dict[str, np.ndarray], path) -> None:
    np.savez(path, **{k: np.ascontiguousarray(v) for k, v in arrays.items()})
