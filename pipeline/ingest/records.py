"""What adapters build and share: the quarantine reason codes, a file's records (`SourceRecord`), the drafts an
adapter returns (`TrajectoryDraft`, `StepDraft`), `Reject` (a record that goes to quarantine, with its reason,
detail and field), `Unreadable` (a file that could not be read at all), the result of an ingest
(`IngestResult`), and the small helpers every adapter uses to read fields."""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from schemas import steps as steps_schema

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
SURROGATE = re.compile("[\ud800-\udfff]")


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
