"""The adapter-independent half of ingest: source records -> drafts -> checked, tokenized Arrow tables.

This module is the driver (`ingest`): it reads each file with its adapter's reader (`pipeline.ingest.readers`),
converts and checks every record (`pipeline.ingest.checks`) and builds the tables (`pipeline.ingest.tables`);
the types adapters build are in `pipeline.ingest.records`. Their public names are importable from here too.

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

import json
from collections import Counter
from typing import Any

import pyarrow as pa

from pipeline.ingest.checks import (
    all_instances,
    bad_logprobs,
    bad_token_ids,
    checked_ids,
    checked_ids_text,
    finalize,
    logprob_problem,
    token_id_problem,
    token_rejects,
)
from pipeline.ingest.readers import (
    TOO_DEEP,
    iter_json_array,
    iter_json_object,
    read_json_entries,
    read_json_list,
    read_jsonl,
    skip_json_value,
)
from pipeline.ingest.records import (
    ADAPTER_ERROR,
    DUPLICATE_TRAJ_ID,
    GENERIC_STEMS,
    INVALID_TOKENS,
    INVALID_UTF8,
    INVALID_VALUE,
    LENGTH_MISMATCH,
    LOGPROB_TOLERANCE,
    MALFORMED_JSON,
    MISSING_FIELD,
    NON_FINITE_REWARD,
    ROLES,
    SCHEMA_VIOLATION,
    SURROGATE,
    TOKEN_ID_LIMIT,
    UNKNOWN_ROLE,
    UNMATCHED_TOOL_RESULT,
    UNREADABLE_FILE,
    IngestResult,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    Unreadable,
    arguments_text,
    as_int,
    as_reward,
    content_text,
    prompt_hash,
    require,
)
from pipeline.ingest.registry import get_adapter
from pipeline.ingest.tables import (
    Rejected,
    _assign_sample_idx,
    build_tables,
    offsets_by_decoding,
    printable,
    quarantine_table,
    quarantine_token_rejects,
    validate_or_quarantine,
    vocab_of,
)
from pipeline.tokenize import ByteTokenizer
from schemas import steps as steps_schema
from schemas import trajectories as trajectories_schema

__all__ = [  # the driver, and the names adapters and callers have imported from here
    "ADAPTER_ERROR",
    "DUPLICATE_TRAJ_ID",
    "GENERIC_STEMS",
    "INVALID_TOKENS",
    "INVALID_UTF8",
    "INVALID_VALUE",
    "LENGTH_MISMATCH",
    "LOGPROB_TOLERANCE",
    "MALFORMED_JSON",
    "MISSING_FIELD",
    "NON_FINITE_REWARD",
    "ROLES",
    "SCHEMA_VIOLATION",
    "SURROGATE",
    "TOKEN_ID_LIMIT",
    "TOO_DEEP",
    "UNKNOWN_ROLE",
    "UNMATCHED_TOOL_RESULT",
    "UNREADABLE_FILE",
    "IngestResult",
    "Reject",
    "Rejected",
    "SourceRecord",
    "StepDraft",
    "TrajectoryDraft",
    "Unreadable",
    "all_instances",
    "arguments_text",
    "as_int",
    "as_reward",
    "bad_logprobs",
    "bad_token_ids",
    "build_tables",
    "checked_ids",
    "checked_ids_text",
    "content_text",
    "finalize",
    "ingest",
    "ingest_records",
    "iter_json_array",
    "iter_json_object",
    "logprob_problem",
    "offsets_by_decoding",
    "printable",
    "prompt_hash",
    "quarantine_table",
    "quarantine_token_rejects",
    "read_json_entries",
    "read_json_list",
    "read_jsonl",
    "read_records",
    "require",
    "skip_json_value",
    "token_id_problem",
    "token_rejects",
    "validate_or_quarantine",
    "vocab_of",
]


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
            if record.error is None and SURROGATE.search(record.raw):
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
