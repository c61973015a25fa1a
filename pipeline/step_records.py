"""What a padded export cannot say in token arrays, carried beside them so that `ingest -f verl-batch` gets the
trajectory back as it was (issue 31.5): per row, one JSON text (UTF-8 bytes, `creditflow_steps`, shape (B,), no
pickle) with the trajectory's fields and, per step in order, its role, turn, token count, tool calls, tool call
id, error flag, content, token offsets, verifier score, values and logprob source. Token ids and the logprobs of
trained tokens stay in the arrays (the reader takes them from there); a row's steps cut its real tokens (the
prompt's, then the response's) by their token counts; a row the export cut (verl's response_length) keeps the
steps up to the cut.

    {"v": 1, "trajectory": {"sample_idx", "reward", "reward_components", "policy_version", "action_format",
     "source", "meta"}, "steps": [{"role", "turn", "n", "is_error", "tool_call_id", "tool_calls", "content",
     "offsets", "verifier_score", "values", "logprob_source", "has_logprobs", "logprobs" (non-assistant steps
     only: the arrays hold the response's trained tokens')}, ...]}

Pure: tables in, arrays out; `decode` checks every field (the file may be anything) and says what is wrong in
one line (`StepRecordError`)."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pyarrow as pa

from schemas.steps import ROLES

NAME = "creditflow_steps"
VERSION = 1

_TRAJ_FIELDS = (
    "sample_idx",
    "reward",
    "reward_components",
    "policy_version",
    "action_format",
    "source",
    "meta",
)
_STEP_COLUMNS = (
    "traj_id",
    "step_idx",
    "role",
    "turn",
    "token_ids",
    "tool_calls",
    "tool_call_id",
    "is_error",
    "content",
    "token_offsets",
    "verifier_score",
    "values",
    "logprob_source",
    "logprobs",
)


class StepRecordError(ValueError):
    """A row's step record that cannot be used (one line)."""


def encode(trajectories: pa.Table, steps: pa.Table, traj_order) -> np.ndarray:
    """(B,) UTF-8 JSON bytes, one per trajectory of `traj_order` (the export's row order)."""
    import pyarrow.compute as pc

    srt = steps.sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    n_tok = pc.list_value_length(srt.column("token_ids")).to_numpy(zero_copy_only=False)
    has_lp = srt.column("logprobs").is_valid().to_numpy(zero_copy_only=False)
    own_lp = has_lp & (pc.not_equal(srt.column("role"), "assistant").to_numpy(zero_copy_only=False))
    cols = [c for c in _STEP_COLUMNS if c in srt.column_names and c not in ("token_ids", "logprobs")]
    by_traj: dict[str, list[dict]] = {}
    lp_col = srt.column("logprobs")
    for k, s in enumerate(
        srt.select(cols).to_pylist()
    ):  # one dict per step (the token ids stay in the arrays)
        rec = {
            "role": s["role"],
            "turn": s["turn"],
            "n": int(n_tok[k]),
            "is_error": bool(s["is_error"]),
            "tool_call_id": s["tool_call_id"],
            "tool_calls": s.get("tool_calls"),
            "content": s["content"],
            "offsets": s["token_offsets"],
            "verifier_score": s.get("verifier_score"),
            "values": s.get("values"),
            "logprob_source": s.get("logprob_source"),
            "has_logprobs": bool(has_lp[k]),
        }
        if own_lp[k]:  # a non-assistant step's logprobs: not in the arrays (they hold the trained tokens')
            rec["logprobs"] = lp_col[k].as_py()
        by_traj.setdefault(s["traj_id"], []).append(rec)
    meta_of = {
        t["traj_id"]: {k: t.get(k) for k in _TRAJ_FIELDS}
        for t in trajectories.select(
            [c for c in ("traj_id", *_TRAJ_FIELDS) if c in trajectories.column_names]
        ).to_pylist()
    }
    texts = [
        json.dumps(
            {"v": VERSION, "trajectory": meta_of.get(str(t), {}), "steps": by_traj.get(str(t), [])},
            ensure_ascii=False,
            allow_nan=True,
        ).encode("utf-8")
        for t in traj_order
    ]
    return np.asarray(texts, dtype=np.bytes_) if texts else np.zeros(0, dtype="S1")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise StepRecordError(what)


def _int_or_none(v: Any, what: str) -> int | None:
    _need(v is None or (isinstance(v, int) and not isinstance(v, bool)), f"{what} is not an integer")
    return v


def _floats(v: Any, n: int, what: str) -> list[float] | None:
    if v is None:
        return None
    _need(isinstance(v, list) and len(v) == n, f"{what} is not a list of {n} numbers")
    _need(
        all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v), f"{what} holds a non-number"
    )
    return [float(x) for x in v]


def decode(raw: Any, n_tokens: int, trained: np.ndarray) -> tuple[dict, list[dict]]:
    """One row's record -> (trajectory fields, step dicts: role, turn, n, ...), checked against the row's
    `n_tokens` real tokens and their trained flags (`trained`: bool per real token, in order)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, np.bytes_)) else str(raw)
        rec = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StepRecordError(f"not JSON ({type(exc).__name__})") from None
    _need(isinstance(rec, dict) and rec.get("v") == VERSION, f"not a version-{VERSION} step record")
    traj, steps = rec.get("trajectory"), rec.get("steps")
    _need(isinstance(traj, dict) and isinstance(steps, list), "no trajectory / steps")
    out = [_step(s, f"steps[{k}]") for k, s in enumerate(steps)]
    total = sum(s["n"] for s in out)
    _need(total >= n_tokens, f"its steps hold {total} tokens, the row more ({n_tokens})")
    cut = None
    if total > n_tokens:  # the export cut the response (verl's response_length): the steps up to the cut
        out, cut = _cut(out, n_tokens), (n_tokens, total)
    want = np.repeat([s["role"] == "assistant" for s in out], [s["n"] for s in out]).astype(bool)
    _need(
        np.array_equal(want, np.asarray(trained, dtype=bool)),
        "its assistant steps are not the row's response_mask",
    )
    fields = {**_trajectory_fields(traj), "cut": cut}
    return fields, out


def _step(s: Any, w: str) -> dict:
    """One step of a record, checked (`w` names it in the error: `steps[k]`), as the step dict decode returns."""
    _need(isinstance(s, dict), f"{w} is not an object")
    _need(s.get("role") in ROLES, f"{w}.role is not one of {sorted(ROLES)}")
    n = s.get("n")
    _need(isinstance(n, int) and not isinstance(n, bool) and n >= 0, f"{w}.n is not a token count")
    _int_or_none(s.get("turn"), f"{w}.turn")
    _need(isinstance(s.get("content"), str), f"{w}.content is not text")
    _need(isinstance(s.get("is_error"), bool), f"{w}.is_error is not a boolean")
    _need(s.get("tool_call_id") is None or isinstance(s["tool_call_id"], str), f"{w}.tool_call_id")
    calls = s.get("tool_calls")
    _need(
        calls is None
        or (
            isinstance(calls, list)
            and all(
                isinstance(c, dict) and all(c.get(f) is None or isinstance(c.get(f), str) for f in c)
                for c in calls
            )
        ),
        f"{w}.tool_calls is not a list of {{id, name, arguments}} texts",
    )
    offsets = s.get("offsets")
    _need(
        isinstance(offsets, list)
        and len(offsets) == n
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets),
        f"{w}.offsets is not a list of {n} integers",
    )
    score = s.get("verifier_score")
    _need(score is None or (isinstance(score, (int, float)) and not isinstance(score, bool)), f"{w}.score")
    _need(s.get("logprob_source") is None or isinstance(s["logprob_source"], str), f"{w}.logprob_source")
    _need(isinstance(s.get("has_logprobs", False), bool), f"{w}.has_logprobs is not a boolean")
    return {
        "role": s["role"],
        "turn": s.get("turn"),
        "n": n,
        "content": s["content"],
        "is_error": s["is_error"],
        "tool_call_id": s.get("tool_call_id"),
        "tool_calls": [
            {"id": c.get("id"), "name": c.get("name"), "arguments": c.get("arguments")} for c in calls
        ]
        if calls is not None
        else None,
        "offsets": offsets,
        "verifier_score": None if score is None else float(score),
        "values": _floats(s.get("values"), n, f"{w}.values"),
        "logprob_source": s.get("logprob_source"),
        "logprobs": _floats(s.get("logprobs"), n, f"{w}.logprobs"),
        "has_logprobs": bool(s.get("has_logprobs", False)),
    }


def _trajectory_fields(traj: dict) -> dict:
    """The record's trajectory fields, checked (reward finite or none; text fields text or none)."""
    reward = traj.get("reward")
    _need(reward is None or isinstance(reward, (int, float)) and not isinstance(reward, bool), "reward")
    _need(reward is None or math.isfinite(reward), "reward is not finite")
    return {
        "sample_idx": _int_or_none(traj.get("sample_idx"), "sample_idx"),
        "reward": None if reward is None else float(reward),
        "policy_version": traj.get("policy_version") if isinstance(traj.get("policy_version"), str) else None,
        "action_format": traj.get("action_format") if isinstance(traj.get("action_format"), str) else None,
        "source": traj.get("source") if isinstance(traj.get("source"), str) else None,
        "meta": traj.get("meta") if isinstance(traj.get("meta"), str) else None,
        "reward_components": _components(traj.get("reward_components")),
    }


def _cut(steps: list[dict], n_tokens: int) -> list[dict]:
    """The steps holding the first `n_tokens` tokens: the one the cut falls in shortened (its offsets, values
    and logprobs with it), the ones after it left out."""
    out, left = [], n_tokens
    for s in steps:
        if left <= 0 and s["n"]:
            break
        keep = min(s["n"], left)
        if keep < s["n"]:
            s = {
                **s,
                "n": keep,
                "offsets": s["offsets"][:keep],
                "values": None if s["values"] is None else s["values"][:keep],
                "logprobs": None if s["logprobs"] is None else s["logprobs"][:keep],
            }
        out.append(s)
        left -= keep
    return out


def _components(v: Any) -> list[tuple[str, float]] | None:
    """reward_components as the lake's map (a list of [name, value] pairs, or of {key, value} objects)."""
    if v is None:
        return None
    _need(isinstance(v, list), "reward_components is not a list")
    out: list[tuple[str, float]] = []
    for item in v:
        pair = (item.get("key"), item.get("value")) if isinstance(item, dict) else item
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2
        name, value = (pair[0], pair[1]) if ok else (None, None)
        if not (isinstance(name, str) and isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise StepRecordError("reward_components holds something other than (name, number)")
        out.append((name, float(value)))
    return out
