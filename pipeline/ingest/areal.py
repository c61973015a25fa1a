"""`areal`: AReaL rollout dumps, in the layout AReaL writes today and the one it wrote before.

1. `<log dir>/rollout/<version>/<task_id>.jsonl` (`eval-rollout/` for evaluation), written by
   `WorkflowExecutor._dump_trajectory` (areal/infra/workflow_executor.py; AReaL 1.0.4 on PyPI and
   inclusionAI/AReaL main of 2026-05) when `dump_to_file` is set: one line per sample of a task,

       {"task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version", "reward",
        "prompt": <decoded prompt ids, special tokens kept>, "completion": <decoded completion ids>}

   `<version>` is the task's `tail_version` (the newest policy version among its tokens; `head_version` the
   oldest, -1 when the prompt's tokens count). The prompt is the chat-templated prompt as the policy saw it, so
   it is one user step and the completion one assistant step, both tokenized as they are (meta `rendered_by`:
   no chat template is applied a second time).
   Token ids are not dumped: both are tokenized at ingest with the tokenizer given (the policy's, to get
   AReaL's own `prompt_len` / `seqlen`; `meta` keeps both to compare).
   group = `<task_id>` (the samples of one task; `eval:` prefixed under `eval-rollout/`), sample_idx =
   `sample_idx`, traj_id = `<version>/<task_id>:<line>` (0-based line of the file: a re-run appends to it),
   policy_version = `tail_version`.
2. AReaL's older text dump (areal/workflow/rlvr.py of 2025): `<dump_dir>/<version>/<qid>.txt`, one block per
   sample, `idx: {i} / {n}, seqlen: {seqlen}, reward is {reward}.` then the prompt and the sequence, each
   wrapped in colorama yellow/dim. group = `<version>/<qid>`, traj_id `<version>/<qid>:<block>`.

Quarantined: a line that is not JSON or misses a field, a non-numeric or non-finite reward, a block that does
not parse, an idx outside 1..n.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from pipeline.chat_template import RENDERED_BY, SOURCE_TOKEN_COUNTS
from pipeline.ingest.readers import read_jsonl
from pipeline.ingest.records import (
    INVALID_VALUE,
    MALFORMED_JSON,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    as_int,
    as_reward,
    content_text,
    require,
)
from pipeline.ingest.registry import adapter

_COLOR = "\x1b[33m\x1b[2m"
_RESET = "\x1b[0m"
_BLOCK = re.compile(
    r"idx: (?P<idx>-?\d+) / (?P<n>\d+), seqlen: (?P<seqlen>\d+), reward is (?P<reward>.*?)\.\n"
    r"prompt is \n" + re.escape(_COLOR) + r"(?P<prompt>.*?)" + re.escape(_RESET) + r"\n"
    r"sequence is: \n" + re.escape(_COLOR) + r"(?P<seq>.*?)" + re.escape(_RESET) + r"\n?\Z",
    re.DOTALL,
)
_HEADER = re.compile(r"^idx: ", re.MULTILINE)


def read_dump(text: str, source_file: str):
    """`.jsonl`: one record per line; `.txt` (the older dump): one record per `idx:` block (`block N`)."""
    if not source_file.endswith(".txt"):
        yield from read_jsonl(text, source_file)
        return
    starts = [m.start() for m in _HEADER.finditer(text)]
    if not starts or text[: starts[0]].strip():
        lead = text[: starts[0]] if starts else text
        if lead.strip():
            yield SourceRecord(
                source_file,
                "block -",
                lead,
                error=Reject(MALFORMED_JSON, "text before the first 'idx:' block"),
            )
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(text)
        raw = text[start:end]
        yield SourceRecord(source_file, f"block {k}", raw, raw, context={"block": k})


def convert_jsonl(record: SourceRecord) -> TrajectoryDraft:
    """One line of `rollout/<version>/<task_id>.jsonl`."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    task_id = require(data, "task_id")
    if isinstance(task_id, (dict, list)):
        raise Reject(INVALID_VALUE, "task_id is not a scalar", "task_id")
    prompt = content_text(require(data, "prompt"), "prompt")
    completion = content_text(require(data, "completion"), "completion")
    reward = as_reward(require(data, "reward"))
    sample_idx = as_int(data["sample_idx"], "sample_idx") if data.get("sample_idx") is not None else None
    path = PurePath(record.source_file)
    version = path.parent.name
    is_eval = path.parent.parent.name == "eval-rollout"
    line = int(record.location.removeprefix("line ")) - 1
    tail = data.get("tail_version")
    meta = {
        k: data.get(k)
        for k in ("task_id", "sample_idx", "seqlen", "prompt_len", "head_version", "tail_version")
        if data.get(k) is not None
    }
    if is_eval:
        meta["eval"] = True
    plen, seqlen = data.get("prompt_len"), data.get("seqlen")
    if type(plen) is int and type(seqlen) is int:
        meta[SOURCE_TOKEN_COUNTS] = [plen, seqlen - plen]  # said on `meta.tokenization` when ours differ
    meta[RENDERED_BY] = "AReaL (decoded prompt and completion ids, special tokens kept)"
    return TrajectoryDraft(
        traj_id=f"{'eval:' if is_eval else ''}{version}/{task_id}:{line}",
        group_id=f"{'eval:' if is_eval else ''}{task_id}",
        sample_idx=sample_idx,
        reward=reward,
        policy_version=str(tail) if tail is not None else (version or None),
        meta=meta,
        steps=[StepDraft(role="user", content=prompt), StepDraft(role="assistant", content=completion)],
    )


@adapter("areal", reader=read_dump, action_format=None, extensions=(".jsonl", ".txt"))
def areal(record: SourceRecord) -> TrajectoryDraft:
    """AReaL rollout dump: rollout/<version>/<task_id>.jsonl records (or the older .txt blocks)."""
    if not isinstance(record.data, str):
        return convert_jsonl(record)
    m = _BLOCK.match(record.data)
    if m is None:
        raise Reject(
            MALFORMED_JSON, "block does not match AReaL's dump layout (idx/seqlen/reward, prompt, sequence)"
        )
    try:
        reward = float(m["reward"])
    except ValueError:
        raise Reject(INVALID_VALUE, f"reward {m['reward']!r} is not a number", "reward") from None
    reward = as_reward(reward)
    idx, n = int(m["idx"]), int(m["n"])
    if not 1 <= idx <= n:
        raise Reject(INVALID_VALUE, f"idx {idx} is outside 1..{n}", "idx")
    path = PurePath(record.source_file)
    qid, version = path.stem, path.parent.name
    group = f"{version}/{qid}" if version else qid
    return TrajectoryDraft(
        traj_id=f"{group}:{record.context['block']}",
        group_id=group,
        sample_idx=None,  # idx repeats when a run appends to the file again: next free index of the group
        reward=reward,
        policy_version=version or None,
        meta={
            "qid": qid,
            "idx": idx,
            "n_samples": n,
            "seqlen": int(m["seqlen"]),
            RENDERED_BY: "AReaL (decoded prompt and sequence)",
        },
        steps=[StepDraft(role="user", content=m["prompt"]), StepDraft(role="assistant", content=m["seq"])],
    )
