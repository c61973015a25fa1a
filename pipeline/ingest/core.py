"""The adapter-independent half of ingest: source records -> drafts -> checked, tokenized Arrow tables.

An adapter only turns one parsed record into a `TrajectoryDraft` (plain Python, no tokens). Everything every
format needs is done here, once: turn numbering, the tool-call links, reward and length checks, duplicate
ids, default sample indices, one batched tokenizer call over every step, and the final schema validation.
A record that fails any check goes to `quarantine` verbatim with its reason, field and location; the rest is
ingested.

Token ids given by the source are kept as they are (they are what the policy sampled). Their char offsets:
1. if the tokenizer, run on the content, gives the same ids: its offsets (exact);
2. else if the tokenizer can decode and the ids decode to the content: offsets from decoding token by token;
3. else offsets spread evenly over the content (monotone, approximate), counted in
   `stats["offsets_approximate"]`.
Logprobs given by the source are kept with `logprob_source = "rollout"`; without token ids they must match
the tokenizer's token count, or the record is quarantined.

Token data cannot lie (`invalid_tokens`, the field named): token ids are integers in [0, vocab size) when the
tokenizer knows its vocabulary (`tokenizer.vocab_size`), else in [0, 2^31); logprobs are finite and
<= `LOGPROB_TOLERANCE`; token offsets lie inside the content; lengths agree (token_ids, token_offsets,
logprobs, values). Nothing is cast silently: an id that does not fit int32 is quarantined, not wrapped.
A record with bytes that are not UTF-8 (`invalid_utf8`), nested too deep to parse, or that makes an adapter
raise is quarantined on its own; a file that cannot be read at all (`Unreadable`) is one quarantine row.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.chat_template import tokenize_steps
from schemas import SchemaError
from schemas import quarantine as quarantine_schema
from schemas import steps as steps_schema
from schemas import trajectories as trajectories_schema

ROLES = steps_schema.ROLES

# quarantine reason codes (the text after the colon says what exactly)
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_field"
INVALID_VALUE = "invalid_value"
LENGTH_MISMATCH = "length_mismatch"
NON_FINITE_REWARD = "non_finite_reward"
DUPLICATE_TRAJ_ID = "duplicate_traj_id"
UNKNOWN_ROLE = "unknown_role"
UNMATCHED_TOOL_RESULT = "unmatched_tool_result"
SCHEMA_VIOLATION = "schema_violation"
ADAPTER_ERROR = "adapter_error"  # the adapter raised on this record: a shape it does not handle
INVALID_TOKENS = "invalid_tokens"  # token ids / logprobs / offsets that cannot be what a policy sampled
INVALID_UTF8 = "invalid_utf8"  # bytes that are not UTF-8 (or lone surrogates) in the record's text
UNREADABLE_FILE = "unreadable_file"  # a source file that could not be read or parsed at all

# file stems that say nothing of the run inside (the folders do): `SourceRecord.run`
GENERIC_STEMS = frozenset(
    {"results", "result", "output", "outputs", "trajs", "trajectories", "data", "rollouts"}
)
TOKEN_ID_LIMIT = 2**31  # ids are stored as int32: every id must be < 2^31 (and < the vocabulary size)
LOGPROB_TOLERANCE = 1e-4  # a logprob above this is not a log probability (rounding may give tiny positives)
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Unreadable:
    """What a reader puts in place of a source file it could not read (corrupt Parquet, bad .npz, ...):
    `ingest` turns it into one quarantine row and goes on with the other files."""

    reason: str


class Reject(Exception):
    """A record cannot be ingested: it goes to quarantine with this reason code, detail and field."""

    def __init__(self, code: str, detail: str = "", field: str | None = None):
        self.code, self.detail, self.field = code, detail, field
        super().__init__(f"{code}: {detail}" if detail else code)

    @property
    def reason(self) -> str:
        return str(self)


@dataclass
class SourceRecord:
    """One input record: parsed data (None when it could not be parsed), its verbatim text and location."""

    source_file: str
    location: str
    raw: str
    data: Any = None
    error: Reject | None = None
    context: dict = field(default_factory=dict)

    @property
    def stem(self) -> str:
        from pathlib import PurePath

        return PurePath(self.source_file).stem

    @property
    def run(self) -> str:
        """The run the file holds, for trajectory ids: its stem, or for a stem that names no run
        (`GENERIC_STEMS`: LLMDebugger's `<dataset>/<model>/results.jsonl`) its two parent folders
        (`humaneval/codellama`), so several files of one layout ingested together keep distinct ids."""
        from pathlib import PurePath

        path = PurePath(self.source_file)
        folders = [p for p in path.parent.parts if p not in ("", ".", "/")]
        if path.stem.lower() in GENERIC_STEMS and folders:
            return "/".join(folders[-2:])
        return path.stem


@dataclass
class StepDraft:
    role: str
    content: str
    tool_calls: list[dict] | None = None  # [{id, name, arguments (JSON text)}]
    tool_call_id: str | None = None
    is_error: bool = False
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    verifier_score: float | None = None
    turn: int | None = None  # filled by `finalize`


@dataclass
class TrajectoryDraft:
    traj_id: str
    group_id: str
    reward: float
    steps: list[StepDraft]
    sample_idx: int | None = None  # None: next free index of its group, in input order
    reward_components: dict[str, float] | None = None
    action_format: str | None = None
    policy_version: str | None = None
    meta: dict | None = None
    source: str = ""


@dataclass
class IngestResult:
    trajectories: pa.Table
    steps: pa.Table
    quarantine: pa.Table
    stats: dict = field(default_factory=dict)

    def quarantined_by_reason(self) -> dict[str, int]:
        # the category (rows written before `detail` existed held "code: detail" in reason)
        codes = [r.split(":", 1)[0] for r in self.quarantine.column("reason").to_pylist()]
        return dict(Counter(codes).most_common())


# ---- small helpers adapters share ----------------------------------------------------------------------


def require(obj: Any, key: str, where: str = "") -> Any:
    """`obj[key]`, or Reject(missing_field) naming `where.key`."""
    name = f"{where}.{key}" if where else key
    if not isinstance(obj, dict):
        raise Reject(
            INVALID_VALUE, f"{where or 'record'} is {type(obj).__name__}, expected an object", where or None
        )
    if key not in obj or obj[key] is None:
        raise Reject(MISSING_FIELD, f"'{name}' is missing", name)
    return obj[key]


def as_reward(value: Any, field_name: str = "reward") -> float:
    if isinstance(value, bool):
        return float(value)
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise Reject(INVALID_VALUE, f"{field_name} {value!r} is not a number", field_name) from None
    if not math.isfinite(reward):
        raise Reject(NON_FINITE_REWARD, f"{field_name} is {reward}", field_name)
    return reward


def as_int(value: Any, field_name: str) -> int:
    if isinstance(value, bool) or value is None:
        raise Reject(INVALID_VALUE, f"{field_name} {value!r} is not an integer", field_name)
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise Reject(INVALID_VALUE, f"{field_name} {value!r} is not an integer", field_name) from None
    if out != value and str(out) != str(value):
        raise Reject(INVALID_VALUE, f"{field_name} {value!r} is not an integer", field_name)
    return out


def arguments_text(arguments: Any) -> str:
    """Call arguments as JSON text (sources give a JSON string or an object)."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def content_text(content: Any, where: str) -> str:
    """OpenAI message content: a string, null, or a list of parts ({type: text, text})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise Reject(INVALID_VALUE, f"{where} has a non-text content part", where)
        return "".join(parts)
    raise Reject(INVALID_VALUE, f"{where} is {type(content).__name__}, expected text", where)


def prompt_hash(texts: list[str]) -> str:
    return "p" + hashlib.sha1("\x1e".join(texts).encode("utf-8")).hexdigest()[:16]


# ---- readers: file text -> verbatim records ------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


TOO_DEEP = object()  # stands for a JSON value nested too deep to decode (`iter_json_object`)
_JSON_SYNTAX = re.compile(r'["\\\[\]{}]')


def skip_json_value(text: str, pos: int) -> int:
    """End of the JSON array/object starting at `pos`, by matching brackets outside strings (for a value too
    deep for the decoder: it is skipped, not parsed). ValueError when it does not end."""
    depth, in_string, i = 0, False, pos
    while True:
        m = _JSON_SYNTAX.search(text, i)
        if m is None:
            raise ValueError(f"unterminated JSON value at char {pos}")
        c, i = m.group(), m.end()
        if in_string:
            if c == "\\":
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i


def _malformed(source_file: str, location: str, raw: str, exc: Exception) -> SourceRecord:
    detail = "nested too deep to parse" if isinstance(exc, RecursionError) else str(exc)
    return SourceRecord(source_file, location, raw, error=Reject(MALFORMED_JSON, detail))


def read_jsonl(text: str, source_file: str) -> Iterator[SourceRecord]:
    """One record per non-blank line (location `line N`, 1-based)."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        location = f"line {lineno}"
        try:
            data = json.loads(line)
        except (ValueError, RecursionError) as exc:
            yield _malformed(source_file, location, line, exc)
            continue
        yield SourceRecord(source_file, location, line, data)


def iter_json_array(
    text: str, pos: int, source_file: str, path: str = ""
) -> Iterator[tuple[SourceRecord, int]]:
    """Items of the JSON array starting at `pos`, each with its verbatim text; yields (record, end)."""
    pos = _skip_ws(text, pos)
    if pos >= len(text) or text[pos] != "[":
        yield _malformed(source_file, path or "$", text[pos:], ValueError("expected a JSON array")), len(text)
        return
    pos = _skip_ws(text, pos + 1)
    index = 0
    if pos < len(text) and text[pos] == "]":
        yield from _after_array(text, pos + 1, source_file, path)
        return
    while pos < len(text):
        location = f"{path}[{index}]"
        try:
            data, end = _DECODER.raw_decode(text, pos)
        except RecursionError as exc:  # this record only: its end is found by its brackets
            try:
                end = skip_json_value(text, pos)
            except ValueError:
                yield _malformed(source_file, f"{path}[{index}:]", text[pos:], exc), len(text)
                return
            data = TOO_DEEP
        except ValueError as exc:
            # the rest of the array cannot be split reliably: quarantine it as one record
            yield _malformed(source_file, f"{path}[{index}:]", text[pos:], exc), len(text)
            return
        if data is TOO_DEEP:
            yield _malformed(source_file, location, text[pos:end], RecursionError()), end
        else:
            yield SourceRecord(source_file, location, text[pos:end], data), end
        pos = _skip_ws(text, end)
        index += 1
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            yield from _after_array(text, pos + 1, source_file, path)
            return
        yield (
            _malformed(source_file, f"{path}[{index}:]", text[pos:], ValueError("expected ',' or ']'")),
            len(text),
        )
        return
    # the text ended inside the array (a truncated file): what is missing is one quarantined record
    yield (
        _malformed(source_file, f"{path}[{index}:]", "", ValueError("the array is not closed (no ']')")),
        len(text),
    )


def _after_array(text: str, end: int, source_file: str, path: str) -> Iterator[tuple[SourceRecord, int]]:
    """Text after the array's closing bracket (a damaged file): one quarantined record, not silence."""
    rest = _skip_ws(text, end)
    if rest < len(text):
        yield (
            _malformed(source_file, f"{path or '$'}+", text[rest:], ValueError("text after the array")),
            len(text),
        )


def iter_json_object(text: str, pos: int) -> Iterator[tuple[str, Any, int, int]]:
    """Members of the JSON object at `pos`: (key, value, value start, value end). Raises ValueError when
    malformed."""
    pos = _skip_ws(text, pos)
    if pos >= len(text) or text[pos] != "{":
        raise ValueError(f"expected a JSON object at char {pos}")
    pos = _skip_ws(text, pos + 1)
    if pos < len(text) and text[pos] == "}":
        _after_object(text, pos + 1)
        return
    while True:
        key, pos = _DECODER.raw_decode(text, pos)
        if not isinstance(key, str):
            raise ValueError(f"expected a key at char {pos}")
        pos = _skip_ws(text, pos)
        if pos >= len(text) or text[pos] != ":":
            raise ValueError(f"expected ':' at char {pos}")
        start = _skip_ws(text, pos + 1)
        try:
            value, end = _DECODER.raw_decode(text, start)
        except RecursionError:
            value, end = TOO_DEEP, skip_json_value(text, start)
        yield key, value, start, end
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "}":
            _after_object(text, pos + 1)
            return
        raise ValueError(f"expected ',' or '}}' at char {pos}")


def _after_object(text: str, end: int) -> None:
    if _skip_ws(text, end) < len(text):
        raise ValueError(f"text after the object at char {end}")


def read_json_list(text: str, source_file: str) -> Iterator[SourceRecord]:
    """A JSON array of records (location `[i]`)."""
    for record, _ in iter_json_array(text, 0, source_file):
        yield record


def read_json_entries(text: str, source_file: str) -> Iterator[SourceRecord]:
    """A JSON object id -> record (location `[id]`); the id is put in `context['key']`."""
    pos = 0
    members = iter_json_object(text, 0)
    while True:
        try:
            key, value, start, end = next(members)
        except StopIteration:
            return
        except (ValueError, RecursionError) as exc:
            yield _malformed(source_file, "$[...]", text[pos:], exc)
            return
        pos = end
        location = f"[{json.dumps(key)}]"
        if value is TOO_DEEP:
            yield _malformed(source_file, location, text[start:end], RecursionError())
            continue
        yield SourceRecord(source_file, location, text[start:end], value, context={"key": key})


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
    return isinstance(value, str) and _SURROGATE.search(value) is not None


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


# ---- offsets of given token ids ------------------------------------------------------------------------


def _even_offsets(n_tokens: int, n_chars: int) -> list[int]:
    if n_tokens == 0:
        return []
    return (np.arange(n_tokens, dtype=np.int64) * n_chars // n_tokens).astype(np.int32).tolist()


def offsets_by_decoding(decode, ids: list[int], content: str) -> list[int] | None:
    """Char start of each token found by decoding token by token (tokens inside one char share its start).
    None when the ids do not decode to `content`."""
    if decode(ids) != content:
        return None
    offsets: list[int] = []
    done, pending = 0, 0  # chars confirmed; first token whose text is not yet confirmed
    for k in range(len(ids)):
        piece = decode(ids[pending : k + 1])
        if piece.endswith("\ufffd") and k + 1 < len(ids):
            continue  # an incomplete UTF-8 char: wait for the next token
        if content[done : done + len(piece)] != piece:
            return None
        offsets.append(done)
        for j in range(pending + 1, k + 1):  # tokens that start inside the window: after its complete chars
            offsets.append(done + len(decode(ids[pending:j]).rstrip("\ufffd")))
        done += len(piece)
        pending = k + 1
    return offsets if done == len(content) else None


# ---- building the tables -------------------------------------------------------------------------------


@dataclass
class Rejected:
    record: SourceRecord
    reject: Reject
    record_id: str | None = None


def printable(text: str | None) -> str | None:
    """`text` as valid UTF-8: bytes that were not UTF-8 (read with `surrogateescape`) and lone surrogates
    become backslash escapes, so a quarantine row can hold any record verbatim."""
    if text is None or _SURROGATE.search(text) is None:
        return text
    try:
        data = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        data = text.encode("utf-8", "backslashreplace")
    return data.decode("utf-8", "backslashreplace")


def quarantine_table(rejected: list[Rejected], round_: int, stage: str) -> pa.Table:
    rows = {
        "round": [round_] * len(rejected),
        "source_file": [printable(r.record.source_file) for r in rejected],
        "location": [printable(r.record.location) for r in rejected],
        "record_id": [printable(r.record_id) for r in rejected],
        "field": [printable(r.reject.field) for r in rejected],
        "reason": [r.reject.code for r in rejected],
        "detail": [printable(r.reject.detail) or None for r in rejected],
        "raw": [printable(r.record.raw) for r in rejected],
        "stage": [f"ingest:{stage}"] * len(rejected),
    }
    return pa.Table.from_pydict(rows, schema=quarantine_schema.SCHEMA)


def _assign_sample_idx(drafts: list[TrajectoryDraft]) -> None:
    """Unique sample indices within each group: a given index is kept where it is the first in its group
    (input order); a repeat (several sources' runs of one task, each with its own trial 0) and a missing
    index take the group's next free index. The source's own trial stays in `meta`."""
    used: dict[str, set[int]] = {}
    for d in drafts:
        if d.sample_idx is not None:
            taken = used.setdefault(d.group_id, set())
            if d.sample_idx in taken:
                d.sample_idx = None
            else:
                taken.add(d.sample_idx)
    for d in drafts:
        if d.sample_idx is None:
            taken = used.setdefault(d.group_id, set())
            nxt = 0
            while nxt in taken:
                nxt += 1
            d.sample_idx = nxt
            taken.add(nxt)


def _with_tokenization(meta, made: str) -> dict:
    """The trajectory's meta with how its tokens were made (`pipeline.chat_template`: source ids | chat
    template <name> | plain)."""
    base = meta if isinstance(meta, dict) else ({} if meta is None else {"meta": meta})
    return {**base, "tokenization": made}


def _tokenize_seen_steps(drafts: list[TrajectoryDraft], tokenizer):
    """`tokenize_steps` over what the agent saw: steps of an unseen role (`steps_schema.UNSEEN_ROLES`) are left
    out of the rendering and get no tokens (empty ids and offsets, in their place)."""
    import dataclasses

    unseen = [[s.role in steps_schema.UNSEEN_ROLES for s in d.steps] for d in drafts]
    if not any(any(u) for u in unseen):
        return tokenize_steps(drafts, tokenizer)
    seen = [
        dataclasses.replace(d, steps=[s for s, u in zip(d.steps, us, strict=True) if not u])
        for d, us in zip(drafts, unseen, strict=True)
    ]
    ids, offs, made = tokenize_steps(seen, tokenizer)
    out_ids: list[list[int]] = []
    out_offs: list[list[int]] = []
    k = 0
    for us in unseen:
        for u in us:
            if u:
                out_ids.append([])
                out_offs.append([])
            else:
                out_ids.append(ids[k])
                out_offs.append(offs[k])
                k += 1
    return out_ids, out_offs, made


def build_tables(
    items: list[tuple[SourceRecord, TrajectoryDraft]], round_: int, tokenizer
) -> tuple[pa.Table, pa.Table, list[Rejected], dict]:
    """Tokenize every step in one batch and build the trajectories and steps tables."""
    stats: Counter = Counter()
    flat = [(i, s) for i, (_, d) in enumerate(items) for s in d.steps]
    # text sources rendered with the tokenizer's chat template, cut back into messages (pipeline.chat_template);
    # `made`: how each trajectory's tokens were made, kept in its meta as "tokenization"
    enc_ids, enc_offsets, made = _tokenize_seen_steps([d for _, d in items], tokenizer)
    stats.update(Counter(f"tokens {m.split(' (')[0]}" for m in made))
    decode = getattr(tokenizer, "decode", None)

    rejected: dict[int, Reject] = {}
    token_ids: list[list[int]] = []
    token_offsets: list[list[int]] = []
    logprobs: list[list[float] | None] = []
    for (item, step), ids, offs in zip(flat, enc_ids, enc_offsets, strict=True):
        lp = step.logprobs
        if step.token_ids is None:
            if lp is not None and len(lp) != len(ids):
                rejected.setdefault(
                    item,
                    Reject(
                        LENGTH_MISMATCH,
                        f"{len(lp)} logprobs without token_ids, but the content has {len(ids)} tokens "
                        f"({getattr(tokenizer, 'name', 'tokenizer')})",
                        "logprobs",
                    ),
                )
            token_ids.append(list(ids))
            token_offsets.append(list(offs))
        else:
            given = list(step.token_ids)
            stats["steps_with_given_token_ids"] += 1
            decoded = None
            if list(ids) != given and decode:
                decoded = offsets_by_decoding(decode, given, step.content)
            if list(ids) == given:
                found = list(offs)
            elif decoded is not None:
                found = decoded
            else:
                stats["offsets_approximate"] += 1
                found = _even_offsets(len(given), len(step.content))
            token_ids.append(given)
            token_offsets.append(found)
        logprobs.append([float(x) for x in lp] if lp is not None else None)

    keep = [i for i in range(len(items)) if i not in rejected]
    bad = [Rejected(items[i][0], rejected[i], items[i][1].traj_id) for i in sorted(rejected)]
    keep_set = set(keep)

    traj_rows: dict[str, list] = {k: [] for k in trajectories_schema.SCHEMA.names}
    for i in keep:
        d = items[i][1]
        traj_rows["round"].append(round_)
        traj_rows["traj_id"].append(d.traj_id)
        traj_rows["group_id"].append(d.group_id)
        traj_rows["sample_idx"].append(d.sample_idx)
        traj_rows["reward"].append(d.reward)
        traj_rows["reward_components"].append(
            list(d.reward_components.items()) if d.reward_components else None
        )
        traj_rows["source"].append(d.source)
        traj_rows["action_format"].append(d.action_format)
        traj_rows["policy_version"].append(d.policy_version)
        traj_rows["meta"].append(
            json.dumps(_with_tokenization(d.meta, made[i]), ensure_ascii=False, default=str)
        )
    trajectories = pa.Table.from_pydict(traj_rows, schema=trajectories_schema.SCHEMA)

    step_rows: dict[str, list] = {k: [] for k in steps_schema.SCHEMA.names}
    step_idx_of: dict[int, int] = {}
    for (item, step), ids, offs, lp in zip(flat, token_ids, token_offsets, logprobs, strict=True):
        if item not in keep_set:
            continue
        idx = step_idx_of.get(item, 0)
        step_idx_of[item] = idx + 1
        step_rows["round"].append(round_)
        step_rows["traj_id"].append(items[item][1].traj_id)
        step_rows["step_idx"].append(idx)
        step_rows["role"].append(step.role)
        step_rows["turn"].append(step.turn)
        step_rows["content"].append(step.content)
        step_rows["tool_calls"].append(
            [{"id": c["id"], "name": c["name"], "arguments": c.get("arguments")} for c in step.tool_calls]
            if step.tool_calls is not None
            else None
        )
        step_rows["tool_call_id"].append(step.tool_call_id)
        step_rows["is_error"].append(bool(step.is_error))
        step_rows["token_ids"].append(ids)
        step_rows["token_offsets"].append(offs)
        step_rows["logprobs"].append(lp)
        step_rows["logprob_source"].append("rollout" if lp is not None else None)
        step_rows["values"].append(None)
        step_rows["verifier_score"].append(step.verifier_score)
    steps = pa.Table.from_pydict(step_rows, schema=steps_schema.SCHEMA)
    stats["tokens"] = int(sum(len(x) for x in token_ids))
    return trajectories, steps, bad, dict(stats)


def vocab_of(tokenizer) -> tuple[int | None, str]:
    """The tokenizer's vocabulary size when it knows one (`vocab_size`), and a note naming it."""
    size = getattr(tokenizer, "vocab_size", None)
    if not isinstance(size, int) or size <= 0:
        return None, ""
    return size, f" of tokenizer {getattr(tokenizer, 'name', '?')} (pass --tokenizer: the policy's own)"


def quarantine_token_rejects(
    trajectories: pa.Table, steps: pa.Table, items_by_id: dict[str, SourceRecord], tokenizer
) -> tuple[pa.Table, pa.Table, list[Rejected]]:
    """Quarantine every trajectory with a step whose token data lie (`token_rejects`), first step first."""
    import pyarrow.compute as pc

    found = token_rejects(steps, *vocab_of(tokenizer))
    if not found:
        return trajectories, steps, []
    traj_col = steps.column("traj_id")
    first: dict[str, Reject] = {}
    for row in sorted(found):
        first.setdefault(traj_col[row].as_py(), found[row])
    bad = [Rejected(items_by_id[t], rej, t) for t, rej in first.items()]
    drop = pa.array(list(first), pa.string())
    trajectories = trajectories.filter(pc.invert(pc.is_in(trajectories.column("traj_id"), value_set=drop)))
    steps = steps.filter(pc.invert(pc.is_in(traj_col, value_set=drop)))
    return trajectories, steps, bad


def validate_or_quarantine(
    trajectories: pa.Table, steps: pa.Table, items_by_id: dict[str, SourceRecord]
) -> tuple[pa.Table, pa.Table, list[Rejected]]:
    """Schema validation as a last safety net: a trajectory whose rows violate a schema is quarantined."""
    import pyarrow.compute as pc

    bad: list[Rejected] = []
    for _ in range(len(items_by_id) + 1):
        try:
            trajectories = trajectories_schema.validate(trajectories)
            steps = steps_schema.validate(steps)
            return trajectories, steps, bad
        except SchemaError as err:
            table = trajectories if err.table == "trajectories" else steps
            if err.row is None or not table.num_rows:
                raise
            traj_id = table.column("traj_id")[err.row].as_py()
            record = items_by_id.get(traj_id)
            if record is None:
                raise
            bad.append(Rejected(record, Reject(SCHEMA_VIOLATION, str(err), err.field), traj_id))
            trajectories = trajectories.filter(pc.not_equal(trajectories.column("traj_id"), traj_id))
            steps = steps.filter(pc.not_equal(steps.column("traj_id"), traj_id))
    raise RuntimeError("schema validation did not converge")


def ingest_records(records: list[SourceRecord], spec, round_: int, tokenizer) -> IngestResult:
    """Convert, check and tokenize the records of one or more files of one format."""
    rejected: list[Rejected] = []
    items: list[tuple[SourceRecord, TrajectoryDraft]] = []
    seen: dict[str, str] = {}  # traj_id -> the file it was first read from
    for record in records:
        if record.error is not None:
            rejected.append(Rejected(record, record.error))
            continue
        try:
            draft = spec.convert(record)
            draft.action_format = draft.action_format or spec.action_format
            draft.source = draft.source or f"{spec.name}:{record.source_file}"
            finalize(draft)
        except Reject as rej:
            rejected.append(Rejected(record, rej, _record_id(record)))
            continue
        except Exception as exc:  # noqa: BLE001 -- one odd record must not stop the ingest; it is kept
            odd = (
                Reject(INVALID_UTF8, "a text of the record is not valid Unicode (a lone surrogate)")
                if isinstance(exc, UnicodeError)
                else Reject(ADAPTER_ERROR, f"{type(exc).__name__}: {exc}")
            )
            rejected.append(Rejected(record, odd, _record_id(record)))
            continue
        if draft.traj_id in seen:
            first = seen[draft.traj_id]
            where = "" if first == record.source_file else f" from {first}"
            rejected.append(
                Rejected(
                    record,
                    Reject(
                        DUPLICATE_TRAJ_ID, f"traj_id {draft.traj_id!r} was already read{where}", "traj_id"
                    ),
                    draft.traj_id,
                )
            )
            continue
        seen[draft.traj_id] = record.source_file
        items.append((record, draft))
    _assign_sample_idx([d for _, d in items])
    trajectories, steps, bad, stats = build_tables(items, round_, tokenizer)
    rejected += bad
    items_by_id = {d.traj_id: r for r, d in items}
    trajectories, steps, bad = quarantine_token_rejects(trajectories, steps, items_by_id, tokenizer)
    rejected += bad
    trajectories, steps, more = validate_or_quarantine(trajectories, steps, items_by_id)
    rejected += more
    bad += more
    if bad:
        stats["tokens"] = int(sum(len(x) for x in steps.column("token_ids").to_pylist()))
    stats.update(records_read=len(records), tokenizer=getattr(tokenizer, "name", "?"))
    return IngestResult(trajectories, steps, quarantine_table(rejected, round_, spec.name), stats)


def _record_id(record: SourceRecord) -> str | None:
    data = record.data
    if isinstance(data, dict):
        for key in ("traj_id", "id", "task_id"):
            if data.get(key) is not None and not isinstance(data.get(key), (dict, list)):
                return str(data[key])
    return record.context.get("key")


def ingest(
    fmt: str,
    sources: list[tuple[str, Any]],
    round_: int = 0,
    tokenizer=None,
) -> IngestResult:
    """Ingest sources of format `fmt`: for text formats a list of (source_file, text); for table formats
    what the adapter's `ingest_tables` takes. `tokenizer`: loaded by the caller (`warehouse.tokenizers`);
    None: the byte tokenizer."""
    from pipeline.ingest.registry import get_adapter
    from pipeline.tokenize import ByteTokenizer

    spec = get_adapter(fmt)
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    unreadable = [
        Rejected(SourceRecord(name, "$", f"<unreadable file {name}>"), Reject(UNREADABLE_FILE, src.reason))
        for name, src in sources
        if isinstance(src, Unreadable)
    ]
    sources = [(name, src) for name, src in sources if not isinstance(src, Unreadable)]
    if spec.kind == "tables":
        result = _ingest_tables(spec, sources, round_, tokenizer)
    else:
        records: list[SourceRecord] = []
        for source_file, text in sources:
            records.extend(read_records(spec, text, source_file))
        result = ingest_records(records, spec, round_, tokenizer)
    if unreadable:
        result.quarantine = pa.concat_tables(
            [quarantine_table(unreadable, round_, spec.name), result.quarantine]
        )
        result.stats["records_read"] = result.stats.get("records_read", 0) + len(unreadable)
    return result


def read_records(spec, text: str, source_file: str) -> list[SourceRecord]:
    """The adapter's reader over one file, where no record can stop the others: a record with bytes that
    were not UTF-8 (read with `surrogateescape`) is quarantined on its own, and a reader that raises
    quarantines the rest of the file as one record."""
    records: list[SourceRecord] = []
    try:
        for record in spec.reader(text, source_file):
            if record.error is None and _SURROGATE.search(record.raw):
                record.error = Reject(INVALID_UTF8, "the record has bytes that are not UTF-8")
            records.append(record)
    except Exception as exc:  # noqa: BLE001 -- a reader bug or a shape it does not handle: keep the rest
        detail = (
            "nested too deep to parse" if isinstance(exc, RecursionError) else f"{type(exc).__name__}: {exc}"
        )
        rest = f"<the rest of {source_file} after {len(records)} record(s)>"
        records.append(
            SourceRecord(
                source_file, f"after record {len(records)}", rest, error=Reject(ADAPTER_ERROR, detail)
            )
        )
    return records


def _ingest_tables(spec, sources: list, round_: int, tokenizer) -> IngestResult:
    """A table adapter over all sources; where it raises (a shape it does not handle), over each source on
    its own, a source that still raises becoming one quarantine row, so no file stops the others."""
    try:
        return spec.ingest_tables(sources, round_, tokenizer)
    except Exception:  # noqa: BLE001 -- retried per source below, where the bad file is found
        if not sources:
            raise
    parts: list[IngestResult] = []
    for name, src in sources:
        try:
            parts.append(spec.ingest_tables([(name, src)], round_, tokenizer))
        except Exception as exc:  # noqa: BLE001 -- this file only
            detail = "nested too deep" if isinstance(exc, RecursionError) else f"{type(exc).__name__}: {exc}"
            reject = Rejected(
                SourceRecord(name, "$", f"<{spec.name} source {name}>"), Reject(ADAPTER_ERROR, detail)
            )
            parts.append(
                IngestResult(
                    trajectories_schema.SPEC.empty(),
                    steps_schema.SPEC.empty(),
                    quarantine_table([reject], round_, spec.name),
                    {"records_read": 1},
                )
            )
    return _merge_results(parts, round_, spec.name)


def _merge_results(parts: list[IngestResult], round_: int, stage: str) -> IngestResult:
    """Results of separate sources as one; a traj_id already taken by an earlier source is quarantined."""
    import pyarrow.compute as pc

    trajs, steps, quarantines, seen = [], [], [], set()
    stats: Counter = Counter()
    for part in parts:
        t, s = part.trajectories, part.steps
        ids = t.column("traj_id").to_pylist()
        dup = [x for x in ids if x in seen]
        if dup:
            rows = [
                Rejected(
                    SourceRecord(stage, f"traj_id={x}", json.dumps({"traj_id": x})),
                    Reject(
                        DUPLICATE_TRAJ_ID, f"traj_id {x!r} was already read from another source", "traj_id"
                    ),
                    x,
                )
                for x in dup
            ]
            quarantines.append(quarantine_table(rows, round_, stage))
            keep = pc.invert(pc.is_in(t.column("traj_id"), value_set=pa.array(dup, pa.string())))
            t = t.filter(keep)
            s = s.filter(pc.invert(pc.is_in(s.column("traj_id"), value_set=pa.array(dup, pa.string()))))
        seen.update(ids)
        trajs.append(t)
        steps.append(s)
        quarantines.append(part.quarantine)
        for key, value in part.stats.items():
            if isinstance(value, int) and not isinstance(value, bool):
                stats[key] += value
            else:
                stats.setdefault(key, value)
    return IngestResult(
        pa.concat_tables(trajs), pa.concat_tables(steps), pa.concat_tables(quarantines), dict(stats)
    )
