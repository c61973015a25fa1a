"""`parquet`: tables that are already canonical (`trajectories` + `steps`, e.g. written by another tool or
exported from a lake), validated with the schemas.

The round is set to the target round. Steps without token ids (the column absent or null) are tokenized with
the ingest tokenizer. A fast path validates whole tables; only when that fails is each trajectory checked on
its own, and the bad ones (with their steps) go to quarantine as JSON `{"trajectory": row, "steps": rows}`.
Steps whose trajectory row is missing are quarantined per traj_id.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.ingest.checks import token_rejects
from pipeline.ingest.records import (
    DUPLICATE_TRAJ_ID,
    INVALID_VALUE,
    LENGTH_MISMATCH,
    MISSING_FIELD,
    NON_FINITE_REWARD,
    SCHEMA_VIOLATION,
    UNKNOWN_ROLE,
    UNMATCHED_TOOL_RESULT,
    IngestResult,
    Reject,
    SourceRecord,
)
from pipeline.ingest.registry import AdapterSpec, register_adapter
from pipeline.ingest.tables import Rejected, quarantine_table, vocab_of
from schemas import SchemaError, round_column
from schemas import steps as steps_schema
from schemas import trajectories as trajectories_schema

SOURCE_COL = "__source_file"


def _reason(err: SchemaError) -> Reject:
    text = err.reason
    if "null in a required field" in text or "required column is missing" in text:
        code = MISSING_FIELD
    elif "not a finite number" in text:
        code = NON_FINITE_REWARD
    elif "duplicate key" in text:
        code = DUPLICATE_TRAJ_ID if err.table == "trajectories" else INVALID_VALUE
    elif "unknown value" in text and err.field == "role":
        code = UNKNOWN_ROLE
    elif text.startswith("length"):
        code = LENGTH_MISMATCH
    else:
        code = SCHEMA_VIOLATION
    return Reject(code, str(err), err.field)


def _with_missing_columns(table: pa.Table, name: str) -> pa.Table:
    """A column the schema has and the table lacks becomes nulls, so a missing required column is a
    quarantine row per record naming the field (not an error for the whole file)."""
    schema = (trajectories_schema if name == "trajectories" else steps_schema).SCHEMA
    for f in schema:
        if f.name not in table.column_names and f.name != "round":
            table = table.append_column(f.name, pa.nulls(table.num_rows, f.type))
    return table


def _with_round(table: pa.Table, round_: int) -> pa.Table:
    if "round" in table.column_names:
        table = table.drop(["round"])
    return table.append_column("round", round_column(round_, table.num_rows))


def _fill_tokens(steps: pa.Table, tokenizer) -> tuple[pa.Table, int]:
    """Tokenize the content of steps that have no token ids."""
    n = steps.num_rows
    ids_col = (
        steps.column("token_ids") if "token_ids" in steps.column_names else pa.nulls(n, pa.list_(pa.int32()))
    )
    offs_col = (
        steps.column("token_offsets")
        if "token_offsets" in steps.column_names
        else pa.nulls(n, pa.list_(pa.int32()))
    )
    missing = pc.or_(pc.is_null(ids_col), pc.is_null(offs_col))
    rows = pc.indices_nonzero(missing).to_pylist() if n else []
    if rows:
        contents = pc.take(steps.column("content"), pa.array(rows)).to_pylist()
        enc_ids, enc_offs = tokenizer.encode_batch([c or "" for c in contents])
        ids, offs = ids_col.to_pylist(), offs_col.to_pylist()
        for r, i, o in zip(rows, enc_ids, enc_offs, strict=True):
            ids[r], offs[r] = list(i), list(o)
        ids_col, offs_col = pa.array(ids, pa.list_(pa.int32())), pa.array(offs, pa.list_(pa.int32()))
    for name, col in (("token_ids", ids_col), ("token_offsets", offs_col)):
        if name in steps.column_names:
            steps = steps.set_column(steps.column_names.index(name), name, col)
        else:
            steps = steps.append_column(name, col)
    return steps, len(rows)


def _link_errors(steps: pa.Table) -> dict[str, Reject]:
    """traj_id -> Reject for tool steps whose tool_call_id no earlier step of the trajectory made."""
    if "tool_call_id" not in steps.column_names or steps.num_rows == 0:
        return {}
    has_id = pc.is_valid(steps.column("tool_call_id"))
    if not pc.any(has_id).as_py():
        return {}
    calls: dict[str, dict[str, int]] = defaultdict(dict)
    cols = (
        steps.select(["traj_id", "step_idx", "tool_calls"]).to_pylist()
        if "tool_calls" in steps.column_names
        else []
    )
    for row in cols:
        for call in row["tool_calls"] or ():
            calls[row["traj_id"]].setdefault(call["id"], row["step_idx"])
    out: dict[str, Reject] = {}
    tool_rows = steps.filter(pc.and_(has_id, pc.equal(steps.column("role"), "tool")))
    for row in tool_rows.select(["traj_id", "step_idx", "tool_call_id"]).to_pylist():
        made_at = calls.get(row["traj_id"], {}).get(row["tool_call_id"])
        if made_at is None or made_at >= row["step_idx"]:
            out.setdefault(
                row["traj_id"],
                Reject(
                    UNMATCHED_TOOL_RESULT,
                    f"step {row['step_idx']} answers call {row['tool_call_id']!r}, "
                    "which no earlier step made",
                    "tool_call_id",
                ),
            )
    return out


def _raw(traj_row: dict | None, step_rows: list[dict]) -> str:
    return json.dumps({"trajectory": traj_row, "steps": step_rows}, ensure_ascii=False, default=str)


def ingest_tables(sources: list[tuple[str, dict[str, pa.Table]]], round_: int, tokenizer) -> IngestResult:
    trajectories, steps = _concat_sources(sources)
    records_read = trajectories.num_rows
    trajectories, steps = _with_round(trajectories, round_), _with_round(steps, round_)
    steps, n_tokenized = _fill_tokens(steps, tokenizer)

    traj_ids = set(trajectories.column("traj_id").to_pylist())
    step_ids = set(steps.column("traj_id").to_pylist())
    steps, rejected = _without_orphans(steps, traj_ids, step_ids)
    records_read += len(rejected)  # a group of steps without a trajectory row is a record too (quarantined)

    bad = _link_errors(steps)
    traj_col = steps.column("traj_id")
    for row, token_reject in sorted(token_rejects(steps, *vocab_of(tokenizer)).items()):
        bad.setdefault(traj_col[row].as_py(), token_reject)
    for traj_id in traj_ids - step_ids:
        if traj_id is not None:
            bad.setdefault(traj_id, Reject(MISSING_FIELD, "trajectory has no steps", "steps"))
    if not bad:
        try:
            t_ok = trajectories_schema.validate(trajectories)
            s_ok = steps_schema.validate(steps)
            return _result(t_ok, s_ok, rejected, round_, records_read, n_tokenized, tokenizer)
        except SchemaError:
            pass
    t_ok, s_ok = _one_by_one(trajectories, steps, bad, rejected)
    return _result(t_ok, s_ok, rejected, round_, records_read, n_tokenized, tokenizer)


def _concat_sources(sources: list[tuple[str, dict[str, pa.Table]]]) -> tuple[pa.Table, pa.Table]:
    """Every source's trajectories and steps as one table each (missing optional columns added), each row
    with its source file (`SOURCE_COL`)."""
    traj_parts: list[pa.Table] = []
    step_parts: list[pa.Table] = []
    for source_file, tables in sources:
        for name, parts in (("trajectories", traj_parts), ("steps", step_parts)):
            table = tables.get(name)
            if table is None:
                continue
            table = _with_missing_columns(table, name)
            parts.append(
                table.append_column(
                    SOURCE_COL, pa.repeat(pa.scalar(source_file, pa.string()), table.num_rows)
                )
            )
    trajectories = (
        pa.concat_tables(traj_parts, promote_options="permissive")
        if traj_parts
        else trajectories_schema.SPEC.empty().append_column(SOURCE_COL, pa.array([], pa.string()))
    )
    steps = (
        pa.concat_tables(step_parts, promote_options="permissive")
        if step_parts
        else steps_schema.SPEC.empty().append_column(SOURCE_COL, pa.array([], pa.string()))
    )
    return trajectories, steps


def _without_orphans(steps: pa.Table, traj_ids: set, step_ids: set) -> tuple[pa.Table, list[Rejected]]:
    """The steps without those of a traj_id that has no trajectory row: each such group is one rejected
    record."""
    rejected: list[Rejected] = []
    orphans = sorted(x for x in step_ids - traj_ids if x is not None)
    for traj_id in orphans:
        rows = steps.filter(pc.equal(steps.column("traj_id"), traj_id))
        record = SourceRecord(
            rows.column(SOURCE_COL)[0].as_py(),
            f"steps traj_id={traj_id}",
            _raw(None, rows.drop([SOURCE_COL]).to_pylist()),
        )
        rejected.append(
            Rejected(record, Reject(MISSING_FIELD, "steps without a trajectory row", "traj_id"), traj_id)
        )
    if orphans:
        steps = steps.filter(pc.invert(pc.is_in(steps.column("traj_id"), value_set=pa.array(orphans))))
    return steps, rejected


def _one_by_one(
    trajectories: pa.Table, steps: pa.Table, bad: dict[str, Reject], rejected: list[Rejected]
) -> tuple[pa.Table, pa.Table]:
    """The slow path: each trajectory with its steps on its own; one with a reason in `bad`, a duplicate
    traj_id or rows its schema refuses goes to `rejected`. Returns the valid trajectories and steps."""
    step_index: dict[tuple[str, str], list[int]] = defaultdict(list)  # (source file, traj_id) -> rows
    step_keys = zip(steps.column(SOURCE_COL).to_pylist(), steps.column("traj_id").to_pylist(), strict=True)
    for i, key in enumerate(step_keys):
        step_index[key].append(i)
    keep_t: list[int] = []
    keep_s: list[pa.Table] = []
    seen: set[str] = set()
    for i in range(trajectories.num_rows):
        t_row = trajectories.slice(i, 1)
        traj_id = t_row.column("traj_id")[0].as_py()
        key = (t_row.column(SOURCE_COL)[0].as_py(), traj_id)
        s_rows = steps.take(pa.array(step_index.get(key, []), pa.int64()))
        reject = bad.get(traj_id)
        if reject is None and traj_id in seen:
            reject = Reject(DUPLICATE_TRAJ_ID, f"traj_id {traj_id!r} was already read", "traj_id")
        if reject is None:
            try:
                trajectories_schema.validate(t_row)
                steps_schema.validate(s_rows)
            except SchemaError as err:
                reject = _reason(err)
        if reject is not None:
            record = SourceRecord(
                t_row.column(SOURCE_COL)[0].as_py(),
                f"trajectories row {i}",
                _raw(
                    t_row.drop([SOURCE_COL]).to_pylist()[0],
                    s_rows.drop([SOURCE_COL]).to_pylist() if traj_id not in seen else [],
                ),
            )
            rejected.append(Rejected(record, reject, traj_id))
            continue
        seen.add(traj_id)
        keep_t.append(i)
        keep_s.extend(step_index.get(key, []))
    t_ok = trajectories_schema.validate(trajectories.take(pa.array(keep_t, pa.int64())))
    s_ok = steps_schema.validate(steps.take(pa.array(sorted(keep_s), pa.int64())))
    return t_ok, s_ok


def _result(trajectories, steps, rejected, round_, records_read, n_tokenized, tokenizer) -> IngestResult:
    tokens = (
        int(pc.sum(pc.list_value_length(steps.column("token_ids"))).as_py() or 0) if steps.num_rows else 0
    )
    stats = {
        "records_read": records_read,
        "tokens": tokens,
        "steps_tokenized": n_tokenized,
        "tokenizer": getattr(tokenizer, "name", "?"),
    }
    return IngestResult(trajectories, steps, quarantine_table(rejected, round_, "parquet"), stats)


register_adapter(
    AdapterSpec(
        name="parquet",
        kind="tables",
        action_format=None,
        description="canonical trajectories + steps Parquet tables, validated with the schemas",
        extensions=(".parquet",),
        ingest_tables=ingest_tables,
    )
)
