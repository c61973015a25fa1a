"""`tau2-bench`: tau2 Results JSON `{timestamp, info, tasks, simulations: [...]}`.

Each simulation is a trajectory: traj_id = its `id`, group = task_id, sample_idx = trial, reward =
`reward_info.reward`, reward_components = `reward_info.reward_breakdown` (DB, COMMUNICATE, ...) when present.
Messages carry `tool_calls` with a `requestor`: calls requested by the assistant are agent actions (rendered
into the assistant content); calls on a user message (requestor "user", the user simulator's own tools) stay
on that user step (`tool_calls`, content not re-rendered) and are not agent actions. Tool messages link by
`id` and carry `error` -> `is_error`. tau2's `errors` on an assistant message record attempts the
orchestrator rejected before the accepted message; they go to `meta.rejected_attempts` (the step itself is
the accepted message, not an error). The task, reward_info, termination reason, costs and seed go to `meta`.

The agent's system prompt is not in the messages: the run records what the agent was told, the domain policy
(`info.environment_info.policy`, also kept in `meta.policy`) and, for a solo run, the task's ticket. Every run
opens with a system step of it (`<policy>...</policy>`, then `<ticket>...</ticket>` for a solo run), so the
conversation renders through the chat template as the agent had it (tau2's fixed instruction text around them
is not in the Results file and is not rendered).

Harness-injected messages: tau2's orchestrator opens every simulation with an assistant message it writes
itself (`DEFAULT_FIRST_AGENT_MESSAGE`, "Hi! How can I help you today?", no LLM call) and puts it in the agent's
state as the agent's own message; a task's `initial_state.message_history` can put earlier assistant messages
in. The agent did not generate them in this run, so they are `assistant_context` steps: rendered as the
agent's assistant turn, with no turn number, no loss and no credit (the turn numbering starts at the first
message the agent generated). A message an agent framework wrote in the agent's place when it stopped it
(LangGraph's recursion limit, a traceback) is no turn of the agent's at all: a `system` step. Both are listed
in `meta.harness_messages` with their tau2 role and turn_idx. The rule: an assistant message is
harness-injected when it records no generation (`usage` and `raw_data` both null or absent) and either another
assistant message of the simulation records one, or it comes before every user message (the opener), or it is
a framework's error message. Every message the agent generated records its `usage` in tau2 Results.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from pipeline.ingest.chat_jsonl import message_step
from pipeline.ingest.readers import iter_json_array, iter_json_object
from pipeline.ingest.records import (
    INVALID_VALUE,
    MALFORMED_JSON,
    MISSING_FIELD,
    Reject,
    SourceRecord,
    StepDraft,
    TrajectoryDraft,
    as_int,
    require,
)
from pipeline.ingest.registry import adapter


def read_tau2_results(text: str, source_file: str) -> Iterator[SourceRecord]:
    """One record per simulation (location `simulations[i]`); `info` and `tasks` go to each record's context."""
    context: dict = {"tasks": {}, "info": {}}
    spans: tuple[int, int] | None = None
    try:
        for key, value, start, end in iter_json_object(text, 0):
            if key == "simulations":
                spans = (start, end)
            elif key == "tasks" and isinstance(value, list):
                context["tasks"] = {str(t.get("id")): t for t in value if isinstance(t, dict)}
            elif key == "info" and isinstance(value, dict):
                context["info"] = value
    except ValueError as exc:
        yield SourceRecord(source_file, "$", text, error=Reject(MALFORMED_JSON, str(exc)))
        return
    if spans is None:
        yield SourceRecord(
            source_file, "$", text, error=Reject(MISSING_FIELD, "no 'simulations' list", "simulations")
        )
        return
    for record, _ in iter_json_array(text[: spans[1]], spans[0], source_file, "simulations"):
        record.context = context
        yield record


def _generated(msg) -> bool:
    """The message records an LLM generation (tau2 keeps `usage` and `raw_data` of every model call)."""
    return isinstance(msg, dict) and (msg.get("usage") is not None or msg.get("raw_data") is not None)


# what agent frameworks write in the agent's place when they stop it (LangGraph's recursion limit, a Python
# traceback): an assistant message with this text and no recorded generation is the harness's, not a turn
FRAMEWORK_ERROR = re.compile(
    r"^\s*(?:Error:\s*)?(?:GraphRecursionError\b|Recursion limit of \d+ reached\b|"
    r"Traceback \(most recent call last\))",
    re.I,
)


def framework_error(msg) -> bool:
    content = msg.get("content") if isinstance(msg, dict) else None
    return (
        isinstance(content, str) and not msg.get("tool_calls") and FRAMEWORK_ERROR.search(content) is not None
    )


def harness_injected(messages: list) -> set[int]:
    """Positions of the assistant messages the harness injected (see the module doc)."""
    assistant = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    records_generation = any(_generated(messages[i]) for i in assistant)
    first_user = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), len(messages)
    )
    return {
        i
        for i in assistant
        if not _generated(messages[i])
        and (records_generation or i < first_user or framework_error(messages[i]))
    }


def system_prompt(sim: dict, agent: dict, env: dict, task) -> tuple[str | None, str | None]:
    """The agent's system prompt from what the run records, and what it was made of: the domain policy
    for a run with a user; the policy and the task's ticket for a solo run (tau2's fixed instruction text
    around them is not in the Results file, so it is not rendered). None when the run records no policy. A
    run is solo when its agent is a `*_solo` implementation, or when no message of the simulation is the
    user's."""
    raw = sim.get("messages")
    messages: list = raw if isinstance(raw, list) else []
    solo = str(agent.get("implementation") or "").endswith("_solo") or not any(
        isinstance(m, dict) and m.get("role") == "user" for m in messages
    )
    policy = env.get("policy")
    if not isinstance(policy, str) or not policy.strip():
        return None, None
    prompt = f"<policy>\n{policy.strip()}\n</policy>"
    ticket = task.get("ticket") if isinstance(task, dict) else None
    if solo and isinstance(ticket, str) and ticket.strip():
        return f"{prompt}\n<ticket>\n{ticket.strip()}\n</ticket>", "rendered from the policy and the ticket"
    return prompt, "rendered from the policy"


def unseen_by_agent(msg) -> bool:
    """A message the agent never saw: the user simulator's own tool call (a user message whose calls the user
    requested) or its result (a tool message with requestor "user"); tau2 routes them user -> environment ->
    user."""
    if not isinstance(msg, dict):
        return False
    if msg.get("role") == "tool":
        return msg.get("requestor") == "user"
    calls = msg.get("tool_calls")
    return (
        msg.get("role") == "user"
        and isinstance(calls, list)
        and bool(calls)
        and all(isinstance(c, dict) and c.get("requestor", "user") == "user" for c in calls)
    )


def _steps(messages, where: str = "messages") -> tuple[list[StepDraft], list[dict], list[dict]]:
    if not isinstance(messages, list):
        raise Reject(INVALID_VALUE, f"'{where}' is not a list", where)
    steps, rejected_attempts, harness = [], [], []
    injected = harness_injected(messages)
    for i, msg in enumerate(messages):
        w = f"{where}[{i}]"
        step, _ = message_step(msg, w)
        if i in injected:
            step.role = "system" if framework_error(msg) else "assistant_context"
            harness.append(
                {
                    "step_idx": i,
                    "role": msg.get("role"),
                    "turn_idx": msg.get("turn_idx"),
                    **({"framework_error": True} if framework_error(msg) else {}),
                }
            )
        if step.role == "tool" or (msg.get("role") == "tool" and unseen_by_agent(msg)):
            step.tool_call_id = str(require(msg, "id", w))
            step.is_error = bool(msg.get("error"))
        if unseen_by_agent(msg):
            step.role = "user_tool"
        if msg.get("errors"):
            rejected_attempts.append(
                {"step_idx": i, "turn_idx": msg.get("turn_idx"), "errors": msg["errors"]}
            )
        steps.append(step)
    return steps, rejected_attempts, harness


@adapter("tau2-bench", reader=read_tau2_results, action_format="openai_tools", extensions=(".json",))
def tau2_bench(record: SourceRecord) -> TrajectoryDraft:
    """tau2-bench Results JSON (simulations of tasks)."""
    sim = record.data
    if not isinstance(sim, dict):
        raise Reject(INVALID_VALUE, f"simulation is {type(sim).__name__}, expected an object")
    task_id = str(require(sim, "task_id"))
    trial = as_int(require(sim, "trial"), "trial")
    reward_info = require(sim, "reward_info")
    reward = require(reward_info, "reward", "reward_info")
    steps, rejected_attempts, harness = _steps(require(sim, "messages"))
    info = record.context.get("info", {})
    agent = info.get("agent_info") if isinstance(info.get("agent_info"), dict) else {}
    env = info.get("environment_info") if isinstance(info.get("environment_info"), dict) else {}
    task = record.context.get("tasks", {}).get(task_id)
    prompt, made_of = system_prompt(sim, agent, env, task)
    if prompt is not None:  # the agent's context opened with it: a system step before every message
        steps.insert(0, StepDraft(role="system", content=prompt))
        for entry in (*harness, *rejected_attempts):
            entry["step_idx"] += 1
    breakdown = reward_info.get("reward_breakdown")
    user = info.get("user_info") if isinstance(info.get("user_info"), dict) else {}
    meta = {
        "task_id": task_id,
        "trial": trial,
        "task": task,
        "system_prompt": made_of,
        "reward_info": reward_info,
        "rejected_attempts": rejected_attempts,
        "harness_messages": harness,
        "unseen_steps": sum(s.role == "user_tool" for s in steps),
        "domain": env.get("domain_name"),
        "policy": env.get("policy"),
        "tools": env.get("tool_defs"),
        "agent_llm": agent.get("llm"),
        "user_llm": user.get("llm"),
    }
    for key in ("termination_reason", "agent_cost", "user_cost", "duration", "seed", "timestamp"):
        if key in sim:
            meta[key] = sim[key]
    return TrajectoryDraft(
        traj_id=str(sim["id"]) if sim.get("id") else f"{record.run}:{task_id}:{trial}",
        group_id=task_id,
        sample_idx=trial,
        reward=reward,
        reward_components=breakdown if isinstance(breakdown, dict) and breakdown else None,
        policy_version=agent.get("llm"),
        meta=meta,
        steps=steps,
    )
