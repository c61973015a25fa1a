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
    return pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _geometry(table: pa.Table):
    """Per-row lengths and prompt lengths, the flat loss mask, and which flat tokens are prompt tokens."""
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    mask = _flat(table, "loss_mask", np.int8)
    # prompt length: position of the first trained token (the whole row when it has none): the first masked
    # token at or after each row start, found by binary search over the masked positions (rows are in order)
    trained = np.flatnonzero(mask == 1)
    k = np.searchsorted(trained, starts)
    first = np.append(trained, np.iinfo(np.int64).max)[k] - starts
    prompt_len = np.minimum(first, lengths)
    # each row is prompt_len prompt tokens then the rest: one run of True then one of False per row
    in_prompt = np.repeat(
        np.tile(np.array([True, False]), len(lengths)),
        np.column_stack([prompt_len, lengths - prompt_len]).ravel(),
    )
    return lengths, starts, mask, prompt_len, in_prompt


def to_padded(table: pa.Table, layout: str, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    if layout not in LAYOUTS or layout == "flat":
        raise ValueError(f"unknown padded layout {layout!r}; one of {LAYOUTS[1:]}")
    lengths, starts, mask, prompt_len, in_prompt = _geometry(table)
    n = len(lengths)
    resp_len = lengths - prompt_len
    P = int(prompt_len.max()) if n else 0
    R = max(int(resp_len.max()) if n else 0, 1)
    # the real tokens of a padded row, in row-major order, are exactly the flat tokens in order: boolean-mask
    # assignment fills them with one compress + one copy per array (no per-token index arrays)
    p_real = np.arange(P)[None, :] >= (P - prompt_len)[:, None]  # left-padded prompt
    r_real = np.arange(R)[None, :] < resp_len[:, None]  # right-padded response
    in_resp = ~in_prompt

    def prompt_side(flat: np.ndarray, dtype, fill=0) -> np.ndarray:
        out = np.full((n, P), fill, dtype=dtype)
        out[p_real] = flat[in_prompt]
        return out

    def resp_side(flat: np.ndarray, dtype, fill=0) -> np.ndarray:
        out = np.full((n, R), fill, dtype=dtype)
        out[r_real] = flat[in_resp]
        return out

    def resp(name: str, dtype=np.float32) -> np.ndarray:
        return resp_side(_flat(table, name, dtype), dtype)

    ids = _flat(table, "input_ids", np.int64)
    prompts = prompt_side(ids, np.int64, pad_token_id)
    responses = resp_side(ids, np.int64, pad_token_id)
    response_real = r_real.astype(np.int64)
    response_mask = resp_side(mask, np.int64)
    old_lp, adv = resp("old_logprobs"), resp("advantages")
    has_returns = table.column("returns").null_count < table.num_rows
    returns = resp("returns") if has_returns else np.zeros((n, R), np.float32)
    values = (
        resp("values") if table.column("values").null_count < table.num_rows else np.zeros((n, R), np.float32)
    )
    sequences = np.concatenate([prompts, responses], axis=1)
    attention = np.concatenate([p_real, r_real], axis=1).astype(np.int64)
    uid = np.asarray(table.column("group_id").to_pylist(), dtype=np.str_)
    traj_id = np.asarray(table.column("traj_id").to_pylist(), dtype=np.str_)
    common = {"uid": uid, "traj_id": traj_id}
    if layout == "verl":
        # = clip(cumsum(attention) - 1, 0): the real tokens of a row are one contiguous block starting at
        # P - prompt_len, so position j counts j - (P - prompt_len), held at 0 before it and at len - 1 after it
        position_ids = np.arange(P + R, dtype=np.int64)[None, :] - (P - prompt_len)[:, None]
        np.clip(position_ids, 0, np.maximum(lengths - 1, 0)[:, None], out=position_ids)
        # verl's outcome reward: the scalar on the last real response token (as its reward managers place it)
        scores = np.zeros((n, R), dtype=np.float32)
        scores[np.arange(n), np.maximum(resp_len - 1, 0)] = table.column("reward").to_numpy(
            zero_copy_only=False
        )
        return {
            "prompts": prompts,
            "responses": responses,
            "input_ids": sequences,
            "attention_mask": attention,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "old_log_probs": old_lp,
            "advantages": adv,
            "returns": returns,
            "values": values,
            "token_level_scores": scores,
            **common,
        }
    if layout == "openrlhf":
        return {
            "sequences": sequences,
            "attention_mask": attention,
            "action_mask": response_mask,
            "action_log_probs": old_lp,
            "advantages": adv,
            "returns": returns,
            "values": values,
            "action_ranges": _action_ranges(table, starts, prompt_len, in_resp, n),
            "num_actions": np.asarray(R, dtype=np.int64),
            **common,
        }
    return {
        "sequences": sequences,
        "attention_mask": attention,
        "loss_mask": response_mask,
        "response_mask": response_real,
        "action_log_probs": old_lp,
        "advantages": adv,
        "returns": returns,
        "values": values,
        **common,
    }


def _action_ranges(
    table: pa.Table, starts: np.ndarray, prompt_len: np.ndarray, in_resp: np.ndarray, n: int
) -> np.ndarray:
    """Per row and turn k (1-based turn id), the [start, end) response columns of turn k's tokens: from the
    first to one past the last token of that turn, -1 where the row has no turn k. Computed on runs: a run is a
    stretch of consecutive response tokens of one row with one turn id; per (row, turn) the min start / max end
    over its runs (a few per turn, not one update per token)."""
    turn = _flat(table, "turn_ids", np.int32)
    pos = np.flatnonzero(in_resp & (turn > 0))  # response tokens with a turn id, in (row, column) order
    t = turn[pos]
    max_turn = int(t.max()) if len(t) else 0
    ranges = np.full((n, max(max_turn, 1), 2), -1, dtype=np.int64)
    if not max_turn:
        return ranges
    row_start = np.zeros(len(turn) + 1, dtype=bool)
    row_start[starts] = True
    brk = np.ones(len(pos), dtype=bool)  # a run starts: turn id changes, a gap (tool tokens), or a new row
    brk[1:] = (t[1:] != t[:-1]) | (pos[1:] != pos[:-1] + 1) | row_start[pos[1:]]
    first = np.flatnonzero(brk)
    last = np.append(first[1:], len(pos)) - 1
    row = np.searchsorted(starts, pos[first], side="right") - 1
    base = (starts + prompt_len)[row]
    key = row * max_turn + (t[first] - 1)
    start = np.full(n * max_turn, np.iinfo(np.int64).max, dtype=np.int64)
    end = np.full(n * max_turn, -1, dtype=np.int64)
    np.minimum.at(start, key, pos[first] - base)
    np.maximum.at(end, key, pos[last] - base + 1)
    present = end >= 0
    ranges.reshape(-1, 2)[present] = np.column_stack([start[present], end[present]])
    return ranges


def save_padded(arrays: dict[str, np.ndarray], path) -> None:
    """Write the arrays as an uncompressed `.npz` (what `np.savez` writes: a zip of `.npy` members, no pickle),
    streaming each array's buffer straight into the zip (np.savez copies it in chunks first)."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            arr = np.ascontiguousarray(value)
            with zf.open(f"{name}.npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array_header_1_0(fh, np.lib.format.header_data_from_array_1_0(arr))
                if arr.size:
                    fh.write(arr.reshape(-1).view(np.uint8))
