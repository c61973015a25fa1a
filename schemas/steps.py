"""steps: one row per message of a trajectory (system, user, assistant, tool), with its tokens."""

from typing import cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas._base import Derived, TableSpec, check_in, check_same_length, check_unique, one_chunk

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
        pa.field("values_mean", pa.float64()),
        pa.field("values_m2", pa.float64()),
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
    "values_mean": "mean of the step's values (float64); null where values is null or empty or not all finite. "
    "Computed by the lake on every write, like n_tokens (what gae's statistics pass reads at gamma = lam = 1)",
    "values_m2": "sum over the step's values of (value - values_mean)^2 (float64); null where values_mean is",
    "verifier_score": "per-turn verifier score r_{i,k} in [0,1] on assistant steps (TCPO)",
}


def _value_moments(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Per step, the mean of its values and the sum of squared deviations from it, in float64, whole-column
    (two weighted bincounts over the flat values); NaN for a step whose values are null or empty."""
    col = table.column("values")
    col = one_chunk(col)
    n = len(col)
    counts = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    # the values of the non-null lists, in order (a null list's slots, which a masked list array may hold, are
    # skipped), and each one's step from the counts (list_parent_indices counted those slots too)
    v = np.asarray(
        pc.list_flatten(col).to_numpy(zero_copy_only=False), dtype=np.float64
    )  # (a null value: NaN)
    parent = np.repeat(np.arange(n), counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        # 0 / 0: NaN for a null or empty list
        mean = np.bincount(parent, weights=v, minlength=n).astype(np.float64) / counts
        dev = v - mean[parent]
        m2 = np.bincount(parent, weights=dev * dev, minlength=n).astype(np.float64)
    return mean, m2


def _value_moment(table: pa.Table, which: int, memo: dict[object, object]) -> pa.Array:
    """`_value_moments`' mean (0) or m2 (1) as a column: null for a step whose values are null, empty or not all
    finite (an assistant step there has no critic values: gae names its trajectory). Both from one pass over
    the values per derivation (`memo`, TableSpec.derive)."""
    moments = memo.get(_value_moments)
    if moments is None:
        moments = memo[_value_moments] = _value_moments(table)
    mean, m2 = cast(tuple[np.ndarray, np.ndarray], moments)
    return pa.array((mean, m2)[which], pa.float64(), mask=~np.isfinite(mean) | ~np.isfinite(m2))


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
            ("token_ids",), lambda t, memo: pc.list_value_length(t.column("token_ids")), "len(token_ids)"
        ),
        "values_mean": Derived(
            ("values",),
            lambda t, memo: _value_moment(t, 0, memo),
            'CASE WHEN isfinite(list_var_pop(CAST("values" AS DOUBLE[]))) '
            'THEN list_avg(CAST("values" AS DOUBLE[])) END',
        ),
        "values_m2": Derived(
            ("values",),
            lambda t, memo: _value_moment(t, 1, memo),
            'CASE WHEN isfinite(list_var_pop(CAST("values" AS DOUBLE[]))) '
            'THEN list_var_pop(CAST("values" AS DOUBLE[])) * len("values") END',
        ),
    },
)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
