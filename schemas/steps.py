"""steps: one row per message of a trajectory (system, user, assistant, tool), with its tokens."""

import pyarrow as pa
import pyarrow.compute as pc

from schemas._base import Derived, TableSpec, check_in, check_same_length, check_unique

# `user_tool`: a step the agent never saw: another actor's own tool call or its result (tau2's user simulator
# calls its device tools; the orchestrator routes them user -> environment -> user). Kept in the lake, with no
# turn and no tokens: not in the agent's context, the loss mask or the credit.
UNSEEN_ROLES = {"user_tool"}
# `assistant_context`: an assistant message of the agent's context that the agent did not generate in this run
# (tau2's opening greeting, which the orchestrator writes; a task's earlier history): the chat template renders
# it as the agent's own assistant turn (the role it maps to here), but it has no turn, no tokens in the loss
# mask and no credit.
CONTEXT_ROLES = {"assistant_context": "assistant"}
ROLES = {"system", "user", "assistant", "tool"} | UNSEEN_ROLES | set(CONTEXT_ROLES)

TOOL_CALL = pa.struct([("id", pa.string()), ("name", pa.string()), ("arguments", pa.string())])

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("step_idx", pa.int32(), nullable=False),
        pa.field("role", pa.string(), nullable=False),
        pa.field("turn", pa.int32()),
        pa.field("content", pa.string(), nullable=False),
        pa.field("tool_calls", pa.list_(TOOL_CALL)),
        pa.field("tool_call_id", pa.string()),
        pa.field("is_error", pa.bool_(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("token_offsets", pa.list_(pa.int32()), nullable=False),
        pa.field("n_tokens", pa.int32()),
        pa.field("logprobs", pa.list_(pa.float32())),
        pa.field("logprob_source", pa.string()),
        pa.field("values", pa.list_(pa.float32())),
        pa.field("verifier_score", pa.float64()),
    ]
)

DOCS = {
    "round": "round partition key",
    "traj_id": "trajectory this step belongs to",
    "step_idx": "0-based position of the message in the trajectory",
    "role": "system | user | assistant | tool | user_tool (the user simulator's own tool call or its result: "
    "never in the agent's context, no turn, no tokens) | assistant_context (an assistant message the agent did "
    "not generate in this run, e.g. tau2's greeting: rendered as its assistant turn, no turn, no loss, no credit)",
    "turn": "1-based index k of the assistant action; for user/tool steps, the turn of the action they answer; "
    "null for user_tool steps",
    "content": "message text as the model saw it (tool calls rendered into it for tokenisation)",
    "tool_calls": "OpenAI tool calls of an assistant message: id, name, arguments (JSON text)",
    "tool_call_id": "for a tool step, the id of the call it returns",
    "is_error": "the source marks this tool return (or message) as an error",
    "token_ids": "token ids of the content (list<int32>)",
    "token_offsets": "char start of each token in content (same length as token_ids)",
    "n_tokens": "len(token_ids): computed by the lake on every write (an input's own value is replaced); a read "
    "of a part written before the column derives it (what credit reads instead of the token ids)",
    "logprobs": "behaviour-policy logprob of each token (assistant steps); null when unknown",
    "logprob_source": "where logprobs came from: rollout, rescore:<model>, or null",
    "values": "critic value per token (PPO/GAE); null when there is no critic",
    "verifier_score": "per-turn verifier score r_{i,k} in [0,1] on assistant steps (TCPO)",
}


def _turn_on_assistant(table: pa.Table):
    from schemas._base import SchemaError, first_true

    is_asst = pc.equal(table.column("role"), "assistant")
    row = first_true(
        pc.and_kleene(
            is_asst, pc.or_kleene(pc.is_null(table.column("turn")), pc.less(table.column("turn"), 1))
        )
    )
    if row is not None:
        return SchemaError("steps", "turn", row, "assistant step needs a 1-based turn")
    return None


SPEC = TableSpec(
    "steps",
    SCHEMA,
    DOCS,
    checks=(
        check_unique("steps", "traj_id", "step_idx"),
        check_in("steps", "role", ROLES),
        check_same_length("steps", "token_ids", "token_offsets", "logprobs", "values"),
        _turn_on_assistant,
    ),
    derived={
        "n_tokens": Derived(
            ("token_ids",), lambda t: pc.list_value_length(t.column("token_ids")), "len(token_ids)"
        )
    },
)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
