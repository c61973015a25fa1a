"""advantages: per (method, step) token advantages aligned with the step's token_ids, and the per-turn
components behind them (the spec's symbol names), so SQL can explain any token's credit."""

import pyarrow as pa

from schemas._base import TableSpec, check_unique

# Every method fills the components it has; the rest stay null. Names follow the spec's symbols.
COMPONENT_FIELDS: dict[str, str] = {
    "a_hat": "trajectory-level (or step-level) base advantage before token broadcast / refinement",
    "score": "the scalar the estimator normalised (reward, turn reward, step return, ...)",
    "a_episode": "GiGPO episode term A^E",
    "a_step": "GiGPO step term A^S / MT-GRPO turn term",
    "m_best": "TCPO m_{i,k} = max_{t<k} r",
    "delta": "TCPO progress Delta_{i,k}",
    "c_ret": "TCPO retrospective credit",
    "b_gate": "TCPO hindsight gate b_{i,k}",
    "u_future": "TCPO u_{i,k} = max_{t>=k} r",
    "c_hin": "TCPO hindsight credit",
    "surprisal": "TCPO xi_{i,k}",
    "c_cf": "TCPO counterfactual credit",
    "g_sel": "TCPO selection gate g",
    "eta": "TCPO non-degeneracy gate eta",
    "c_del": "TCPO delayed credit",
    "phi": "TCPO combined credit phi",
    "phi_norm": "TCPO phi normalised within (prompt, turn)",
    "d_plus": "IAPO out-degree on E+",
    "d_minus": "IAPO out-degree on E-",
    "d_in": "IAPO in-degree (u_dir + incoming E+)",
    "phi_plus": "IAPO support feature",
    "phi_minus": "IAPO error feature",
    "m_plus": "IAPO bounded weight from phi+",
    "m_minus": "IAPO bounded weight from phi-",
    "w": "IAPO routing weight applied to this action",
    "severity": "C3 span severity s (max over the turn's spans)",
    "confidence": "C3 span confidence c (behaviour policy)",
    "factor": "C3 multiplier 1 - lambda*s*c applied to positive tokens in the span",
}

COMPONENTS = pa.struct([pa.field(name, pa.float64()) for name in COMPONENT_FIELDS])

SCHEMA = pa.schema(
    [
        pa.field("round", pa.int32(), nullable=False),
        pa.field("method", pa.string(), nullable=False),
        pa.field("traj_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("step_idx", pa.int32(), nullable=False),
        pa.field("role", pa.string(), nullable=False),
        pa.field("turn", pa.int32()),
        pa.field("token_adv", pa.list_(pa.float32()), nullable=False),
        pa.field("token_returns", pa.list_(pa.float32())),
        pa.field("components", COMPONENTS),
    ]
)

DOCS = {
    "round": "round partition key",
    "method": "method chain, e.g. grpo, gae+c3, grpo+iapo+c3",
    "traj_id": "trajectory",
    "group_id": "prompt group",
    "step_idx": "step of the trajectory",
    "role": "role of the step (non-assistant steps carry zeros)",
    "turn": "1-based assistant turn",
    "token_adv": "advantage per token, aligned with steps.token_ids; 0 on non-assistant tokens",
    "token_returns": "PPO/GAE returns per token (critic targets); null for critic-free methods",
    "components": "per-turn numbers behind the advantage: " + ", ".join(COMPONENT_FIELDS),
}

SPEC = TableSpec(
    "advantages", SCHEMA, DOCS, checks=(check_unique("advantages", "method", "traj_id", "step_idx"),)
)


def validate(table: pa.Table) -> pa.Table:
    return SPEC.validate(table)
