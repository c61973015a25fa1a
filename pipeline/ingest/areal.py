"""`areal`: AReaL rollout dumps. AReaL's RLVR / multi-turn workflows (areal/workflow/rlvr.py, inclusionAI/AReaL
main, read 2025) write, when `dump_dir` is set, one text file per prompt: `<dump_dir>/<version>/<qid>.txt`,
appending for each of the n samples a block

    idx: {i} / {n}, seqlen: {seqlen}, reward is {reward}.
    prompt is
    <ESC>[33m<ESC>[2m{decoded prompt}<ESC>[0m
    sequence is:
    <ESC>[33m<ESC>[2m{decoded completion}<ESC>[0m

(colorama yellow/dim around the texts). The prompt is the decoded chat-templated prompt, so it becomes one user
step; the completion one assistant step (single turn; token ids are not dumped, so the text is tokenized at
ingest). group = `<version>/<qid>` (the n samples of one prompt at one policy version), sample_idx the order
in the group (idx repeats when a re-run appends to the file), traj_id `<version>/<qid>:<block>` (block: 0-based position in the file, as re-runs append), policy_version =
the folder name. `seqlen` is kept in meta. Quarantined: a block that does not parse, a non-numeric or non-finite
reward, an idx outside 1..n.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from pipeline.ingest.core import (
    INVALID_VALUE,
    MALFORMED_JSON,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    as_reward,
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
    """One record per `idx:` block (location `block N`)."""
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


@adapter("areal", reader=read_dump, action_format=None, extensions=(".txt",))
def areal(record: SourceRecord) -> TrajectoryDraft:
    """AReaL rollout dump (<dump_dir>/<version>/<qid>.txt blocks: idx, seqlen, reward, prompt, sequence)."""
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
        meta={"qid": qid, "idx": idx, "n_samples": n, "seqlen": int(m["seqlen"])},
        steps=[StepDraft(role="user", content=m["prompt"]), StepDraft(role="assistant", content=m["seq"])],
    )
