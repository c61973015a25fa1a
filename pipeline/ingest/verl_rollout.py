"""`verl-rollout`: what verl writes to `trainer.rollout_data_dir` (and `trainer.validation_data_dir`) each step.

`RayPPOTrainer._log_rollout_data` -> `_dump_generations` -> `_write_generations` (verl/trainer/ppo/
ray_trainer.py, verl 0.9.1; the same fields since 0.4) writes `<dir>/<global_step>.jsonl`, one line per sample:

    {"input": <prompt ids decoded, skip_special_tokens=True>, "output": <response ids decoded, the same>,
     "gts": <reward_model.ground_truth>, "score": <row sum of token_level_scores>, "step": <global step>,
     **reward_extra_infos (each list as long as the batch, e.g. "acc"), "request_id" (when the batch has it)}

No token ids, no logprobs, no `uid`: the text is what the policy saw less its special tokens (role markers and
padding are dropped by the decode), so it is tokenized at ingest as it is (meta `rendered_by`: no chat template
is applied again; the ids can differ from the policy's where verl's decode dropped special tokens).
One trajectory per line: the input as one user step, the output as one assistant step (a multi-turn agent loop's
tool observations are inside the decoded response; `verl-batch` reads them apart from a `DataProto` dump).
group = `step<step>:<hash of input>` (verl's n samples of a prompt share the input text; its uid is not
written), traj_id `<file stem>:L<line>`, reward = `score`, policy_version = `step`, meta = `gts` and the extra
infos. Quarantined: a line that is not a JSON object, no input / output / score, a non-finite score.
"""

from __future__ import annotations

from pipeline.chat_template import RENDERED_BY
from pipeline.ingest.readers import read_jsonl
from pipeline.ingest.records import (
    INVALID_VALUE,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    as_int,
    content_text,
    prompt_hash,
    require,
)
from pipeline.ingest.registry import adapter

_KNOWN = {"input", "output", "score", "step"}


@adapter("verl-rollout", reader=read_jsonl, action_format=None, extensions=(".jsonl",))
def verl_rollout(record: SourceRecord) -> TrajectoryDraft:
    """verl `rollout_data_dir/<step>.jsonl` (input, output, gts, score, step, reward extra infos)."""
    data = record.data
    if not isinstance(data, dict):
        raise Reject(INVALID_VALUE, f"record is {type(data).__name__}, expected an object")
    prompt = content_text(require(data, "input"), "input")
    output = content_text(require(data, "output"), "output")
    reward = require(data, "score")
    step = as_int(data["step"], "step") if data.get("step") is not None else None
    line = record.location.removeprefix("line ")
    return TrajectoryDraft(
        traj_id=f"{record.stem}:L{line}",
        group_id=f"step{step if step is not None else record.stem}:{prompt_hash([prompt])}",
        reward=reward,
        policy_version=str(step) if step is not None else None,
        meta={
            **{k: v for k, v in data.items() if k not in _KNOWN},
            RENDERED_BY: "verl (decoded with skip_special_tokens=True)",
        },
        steps=[StepDraft(role="user", content=prompt), StepDraft(role="assistant", content=output)],
    )
