"""Building the tables: every step of the accepted drafts tokenized in one batch (the chat template where the
source has no token ids, `pipeline.chat_template`; given ids kept, their offsets found), the trajectories and
steps tables, the quarantine table, and the last safety nets (token data that lie, schema violations), each
sending a whole trajectory to quarantine."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pipeline.chat_template import tokenize_steps
from pipeline.ingest.checks import token_rejects
from pipeline.ingest.records import (
    LENGTH_MISMATCH,
    SCHEMA_VIOLATION,
    SURROGATE,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
)
from schemas import SchemaError
from schemas import quarantine as quarantine_schema
from schemas import steps as steps_schema
from schemas import trajectories as trajectories_schema

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
    if text is None or SURROGATE.search(text) is None:
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
    token_ids, token_offsets, logprobs, rejected = _token_data(flat, enc_ids, enc_offsets, tokenizer, stats)
    keep = [i for i in range(len(items)) if i not in rejected]
    bad = [Rejected(items[i][0], rejected[i], items[i][1].traj_id) for i in sorted(rejected)]
    trajectories = _trajectories_table([items[i][1] for i in keep], [made[i] for i in keep], round_)
    keep_set = set(keep)
    rows = [
        (item, items[item][1].traj_id, step, ids, offs, lp)
        for (item, step), ids, offs, lp in zip(flat, token_ids, token_offsets, logprobs, strict=True)
        if item in keep_set
    ]
    steps = _steps_table(rows, round_)
    stats["tokens"] = int(sum(len(x) for x in token_ids))
    return trajectories, steps, bad, dict(stats)


def _token_data(flat: list[tuple[int, StepDraft]], enc_ids, enc_offsets, tokenizer, stats: Counter):
    """Per step (in `flat`'s order): token ids, their offsets and the logprobs, and per draft a rejection.
    A step without ids takes the tokenizer's (its logprobs, if given, must be as many); a step with ids keeps
    them, with offsets found by `_given_offsets`."""
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
            token_ids.append(given)
            token_offsets.append(_given_offsets(given, list(ids), list(offs), step.content, decode, stats))
        logprobs.append([float(x) for x in lp] if lp is not None else None)
    return token_ids, token_offsets, logprobs, rejected


def _given_offsets(
    given: list[int], ids: list[int], offs: list[int], content: str, decode, stats
) -> list[int]:
    """Offsets of token ids the source gave: the tokenizer's when it gives the same ids, else found by decoding,
    else spread evenly (counted in `stats["offsets_approximate"]`)."""
    if ids == given:
        return offs
    decoded = offsets_by_decoding(decode, given, content) if decode else None
    if decoded is not None:
        return decoded
    stats["offsets_approximate"] += 1
    return _even_offsets(len(given), len(content))


def _trajectories_table(drafts: list[TrajectoryDraft], made: list[str], round_: int) -> pa.Table:
    rows: dict[str, list] = {k: [] for k in trajectories_schema.SCHEMA.names}
    for d, how in zip(drafts, made, strict=True):
        rows["round"].append(round_)
        rows["traj_id"].append(d.traj_id)
        rows["group_id"].append(d.group_id)
        rows["sample_idx"].append(d.sample_idx)
        rows["reward"].append(d.reward)
        rows["reward_components"].append(list(d.reward_components.items()) if d.reward_components else None)
        rows["source"].append(d.source)
        rows["action_format"].append(d.action_format)
        rows["policy_version"].append(d.policy_version)
        rows["meta"].append(json.dumps(_with_tokenization(d.meta, how), ensure_ascii=False, default=str))
    return pa.Table.from_pydict(rows, schema=trajectories_schema.SCHEMA)


def _steps_table(
    rows_in: list[tuple[int, str, StepDraft, list[int], list[int], list[float] | None]], round_: int
) -> pa.Table:
    """(draft, traj_id, step, token ids, offsets, logprobs) per step, each draft's steps in order -> the steps
    table."""
    rows: dict[str, list] = {k: [] for k in steps_schema.SPEC.written_schema.names}
    step_idx_of: dict[int, int] = {}
    for item, traj_id, step, ids, offs, lp in rows_in:
        idx = step_idx_of.get(item, 0)
        step_idx_of[item] = idx + 1
        rows["round"].append(round_)
        rows["traj_id"].append(traj_id)
        rows["step_idx"].append(idx)
        rows["role"].append(step.role)
        rows["turn"].append(step.turn)
        rows["content"].append(step.content)
        rows["tool_calls"].append(
            [{"id": c["id"], "name": c["name"], "arguments": c.get("arguments")} for c in step.tool_calls]
            if step.tool_calls is not None
            else None
        )
        rows["tool_call_id"].append(step.tool_call_id)
        rows["is_error"].append(bool(step.is_error))
        rows["token_ids"].append(ids)
        rows["token_offsets"].append(offs)
        rows["logprobs"].append(lp)
        rows["logprob_source"].append("rollout" if lp is not None else None)
        rows["values"].append(None)
        rows["verifier_score"].append(step.verifier_score)
    return steps_schema.SPEC.conform(pa.Table.from_pydict(rows, schema=steps_schema.SPEC.written_schema))


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
