"""`trl`: TRL GRPOTrainer completion logs. With `log_completions=True`, GRPOTrainer (trl/trainer/grpo_trainer.py,
huggingface/trl main, read 2025) writes each logging step a Parquet file
`<output_dir>/completions/[<mode>/]completions_<global_step:05d>.parquet` built from one dict:

    {"step", "prompt", "completion", **rewards (one float column per reward function, named after it; NaN where
     the function returned None), **extra (log_extra columns), "advantage"}   (+ "mode" in some versions)

Each row is one single-turn trajectory: the prompt (text, or conversational messages) then one assistant step
(the completion). group = same prompt within a step (`step<step>:<hash of prompt>`, mode prepended when
present), traj_id `<file stem>:<row>`. Reward components = the numeric columns other than `step`/`advantage`
(TRL keeps no boundary between reward columns and numeric `log_extra` columns, so both count); reward = their
NaN-ignoring sum, as TRL does with unit `reward_weights` (weights are not in the file). TRL's advantage goes to
meta `trl_advantage`. Quarantined: no prompt or completion, every reward NaN, a non-finite reward.
"""

from __future__ import annotations

import json
import math
from pathlib import PurePath

import pyarrow as pa

from pipeline.ingest.chat_jsonl import convert_messages
from pipeline.ingest.core import ingest_records
from pipeline.ingest.records import (
    INVALID_VALUE,
    MISSING_FIELD,
    NON_FINITE_REWARD,
    IngestResult,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    content_text,
    prompt_hash,
)
from pipeline.ingest.registry import ADAPTERS, AdapterSpec, register_adapter

_NOT_REWARD = {"step", "advantage"}


def _messages(value, where: str, role: str) -> list[StepDraft]:
    if isinstance(value, str):
        return [StepDraft(role=role, content=value)]
    if isinstance(value, list):
        return convert_messages(value, where)
    if value is None:
        raise Reject(MISSING_FIELD, f"'{where}' is missing", where)
    return [StepDraft(role=role, content=content_text(value, where))]


def convert_row(record: SourceRecord) -> TrajectoryDraft:
    row, reward_cols = record.data, record.context["reward_cols"]
    prompt_steps = _messages(row.get("prompt"), "prompt", "user")
    completion = _messages(row.get("completion"), "completion", "assistant")
    if [s.role for s in completion] != ["assistant"]:
        raise Reject(INVALID_VALUE, "completion is not one assistant message", "completion")
    components = {}
    for col in reward_cols:
        v = row.get(col)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue  # the reward function did not apply to this sample
        if not math.isfinite(float(v)):
            raise Reject(NON_FINITE_REWARD, f"{col} is {v}", col)
        components[col] = float(v)
    if not components:
        raise Reject(
            NON_FINITE_REWARD,
            f"every reward column is NaN or missing ({', '.join(reward_cols) or 'none'})",
            "rewards",
        )
    step = row.get("step")
    prompt_key = json.dumps(row.get("prompt"), ensure_ascii=False, sort_keys=True, default=str)
    mode = f"{row['mode']}:" if row.get("mode") else ""
    meta = {k: v for k, v in row.items() if k not in {"prompt", "completion", "advantage", *reward_cols}}
    if row.get("advantage") is not None:
        meta["trl_advantage"] = row["advantage"]
    return TrajectoryDraft(
        traj_id=f"{PurePath(record.source_file).stem}:{record.context['row']}",
        group_id=f"{mode}step{step}:{prompt_hash([prompt_key])}",
        reward=sum(components.values()),
        reward_components=components,
        policy_version=str(step) if step is not None else None,
        meta=meta,
        steps=[*prompt_steps, *completion],
    )


def _reward_columns(table: pa.Table) -> list[str]:
    return [
        f.name
        for f in table.schema
        if f.name not in _NOT_REWARD and (pa.types.is_floating(f.type) or pa.types.is_integer(f.type))
    ]


def ingest_tables(sources, round_: int, tokenizer) -> IngestResult:
    records: list[SourceRecord] = []
    for source_file, table in sources:
        if not isinstance(table, pa.Table):
            records.append(
                SourceRecord(source_file, "$", "", error=Reject(INVALID_VALUE, "not a Parquet table"))
            )
            continue
        cols = _reward_columns(table)
        for i, row in enumerate(table.to_pylist()):
            raw = json.dumps(row, ensure_ascii=False, default=str)
            records.append(
                SourceRecord(source_file, f"row {i}", raw, row, context={"row": i, "reward_cols": cols})
            )
    return ingest_records(records, ADAPTERS["trl"], round_, tokenizer)


register_adapter(
    AdapterSpec(
        name="trl",
        kind="tables",
        action_format=None,
        description="TRL GRPOTrainer completions_*.parquet (prompt, completion, reward columns, advantage)",
        extensions=(".parquet",),
        convert=convert_row,
        ingest_tables=ingest_tables,
        options={"raw_files": True},
    )
)
