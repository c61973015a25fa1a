"""An environment's batch (`Built`: segments per step, scores per turn) as canonical `trajectories` and
`steps` tables: one gather of every content's bytes, one token per byte, list columns from flat arrays and
offsets."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.synth.common import ASSISTANT, MAXSEG, ROLE_NAMES, TOOL, Built, Pool, SynthSettings
from schemas import steps as steps_schema
from schemas import trajectories as traj_schema


def _list_array(offsets: np.ndarray, values: pa.Array, valid: np.ndarray | None = None) -> pa.Array:
    offs = pa.array(offsets.astype(np.int32))
    if valid is None:
        return pa.ListArray.from_arrays(offs, values)
    return pa.ListArray.from_arrays(offs, values, mask=pa.array(~valid))


def _text(b: Built, pool: Pool) -> tuple[np.ndarray, pa.Array, pa.Array, pa.Array]:
    """Per step: its byte count, and the content, token_ids and token_offsets columns (segment byte ranges ->
    one gather over the pool buffer; one token per byte, its offset the char index of the byte)."""
    n_rows = b.seg_piece.shape[0] * b.seg_piece.shape[1]
    piece = b.seg_piece.reshape(-1)
    starts = np.where(piece >= 0, pool.start[np.maximum(piece, 0)], b.filler_start.reshape(-1))
    lens = np.where(
        piece >= 0, pool.len[np.maximum(piece, 0)], np.where(piece == -2, b.filler_len.reshape(-1), 0)
    )
    step_bytes = lens.reshape(n_rows, MAXSEG).sum(axis=1)
    nz = lens > 0
    seg_s, seg_l = starts[nz], lens[nz]
    out_pos = np.cumsum(seg_l) - seg_l
    total = int(seg_l.sum())
    gather = np.arange(total, dtype=np.int64) - np.repeat(out_pos - seg_s, seg_l)
    data = pool.buf[gather]
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(step_bytes, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("batch too large for int32 offsets: lower batch_groups")
    content = pa.StringArray.from_buffers(n_rows, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))
    char_idx = np.cumsum((data & 0xC0) != 0x80) - 1
    first_char = np.concatenate([char_idx, [0]])[offsets[:-1]]
    tok_offsets = (char_idx - np.repeat(first_char, step_bytes)).astype(np.int32)
    token_ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(data.astype(np.int32)))
    token_offsets = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tok_offsets))
    return step_bytes, content, token_ids, token_offsets


def _policy_columns(
    rng: np.random.Generator, b: Built, step_bytes: np.ndarray, is_asst: np.ndarray
) -> tuple[pa.Array, pa.Array]:
    """logprobs and critic values on assistant tokens only (null lists elsewhere)."""
    N, n_steps = b.role.shape
    asst_bytes = np.where(is_asst, step_bytes, 0)
    a_off = np.zeros(N * n_steps + 1, dtype=np.int64)
    np.cumsum(asst_bytes, out=a_off[1:])
    n_a = int(a_off[-1])
    logprobs = rng.standard_exponential(n_a, dtype=np.float32)
    logprobs *= np.float32(-0.03)  # most tokens: p close to 1
    heavy = np.flatnonzero(rng.random(n_a, dtype=np.float32) < 0.12)  # a heavy tail of unlikely tokens
    logprobs[heavy] = np.maximum(-rng.gamma(0.8, 2.0, len(heavy)), -25.0)
    turn_prev = np.zeros((N, n_steps))
    turn_prev[:, 2::2] = b.prev_score
    base = 0.2 + 0.6 * turn_prev.reshape(-1)
    values = rng.standard_normal(n_a, dtype=np.float32)
    values *= np.float32(0.03)
    values += np.repeat(base.astype(np.float32), asst_bytes)
    return _list_array(a_off, pa.array(logprobs), is_asst), _list_array(a_off, pa.array(values), is_asst)


def _tool_call_columns(
    rng: np.random.Generator, b: Built, pool: Pool, role: np.ndarray
) -> tuple[pa.Array, pa.Array]:
    """tool_calls (one per assistant turn that calls a tool) and tool_call_id on the tool step answering it."""
    N, n_steps = b.role.shape
    n_rows = N * n_steps
    names = pa.array(pool.strings, pa.string())
    call_name: np.ndarray = np.full((N, n_steps), -1, dtype=np.int64)
    call_name[:, 2::2] = b.call_name
    call_args: np.ndarray = np.full((N, n_steps), -1, dtype=np.int64)
    call_args[:, 2::2] = b.call_args
    call_name, call_args = call_name.reshape(-1), call_args.reshape(-1)
    has_call = call_name >= 0
    rows_call = np.flatnonzero(has_call)
    call_nums = rng.integers(0, 2**62, len(rows_call))
    call_ids = pa.array([f"call_{x:016x}" for x in call_nums.tolist()], pa.string())
    struct = pa.StructArray.from_arrays(
        [call_ids, names.take(pa.array(call_name[rows_call])), names.take(pa.array(call_args[rows_call]))],
        fields=list(steps_schema.TOOL_CALL),
    )
    tc_off = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(has_call, out=tc_off[1:])
    id_of_row = np.full(n_rows, -1, dtype=np.int64)
    id_of_row[rows_call] = np.arange(len(rows_call))
    obs_rows = rows_call + 1
    obs_rows = obs_rows[(obs_rows < n_rows) & (role[np.minimum(obs_rows, n_rows - 1)] == TOOL)]
    tcid_idx = np.full(n_rows, -1, dtype=np.int64)
    tcid_idx[obs_rows] = id_of_row[obs_rows - 1]
    return _list_array(tc_off, struct, has_call), call_ids.take(pa.array(tcid_idx, mask=tcid_idx < 0))


def _trajectories(b: Built, s: SynthSettings, traj_arr: pa.Array, group_str: np.ndarray) -> pa.Table:
    N = len(traj_arr)
    comp_keys = pa.array(np.tile(np.array(["correct", "format"], dtype=object), N), pa.string())
    comp_vals = pa.array(np.stack([b.reward, b.fmt], axis=1).reshape(-1), pa.float64())
    components = pa.MapArray.from_arrays(
        pa.array(np.arange(0, 2 * N + 1, 2, dtype=np.int32)), comp_keys, comp_vals
    )
    return pa.table(
        {
            "round": pa.array(np.full(N, s.round, dtype=np.int32)),
            "traj_id": traj_arr,
            "group_id": pa.array(np.repeat(group_str, s.samples), pa.string()),
            "sample_idx": pa.array(np.tile(np.arange(s.samples, dtype=np.int32), len(group_str))),
            "reward": pa.array(b.reward, pa.float64()),
            "reward_components": components,
            "source": pa.array([b.source] * N, pa.string()),
            "action_format": pa.array([b.action_format] * N, pa.string()),
            "policy_version": pa.array([s.policy_version] * N, pa.string()),
            "meta": pa.array(b.meta, pa.string()),
        },
        schema=traj_schema.SCHEMA,
    )


def tables(
    b: Built, s: SynthSettings, group_ids: np.ndarray, pool: Pool, rng: np.random.Generator
) -> tuple[pa.Table, pa.Table]:
    """(trajectories, steps) of one environment's batch; `group_ids`: the round's numbers of its groups."""
    N, n_steps, _ = b.seg_piece.shape
    K = s.turns
    n_rows = N * n_steps
    step_bytes, content, token_ids, token_offsets = _text(b, pool)
    role = b.role.reshape(-1)
    is_asst = role == ASSISTANT
    logprobs, values = _policy_columns(rng, b, step_bytes, is_asst)
    score: np.ndarray = np.full((N, n_steps), np.nan)
    score[:, 2::2] = b.score
    score = score.reshape(-1)
    group_str = np.array([f"r{s.round}-g{g:06d}" for g in group_ids], dtype=object)
    traj_ids = [f"{group_str[i // s.samples]}-s{i % s.samples:02d}" for i in range(N)]
    traj_arr = pa.array(traj_ids, pa.string())
    turn: np.ndarray = np.zeros((N, n_steps), dtype=np.int32)
    turn[:, 2::2] = np.arange(1, K + 1)
    turn[:, 3::2] = np.arange(1, K)
    turn = turn.reshape(-1)
    tool_calls, tool_call_id = _tool_call_columns(rng, b, pool, role)
    steps = pa.table(
        {
            "round": pa.array(np.full(n_rows, s.round, dtype=np.int32)),
            "traj_id": traj_arr.take(pa.array(np.repeat(np.arange(N), n_steps))),
            "step_idx": pa.array(np.tile(np.arange(n_steps, dtype=np.int32), N)),
            "role": pa.array(ROLE_NAMES[role].astype(object), pa.string()),
            "turn": pa.array(turn, pa.int32(), mask=turn == 0),
            "content": content,
            "tool_calls": tool_calls,
            "tool_call_id": tool_call_id,
            "is_error": pa.array(b.is_error.reshape(-1)),
            "token_ids": token_ids,
            "token_offsets": token_offsets,
            "logprobs": logprobs,
            "logprob_source": pc.if_else(pa.array(is_asst), "synthetic", pa.scalar(None, pa.string())),
            "values": values,
            "verifier_score": pa.array(score, pa.float64(), mask=~is_asst),
        },
        schema=steps_schema.SPEC.written_schema,
    )
    steps = steps_schema.SPEC.conform(steps)  # the derived columns (n_tokens, the value moments)
    return _trajectories(b, s, traj_arr, group_str), steps
