"""Export layouts for the RL frameworks people run, as each one's current code lays out a training batch. Each
turns the flat per-trajectory batch (one row per trajectory: input_ids, loss_mask, old_logprobs, advantages,
values, returns, turn_ids) into the padded arrays the framework's update consumes, whole-column (boolean-mask
assignment of the flat tokens, no loop over tokens).

The prompt of a trajectory is everything before its first trained (assistant) token; the response is the
rest, so tool and user tokens between turns sit inside the response with mask 0, as in verl's, OpenRLHF's and
SkyRL's multi-turn rollouts.

- verl (0.9, `DataProto.batch` of `RayPPOTrainer.fit`): prompts (left-padded), responses (right-padded to the
  run's `rollout.response_length` when given, else the longest; longer ones are cut), input_ids = [prompts |
  responses], attention_mask, position_ids, response_mask, old_log_probs, advantages, returns, values,
  token_level_scores (the reward where `reward_columns` puts it), uid (the group id), key (`sample_keys`: what
  a live run looks a sample up by, since `fit()` gives every sample a fresh uuid each step)
- openrlhf (0.11, `Experience` after `concat_experiences`): sequences (whole sequence, right-padded),
  attention_mask, action_mask of shape (B, T-1) shifted by one (action_mask[:, j] says whether token j + 1 is
  trained; it lines up with the log-probs the actor's forward returns), rollout_log_probs, advantages, returns,
  values (all (B, T-1)), rewards (B,), response_length, total_length (float32, as OpenRLHF's),
  action_ranges ([start, end) per turn in sequence positions, as OpenRLHF's agent returns them; -1 padded);
  `max_len` cuts whole sequences as OpenRLHF does at `--data.max_len`
- skyrl (0.3, `convert_prompts_responses_to_batch_tensors`): sequences (whole sequence, left-padded),
  attention_mask, response_mask (int64) and the response tensors right-aligned in (B, max response length):
  loss_mask (float32), rollout_logprobs, rewards, advantages, returns, values (float32); `response_length` cuts
  responses as SkyRL's generator does at `generator.sampling_params.max_generate_length`
Every layout also carries traj_id, uid, key and logprobs_known ((B,) bool: the row's logprobs are the
behaviour policy's; False: 0-filled, unknown). Arrays are C-contiguous NumPy, saved with `np.savez` layout
(no pickle), so `torch.from_numpy(np.load(f)[k])` needs no copy.

Reward placement (one rule, shared with the GAE estimator, `pipeline/credit/methods/gae.py` Eq. 1): the
outcome reward sits on the trajectory's last trained (assistant, mask 1) token, never on a trailing
observation token: verl's `compute_gae_advantage_return` carries `lastgaelam` through mask-0 tokens, so a
reward on an observation token would be dropped there. A row without trained tokens gets it on its last
token."""

from __future__ import annotations

import hashlib

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
    """Per-row lengths, starts and prompt lengths, the flat loss mask, and each flat token's position in its
    row."""
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    starts = np.cumsum(lengths) - lengths
    mask = _flat(table, "loss_mask", np.int8)
    # prompt length: position of the first trained token (the whole row when it has none): the first masked
    # token at or after each row start, found by binary search over the masked positions (rows are in order)
    trained = np.flatnonzero(mask == 1)
    k = np.searchsorted(trained, starts)
    first = np.append(trained, np.iinfo(np.int64).max)[k] - starts
    prompt_len = np.minimum(first, lengths)
    local = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
    return lengths, starts, mask, prompt_len, local


def _place(flat: np.ndarray, offset: np.ndarray, count: np.ndarray, width: int, dtype, fill=0) -> np.ndarray:
    """(rows, width) array with row r's `count[r]` values at columns offset[r] .. offset[r] + count[r] - 1:
    `flat` holds exactly those values, row after row. The cells are in row-major order, so one boolean-mask
    assignment fills them (no per-token index arrays)."""
    cols = np.arange(width)[None, :]
    cells = (cols >= offset[:, None]) & (cols < (offset + count)[:, None])
    out = np.full((len(offset), width), fill, dtype=dtype)
    out[cells] = flat
    return out


def _logprobs_known(table: pa.Table) -> np.ndarray:
    """The flat batch's `logprobs_known` (a batch written before the column: known where a row's trained
    tokens are not all 0, the only trace a 0-filled row leaves)."""
    if "logprobs_known" in table.column_names:
        return pc.fill_null(table.column("logprobs_known"), False).to_numpy(zero_copy_only=False).astype(bool)
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy(zero_copy_only=False).astype(np.int64)
    hit = (_flat(table, "loss_mask", np.int8) != 0) & (_flat(table, "old_logprobs", np.float32) != 0)
    hits = np.concatenate([[0], np.cumsum(hit, dtype=np.int64)])
    ends = np.cumsum(lengths)
    return (hits[ends] - hits[ends - lengths]) > 0


def reward_columns(mask: np.ndarray, last_real: np.ndarray) -> np.ndarray:
    """The reward placement rule on laid-out rows: per row of a (rows, width) loss mask, the column of its last
    trained token, else `last_real` (the row's last real column)."""
    width = mask.shape[1]
    if width == 0:
        return np.zeros(len(mask), dtype=np.int64)
    trained = mask != 0
    last = width - 1 - np.argmax(trained[:, ::-1], axis=1)
    return np.where(trained.any(axis=1), last, np.maximum(last_real, 0)).astype(np.int64)


def sample_key(prompt_ids, response_ids) -> str:
    """The stable key of one sample: a hash of its prompt and response token ids, i.e. of its whole token
    sequence (what a trainer still has when its per-step uids are fresh; where the prompt ends does not enter,
    so a framework that cannot tell, e.g. OpenRLHF whose first token is never an action, gets the same key).
    Any integer sequences; the same ids give the same key (identical samples share one)."""
    p = np.asarray(prompt_ids, dtype="<i8")
    r = np.asarray(response_ids, dtype="<i8")
    h = hashlib.blake2b(digest_size=16)
    h.update(p.tobytes())
    h.update(r.tobytes())
    return h.hexdigest()


def sample_keys(
    ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, prompt_len: np.ndarray
) -> np.ndarray:
    """`sample_key` of every row of a flat batch (one hash per row, not per token)."""
    ids = np.ascontiguousarray(ids, dtype="<i8")
    out = [
        sample_key(ids[s : s + p], ids[s + p : s + n])
        for s, n, p in zip(starts.tolist(), lengths.tolist(), prompt_len.tolist(), strict=True)
    ]
    return np.asarray(out, dtype="U32")


# the length options of `to_padded`: (export flag, the layouts it applies to, its least value)
LENGTH_OPTIONS = {
    "response_length": ("--response-length", ("verl", "skyrl"), 1),
    "prompt_length": ("--prompt-length", ("verl",), 0),
    "max_len": ("--max-len", ("openrlhf",), 1),
}


def check_lengths(layout: str, **values: int | None) -> None:
    """ValueError (one line naming the export flag) for a length option the layout has no use for, or one
    out of range."""
    for name, value in values.items():
        flag, layouts, least = LENGTH_OPTIONS[name]
        if value is not None and layout not in layouts:
            raise ValueError(f"{flag} applies to --layout {' / '.join(layouts)}, not {layout}")
        if value is not None and value < least:
            raise ValueError(f"{flag} must be at least {least}, not {value}")


def to_padded(
    table: pa.Table,
    layout: str,
    pad_token_id: int = 0,
    response_length: int | None = None,
    prompt_length: int | None = None,
    max_len: int | None = None,
) -> dict[str, np.ndarray]:
    """The batch in a framework's layout, cut where the framework cuts a sample (`key` stays the whole
    sample's). `response_length` (verl, skyrl): cut responses as verl's agent loop (`response_ids[:
    rollout.response_length]`, and pad to it) and SkyRL's generator (`response[:max_generate_length]`) do;
    `prompt_length` (verl): left-pad prompts to `data.max_prompt_length`; `max_len` (openrlhf): cut whole
    sequences at `--data.max_len` as `SamplesGenerator._process_response_into_experience` does."""
    if layout not in LAYOUTS or layout == "flat":
        raise ValueError(f"unknown padded layout {layout!r}; one of {LAYOUTS[1:]}")
    check_lengths(layout, response_length=response_length, prompt_length=prompt_length, max_len=max_len)
    lengths, starts, mask, prompt_len, local = _geometry(table)
    ids = _flat(table, "input_ids", np.int64)
    has_returns = table.column("returns").null_count < table.num_rows
    has_values = table.column("values").null_count < table.num_rows
    floats = {
        "old_logprobs": _flat(table, "old_logprobs", np.float32),
        "advantages": _flat(table, "advantages", np.float32),
        "returns": _flat(table, "returns", np.float32) if has_returns else None,
        "values": _flat(table, "values", np.float32) if has_values else None,
    }
    reward = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float32)
    turn = _flat(table, "turn_ids", np.int32) if layout == "openrlhf" else np.zeros(0, np.int32)
    common = {
        "uid": np.asarray(table.column("group_id").to_pylist(), dtype=np.str_),
        "traj_id": np.asarray(table.column("traj_id").to_pylist(), dtype=np.str_),
        "key": sample_keys(ids, starts, lengths, prompt_len),
        # (B,) whether a row's logprobs are the behaviour policy's (False: 0-filled, unknown; a trainer takes
        # the policy's own for the old ones, `trainer.trl_credit`)
        "logprobs_known": _logprobs_known(table),
    }
    if layout == "verl":  # cuts its responses itself (it pads them to the same length)
        return _verl(ids, mask, floats, reward, common, lengths, prompt_len, local, pad_token_id,
                     response_length, prompt_length)  # fmt: skip
    cap = max_len if layout == "openrlhf" else response_length
    if cap is not None:
        # the framework's cut: the first `keep` tokens of each row (whole sequence, or prompt + response cut)
        keep = np.minimum(lengths, cap) if layout == "openrlhf" else np.minimum(lengths, prompt_len + cap)
        kept = local < np.repeat(keep, lengths)
        ids, mask, local = ids[kept], mask[kept], local[kept]
        floats = {k: None if v is None else v[kept] for k, v in floats.items()}
        turn = turn[kept] if layout == "openrlhf" else turn
        lengths = keep.astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        prompt_len = np.minimum(prompt_len, lengths)
    if layout == "openrlhf":
        return _openrlhf(ids, mask, floats, reward, common, lengths, starts, local, turn, pad_token_id)
    return _skyrl(ids, mask, floats, reward, common, lengths, prompt_len, local, pad_token_id)


def _openrlhf(
    ids, mask, floats, reward, common, lengths, starts, local, turn, pad_token_id
) -> dict[str, np.ndarray]:
    """OpenRLHF's experience: whole sequences left-aligned in (B, T), the action tensors shifted by one in
    (B, T - 1)."""
    n = len(lengths)
    T = int(lengths.max()) if n else 0
    zero = np.zeros(n, dtype=np.int64)
    shifted = local >= 1  # the (B, T-1) arrays: token j + 1 of a row at column j
    n_shift = np.maximum(lengths - 1, 0)
    A = max(T - 1, 0)

    def action(flat, dtype=np.float32):
        return _place(flat[shifted], zero, n_shift, A, dtype) if flat is not None else np.zeros((n, A), dtype)

    action_mask = action(mask, np.int64)
    # OpenRLHF's response_length: from the first to the last action token (0 without any)
    on = action_mask != 0
    any_on = on.any(1)
    first_on = np.argmax(on, 1) if A else np.zeros(n, np.int64)
    last_on = A - 1 - np.argmax(on[:, ::-1], 1) if A else np.zeros(n, np.int64)
    first_on, last_on = np.where(any_on, first_on, 0), np.where(any_on, last_on, -1)
    return {
        "sequences": _place(ids, zero, lengths, T, np.int64, pad_token_id),
        "attention_mask": _place(np.ones(len(ids), np.int64), zero, lengths, T, np.int64),
        "action_mask": action_mask,
        "rollout_log_probs": action(floats["old_logprobs"]),
        "advantages": action(floats["advantages"]),
        "returns": action(floats["returns"]),
        "values": action(floats["values"]),
        "rewards": reward,
        "response_length": (last_on - first_on + 1).astype(np.int64),
        "total_length": lengths.astype(np.float32),  # attention_mask.float().sum(), as OpenRLHF's
        "action_ranges": _action_ranges(turn, starts, local, n),
        **common,
    }


def _skyrl(
    ids, mask, floats, reward, common, lengths, prompt_len, local, pad_token_id
) -> dict[str, np.ndarray]:
    """SkyRL's batch: one left-padded block per row, the response tensors right-aligned in (B, max response)."""
    n = len(lengths)
    resp_len = lengths - prompt_len
    T = int(lengths.max()) if n else 0
    R = int(resp_len.max()) if n else 0
    in_resp = local >= np.repeat(prompt_len, lengths)
    r_off = R - resp_len

    def resp(flat, dtype=np.float32):
        return (
            _place(flat[in_resp], r_off, resp_len, R, dtype) if flat is not None else np.zeros((n, R), dtype)
        )

    loss_mask = resp(mask, np.float32)
    rewards = np.zeros((n, R), np.float32)
    if n and R:  # right-aligned rows: the last real column is R - 1
        rewards[np.arange(n), reward_columns(loss_mask, np.full(n, R - 1))] = np.where(
            resp_len > 0, reward, 0
        )
    return {
        "sequences": _place(ids, T - lengths, lengths, T, np.int64, pad_token_id),
        "attention_mask": _place(np.ones(len(ids), np.int64), T - lengths, lengths, T, np.int64),
        "response_mask": _place(np.ones(int(in_resp.sum()), np.int64), r_off, resp_len, R, np.int64),
        "loss_mask": loss_mask,
        "rollout_logprobs": resp(floats["old_logprobs"]),
        "rewards": rewards,
        "advantages": resp(floats["advantages"]),
        "returns": resp(floats["returns"]),
        "values": resp(floats["values"]),
        **common,
    }


def _verl(ids, mask, floats, reward, common, lengths, prompt_len, local, pad_token_id, response_length,
          prompt_length):  # fmt: skip
    n = len(lengths)
    resp_len = lengths - prompt_len
    P = int(prompt_len.max()) if n else 0
    if prompt_length is not None:
        if prompt_length < P:
            raise ValueError(f"a prompt has {P} tokens, more than prompt_length {prompt_length}")
        P = int(prompt_length)
    R = max(int(resp_len.max()) if n else 0, 1) if response_length is None else int(response_length)
    kept = np.minimum(
        resp_len, R
    )  # a response longer than the run's response_length is cut, as verl's rollout
    pos_in_resp = local - np.repeat(prompt_len, lengths)
    in_prompt = pos_in_resp < 0
    in_resp = ~in_prompt & (pos_in_resp < R)
    zero = np.zeros(n, dtype=np.int64)

    def resp(flat, dtype=np.float32, fill=0):
        return (
            _place(flat[in_resp], zero, kept, R, dtype, fill) if flat is not None else np.zeros((n, R), dtype)
        )

    prompts = _place(ids[in_prompt], P - prompt_len, prompt_len, P, np.int64, pad_token_id)
    responses = resp(ids, np.int64, pad_token_id)
    response_mask = resp(mask, np.int64)
    p_real = np.arange(P)[None, :] >= (P - prompt_len)[:, None]
    r_real = np.arange(R)[None, :] < kept[:, None]
    attention = np.concatenate([p_real, r_real], axis=1).astype(np.int64)
    # = clip(cumsum(attention) - 1, 0): the real tokens of a row are one contiguous block starting at
    # P - prompt_len, so position j counts j - (P - prompt_len), held at 0 before it and at the last after it
    real = prompt_len + kept
    position_ids = np.arange(P + R, dtype=np.int64)[None, :] - (P - prompt_len)[:, None]
    np.clip(position_ids, 0, np.maximum(real - 1, 0)[:, None], out=position_ids)
    scores = np.zeros((n, R), dtype=np.float32)
    if n and R:
        scores[np.arange(n), reward_columns(response_mask, kept - 1)] = np.where(real > 0, reward, 0)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": resp(floats["old_logprobs"]),
        "advantages": resp(floats["advantages"]),
        "returns": resp(floats["returns"]),
        "values": resp(floats["values"]),
        "token_level_scores": scores,
        **common,
    }


def _action_ranges(turn: np.ndarray, starts: np.ndarray, local: np.ndarray, n: int) -> np.ndarray:
    """Per row and turn k (1-based turn id), the [start, end) sequence positions of turn k's tokens: from the
    first to one past the last token of that turn, -1 where the row has no turn k (OpenRLHF's agent returns
    `action_ranges` in these coordinates). Computed on runs: a run is a stretch of consecutive tokens of one
    row with one turn id; per (row, turn) the min start / max end over its runs (a few per turn, not one update
    per token). `turn`: the flat turn id of each token as laid out (cut rows: their kept tokens)."""
    pos = np.flatnonzero(turn > 0)  # trained tokens with a turn id, in (row, column) order
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
    key = row * max_turn + (t[first] - 1)
    start = np.full(n * max_turn, np.iinfo(np.int64).max, dtype=np.int64)
    end = np.full(n * max_turn, -1, dtype=np.int64)
    np.minimum.at(start, key, local[pos[first]])
    np.maximum.at(end, key, local[pos[last]] + 1)
    present = end >= 0
    ranges.reshape(-1, 2)[present] = np.column_stack([start[present], end[present]])
    return ranges
