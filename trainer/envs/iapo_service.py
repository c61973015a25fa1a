"""`iapo_service`: a tool/service task where the decisive action must use an earlier tool return and a failure
is recoverable (IAPO).

Task (customer c of 8, whose order id is c mod 3; 8 tasks): the prompt is `refund_request cust<c>`. Actions (one
word each): `lookup` calls the order service, which returns `order refund(O1<j>)` (a tool step naming the order id in the
action's own word: the learnable structure is "copy it"); `refund(O1<x>)`
refunds order x: the service refunds verified (looked-up) orders only, so a refund before the lookup returns
`Error: order not verified`; after it the right id ends the episode with reward 1 and a wrong one returns
`Error: unknown order`. A failed tool call is recoverable once: the second error ends the episode. Any other word is an invalid action
(`invalid action`, flagged is_error by collect). K = 4 turns.

IAPO's `rules` annotator reads the dependency graph from the text: the value `O1<j>` (a code with digits) in the lookup's return is
bound by the refund that names it (a `success_utilization` edge lookup -> refund), an `Error` return marks its
action (e_i = 1), and the action after an error gets a `failed_utilization` (recovery) edge.

Reward: 1 when the right order was refunded, else 0. Per-turn verifier score: 1 after the right refund, 0.5
once looked up, else 0. Lookup-then-refund always succeeds, in 2 turns.
"""

from __future__ import annotations

from trainer.envs import register
from trainer.envs.toy import ToyEnv

N_O = 3
N_CUST = 8
REFUND = tuple(f"refund(O1{x})" for x in range(N_O))


@register("iapo_service")
class IAPOServiceEnv(ToyEnv):
    name = "iapo_service"
    title = "refund_service_toy"
    action_format = "chat"
    default_turns = 4
    actions = ("lookup", *REFUND)
    words = (
        "refund_service_toy",
        "refund_request",
        "refund(<order>)",
        *(f"cust{c}" for c in range(N_CUST)),
        "order",
        "Error:",
        "unknown",
        "not",
        "verified",
    )

    def tasks(self) -> list[dict]:
        return [
            {"env": self.name, "task_id": f"c{c}", "order": c % N_O, "customer": c} for c in range(N_CUST)
        ]

    def system_prompt(self, task: dict) -> str:
        # not the refund words: values in a system message are common knowledge to IAPO's rules annotator
        return f"{self.title} actions: lookup refund(<order>) answer_with_one_action"

    def reset(self, meta: dict) -> str:
        self._state = {
            **self.start(meta),
            "order": int(meta["order"]),
            "looked_up": False,
            "refunded": False,
            "errors": 0,
        }
        return f" refund_request cust{int(meta['customer'])}"

    def transition(self, word: str) -> str:
        st = self._state
        if word == "lookup":
            st["looked_up"] = True
            return f" order {REFUND[st['order']]}"
        if not st["looked_up"]:  # the service refunds verified orders only
            st["errors"] += 1
            return " Error: order not verified"
        if REFUND.index(word) == st["order"]:
            st["refunded"] = True
            return ""
        st["errors"] += 1
        return " Error: unknown order"

    def finished(self) -> bool:
        st = self._state
        return st["refunded"] or st["errors"] >= 2

    def score(self) -> float:
        st = self._state
        if st.get("refunded"):
            return 1.0
        return 0.5 if st.get("looked_up") else 0.0

    def reward(self) -> float:
        return float(self._state.get("refunded", False))

    def reward_components(self) -> dict[str, float]:
        st = self._state
        return {
            "refunded": self.reward(),
            "looked_up": float(st.get("looked_up", False)),
            "errors": float(st.get("errors", 0)),
            "invalid": float(st.get("invalid", 0)),
        }
