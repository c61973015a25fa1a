"""Checks every format gets, on each draft: turn numbering, roles, tool-call links, reward, token and logprob
lengths (`finalize`), text that is valid Unicode, and token data that cannot lie (`token_rejects`, whole
columns: ids in [0, vocab size), finite logprobs <= `LOGPROB_TOLERANCE`, offsets inside the content)."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa

from pipeline.ingest.records import (
    INVALID_TOKENS,
    INVALID_UTF8,
    INVALID_VALUE,
    LENGTH_MISMATCH,
    LOGPROB_TOLERANCE,
    MISSING_FIELD,
    ROLES,
    SURROGATE,
    TOKEN_ID_LIMIT,
    UNKNOWN_ROLE,
    UNMATCHED_TOOL_RESULT,
    Reject,
    StepDraft,
    TrajectoryDraft,
    as_reward,
)
from schemas import steps as steps_schema

# ---- checks and turn numbering -------------------------------------------------------------------------


def finalize(draft: TrajectoryDraft) -> TrajectoryDraft:
    """Number the turns and check roles, tool-call links, reward and token/logprob lengths."""
    if not draft.traj_id:
        raise Reject(MISSING_FIELD, "traj_id is empty", "traj_id")
    draft.reward = as_reward(draft.reward)
    if draft.reward_components:
        draft.reward_components = {
            str(k): as_reward(v, f"reward_components.{k}") for k, v in draft.reward_components.items()
        }
    if not draft.steps:
        raise Reject(MISSING_FIELD, "trajectory has no steps", "messages")
    turn = 0
    call_ids: set[str] = set()
    call_turn: dict[str, int] = {}  # call id -> the turn that made it
    for i, step in enumerate(draft.steps):
        if step.role not in ROLES:
            raise Reject(UNKNOWN_ROLE, f"step {i} has role {step.role!r}", f"steps[{i}].role")
        if step.role == "assistant":
            turn += 1
            step.turn = turn
        elif step.role in steps_schema.UNSEEN_ROLES:
            step.turn = None  # the agent never saw it: no turn (and no tokens: `build_tables`)
        else:
            step.turn = turn or None
        for call in step.tool_calls or ():
            if not call.get("id"):
                raise Reject(
                    MISSING_FIELD, f"step {i} has a tool call without id", f"steps[{i}].tool_calls.id"
                )
            if not call.get("name"):
                raise Reject(
                    MISSING_FIELD, f"step {i} has a tool call without name", f"steps[{i}].tool_calls.name"
                )
            call_ids.add(call["id"])
        if step.role == "tool" and step.tool_call_id is not None and step.tool_call_id not in call_ids:
            raise Reject(
                UNMATCHED_TOOL_RESULT,
                f"tool step {i} answers call {step.tool_call_id!r}, which no earlier step made",
                f"steps[{i}].tool_call_id",
            )
        if step.role == "tool" and step.tool_call_id in call_turn:
            step.turn = call_turn[step.tool_call_id]  # the turn of the action it answers, not the latest turn
        if step.role == "assistant":
            call_turn.update((c["id"], turn) for c in step.tool_calls or ())
        if (
            step.token_ids is not None
            and step.logprobs is not None
            and len(step.token_ids) != len(step.logprobs)
        ):
            raise Reject(
                LENGTH_MISMATCH,
                f"step {i}: {len(step.token_ids)} token_ids but {len(step.logprobs)} logprobs",
                f"steps[{i}].logprobs",
            )
        if step.logprobs is not None and not all_instances(step.logprobs, (int, float)):
            raise Reject(INVALID_VALUE, f"step {i}: logprobs are not numbers", f"steps[{i}].logprobs")
        if step.token_ids is not None and not all_instances(step.token_ids, int):
            raise Reject(INVALID_VALUE, f"step {i}: token_ids are not integers", f"steps[{i}].token_ids")
        _check_step_tokens(i, step)
        if step.verifier_score is not None:
            step.verifier_score = as_reward(step.verifier_score, f"steps[{i}].verifier_score")
    if isinstance(draft.sample_idx, int) and not -(2**31) <= draft.sample_idx < 2**31:
        raise Reject(INVALID_VALUE, f"sample_idx {draft.sample_idx} does not fit int32", "sample_idx")
    _check_text(draft)
    return draft


# ---- token data and text that cannot lie ---------------------------------------------------------------


def all_instances(values: list, kinds: type | tuple[type, ...]) -> bool:
    """Every value is an instance of `kinds` and none is a bool: the distinct types of the list in one C-level
    pass (`map(type, ...)`), then one check per type, not per token. (Arrow and NumPy conversions coerce
    1.0 to an int and True to a float, so they cannot tell these apart.)"""
    return all(issubclass(t, kinds) and not issubclass(t, bool) for t in set(map(type, values)))


def bad_token_ids(ids: np.ndarray, limit: int = TOKEN_ID_LIMIT) -> np.ndarray:
    """Mask of ids that are not in [0, limit) (NaN and fractional values too, for float input)."""
    ids = np.asarray(ids)
    if ids.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            return ~np.isfinite(ids) | (ids < 0) | (ids >= limit) | (ids != np.floor(ids))
    if ids.dtype.kind == "u":
        return ids >= limit
    return (ids < 0) | (ids >= limit)


def bad_logprobs(logprobs: np.ndarray) -> np.ndarray:
    """Mask of logprobs that are not finite or above `LOGPROB_TOLERANCE`."""
    lp = np.asarray(logprobs, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return ~np.isfinite(lp) | (lp > LOGPROB_TOLERANCE)


def token_id_problem(value, position: int, limit: int = TOKEN_ID_LIMIT, vocab_note: str = "") -> str:
    """Why the id `value` (found bad by `bad_token_ids`) at `position` of its step is refused."""
    if isinstance(value, float) and not (math.isfinite(value) and value == int(value)):
        return f"token id {value!r} at position {position} is not an integer"
    if value < 0:
        return f"token id {value} at position {position} is negative"
    if value >= TOKEN_ID_LIMIT:
        return f"token id {value} at position {position} does not fit int32 (>= 2^31)"
    return f"token id {value} at position {position} is >= the vocabulary size {limit}{vocab_note}"


def logprob_problem(value, position: int) -> str:
    """Why the logprob `value` (found bad by `bad_logprobs`) at `position` of its step is refused."""
    if not math.isfinite(value):
        return f"logprob {value} at position {position} is not finite"
    return f"logprob {value} at position {position} is > 0 (not a log probability)"


def checked_ids(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids from a framework's array as int64, without a silent cast: (ids, bad), `bad` marking entries
    that are not integers in [0, 2^31) (set to 0 in `ids`). A non-numeric dtype is a Reject for the file."""
    values = np.asarray(values)
    if values.dtype.kind not in "iuf":
        raise Reject(INVALID_VALUE, f"{name} has dtype {values.dtype}, expected integer token ids", name)
    bad = bad_token_ids(values)
    return np.where(bad, 0, values).astype(np.int64), bad


def checked_ids_text(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """An id column of a framework's batch (verl's `uid`) as strings, without a silent cast: (text, bad),
    `bad` marking entries that are not a string or an integer (None, NaN, objects: not made "None" or
    "nan", which would merge them into one group). Not 1-D: a Reject for the file."""
    values = np.asarray(values)
    if values.ndim != 1:
        raise Reject(INVALID_VALUE, f"{name} has shape {values.shape}, expected one id per row", name)
    if values.dtype.kind == "O":
        bad = np.fromiter(
            (not isinstance(x, (str, int, np.integer)) or isinstance(x, bool) for x in values),
            bool,
            len(values),
        )
    elif values.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(values) | (values != np.floor(values))
    elif values.dtype.kind in "iuUS":
        bad = np.zeros(len(values), bool)
    else:
        raise Reject(INVALID_VALUE, f"{name} has dtype {values.dtype}, expected text or integer ids", name)
    kind = values.dtype.kind
    if kind in "iuU":
        return values.astype(str), bad
    if kind == "S":
        text = [x.decode("utf-8", "backslashreplace") for x in values.tolist()]
    else:  # objects and floats: row by row, the bad ones left empty
        text = [
            "" if b else str(int(x) if kind == "f" else x)
            for x, b in zip(values.tolist(), bad.tolist(), strict=True)
        ]
    return np.array(text, dtype=object).astype(str), bad


def _check_step_tokens(i: int, step: StepDraft) -> None:
    """Before any cast: ids in [0, 2^31), logprobs finite and <= tolerance (the vocabulary bound is checked
    on the whole steps table, `token_rejects`)."""
    if step.token_ids:
        try:
            ids = np.array(step.token_ids, dtype=np.int64)
            bad = bad_token_ids(ids)
        except OverflowError:
            bad = np.array([not (0 <= x < TOKEN_ID_LIMIT) for x in step.token_ids])
        if bad.any():
            k = int(np.argmax(bad))
            raise Reject(
                INVALID_TOKENS, f"step {i}: {token_id_problem(step.token_ids[k], k)}", f"steps[{i}].token_ids"
            )
    if step.logprobs:
        try:
            values = np.array(step.logprobs, dtype=np.float64)
        except OverflowError:  # an int too large for a float: infinite
            values = np.array(
                [x if isinstance(x, float) or abs(x) < 2**1023 else math.inf for x in step.logprobs]
            )
        bad = bad_logprobs(values)
        if bad.any():
            k = int(np.argmax(bad))
            detail = logprob_problem(float(values[k]), k)
            raise Reject(INVALID_TOKENS, f"step {i}: {detail}", f"steps[{i}].logprobs")


def _bad_text(value) -> bool:
    return isinstance(value, str) and SURROGATE.search(value) is not None


def _check_text(draft: TrajectoryDraft) -> None:
    """Every text of the trajectory is a string (None where optional) of valid Unicode (no lone surrogates
    from `\\ud800` escapes or undecodable bytes), and its meta can be written as JSON."""
    texts = [(name, getattr(draft, name), False) for name in ("traj_id", "group_id", "source")]
    texts += [(name, getattr(draft, name), True) for name in ("action_format", "policy_version")]
    texts += [("reward_components", key, False) for key in draft.reward_components or {}]
    for i, step in enumerate(draft.steps):
        texts += [
            (f"steps[{i}].content", step.content, False),
            (f"steps[{i}].tool_call_id", step.tool_call_id, True),
        ]
        for call in step.tool_calls or ():
            if not isinstance(call, dict):
                raise Reject(
                    INVALID_VALUE, f"step {i}: a tool call is not an object", f"steps[{i}].tool_calls"
                )
            texts += [
                (f"steps[{i}].tool_calls", call.get(k), k == "arguments") for k in ("id", "name", "arguments")
            ]
    for name, text, optional in texts:
        if not isinstance(text, str) and not (optional and text is None):
            raise Reject(INVALID_VALUE, f"{name} is {type(text).__name__}, expected text", name)
        if _bad_text(text):
            raise Reject(INVALID_UTF8, f"{name} is not valid Unicode (a lone surrogate)", name)
    if draft.sample_idx is not None and (
        not isinstance(draft.sample_idx, int) or isinstance(draft.sample_idx, bool)
    ):
        raise Reject(INVALID_VALUE, f"sample_idx {draft.sample_idx!r} is not an integer", "sample_idx")
    if draft.meta is not None:
        try:
            text = json.dumps(draft.meta, ensure_ascii=False, default=str)
        except (ValueError, TypeError, RecursionError) as exc:
            detail = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
            raise Reject(INVALID_VALUE, f"meta cannot be written as JSON: {detail}", "meta") from None
        if _bad_text(text):
            raise Reject(INVALID_UTF8, "meta is not valid Unicode (a lone surrogate)", "meta")


def token_rejects(steps: pa.Table, vocab_size: int | None = None, vocab_note: str = "") -> dict[int, Reject]:
    """Row -> Reject for every step row whose token data lie, whole-column: ids outside [0, vocab size)
    (or [0, 2^31) without one) or null, logprobs not finite or > tolerance, offsets outside the content.
    The field is `steps[<step_idx>].<column>`; only the rows with a problem are visited in Python."""
    import pyarrow.compute as pc

    limit = min(int(vocab_size), TOKEN_ID_LIMIT) if vocab_size else TOKEN_ID_LIMIT
    out: dict[int, Reject] = {}
    names = steps.column_names
    step_idx = steps.column("step_idx").to_pylist() if "step_idx" in names else None
    content_len = None
    if "content" in names and pa.types.is_string(steps.schema.field("content").type):
        # a null content is the schema's to name (a missing field), not an offset problem
        content_len = pc.fill_null(pc.utf8_length(steps.column("content")).cast(pa.int64()), 2**62).to_numpy()

    def scan(column: str, bad_of, problem) -> None:
        if column not in names:
            return
        col = steps.column(column).combine_chunks()
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            return
        # the child values between the first and last offset (a null list may still own values: they are
        # not data, so they are masked out, not skipped, to keep each value's parent row exact)
        offsets = col.offsets.to_numpy().astype(np.int64)
        flat = col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        if not (pa.types.is_integer(flat.type) or pa.types.is_floating(flat.type)) or not len(flat):
            return
        parents = np.repeat(np.arange(len(col)), np.diff(offsets))
        values = flat.to_numpy(zero_copy_only=False)
        bad = bad_of(values, parents) | pc.is_null(flat).to_numpy(zero_copy_only=False)
        bad &= col.is_valid().to_numpy(zero_copy_only=False)[parents]
        if not bad.any():
            return
        hit = np.flatnonzero(bad)
        rows, first = np.unique(parents[hit], return_index=True)
        row_start = offsets[rows] - offsets[0]
        for row, k, start in zip(rows.tolist(), hit[first].tolist(), row_start.tolist(), strict=True):
            if row in out:
                continue
            value = flat[k].as_py()
            where = f"step {step_idx[row]}" if step_idx else f"row {row}"
            field_name = f"steps[{step_idx[row]}].{column}" if step_idx else column
            detail = (
                f"{column} value is null at position {k - start}"
                if value is None
                else problem(value, k - start)
            )
            out[row] = Reject(INVALID_TOKENS, f"{where}: {detail}", field_name)

    scan(
        "token_ids",
        lambda v, _p: bad_token_ids(v, limit),
        lambda v, k: token_id_problem(v, k, limit, vocab_note),
    )
    scan("logprobs", lambda v, _p: bad_logprobs(v), logprob_problem)
    if content_len is not None:

        def bad_offsets(values, parents):
            with np.errstate(invalid="ignore"):
                return (values < 0) | (values > content_len[parents])

        scan(
            "token_offsets",
            bad_offsets,
            lambda v, k: f"token offset {v} at position {k} is outside the content",
        )
    return out
