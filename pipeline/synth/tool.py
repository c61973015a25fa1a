"""The tool environment (`action_format="openai_tools"`): a retail customer-service task (find user -> user
details -> order details -> cancel -> tell the user), one OpenAI tool call per assistant turn, JSON tool
answers whose ids later calls reuse, milestone scores (see `pipeline.synth`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pipeline.synth.common import (
    CITIES,
    FIRST,
    LAST,
    TOOL,
    Built,
    Pool,
    Segments,
    SynthSettings,
    TurnState,
    base_roles,
    put,
    step_layout,
    turn_lengths,
)

_TOOL_SYSTEM = (
    "You are a customer service agent for an online retail store. Help the user with their request using the "
    "tools provided. Authenticate the user by name and zip code before accessing any account data, confirm "
    "details before making changes, and make one tool call at a time."
)
TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": "find_user_id_by_name_zip",
            "description": "Find a user's id by first name, last name and zip code.",
            "parameters": {
                "type": "object",
                "properties": {
                    "first_name": {"type": "string"},
                    "last_name": {"type": "string"},
                    "zip": {"type": "string"},
                },
                "required": ["first_name", "last_name", "zip"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_user_details",
            "description": "Get a user's profile, orders and payment methods.",
            "parameters": {
                "type": "object",
                "properties": {"user_id": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["user_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_order_details",
            "description": "Get the status, items, total and payment method of an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "verbose": {"type": "boolean"}},
                "required": ["order_id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "cancel_pending_order",
            "description": "Cancel a pending order and refund it to its original payment method.",
            "parameters": {
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "reason": {"type": "string", "enum": ["no longer needed", "ordered by mistake"]},
                    "verbose": {"type": "boolean"},
                },
                "required": ["order_id", "reason"],
            },
        },
    },
]
_TOOL_NAMES = [t["function"]["name"] for t in TOOL_SPECS]  # type: ignore[index]
_UNKNOWN_TOOLS = ["get_order_info", "lookup_user", "cancel_order"]
_TOOL_LEADS = (
    "I need to authenticate the user first. ",
    "Now I can look up the account details. ",
    "Let me check the order before changing anything. ",
    "The order is pending, so it can be cancelled. ",
)
_N_MILESTONES = 5  # 4 tool calls + telling the user
_UNAVAILABLE = '{"error": "Service temporarily unavailable. Please retry."}'
_BAD_JSON = '{"error": "Invalid JSON in arguments: Expecting \',\' delimiter"}'
_CLARIFY = "Could you confirm which order you would like to cancel? "
_CLOSING = "Is there anything else I can help you with? "
_PIECES = (
    '\n<tool_call>\n{"name": "',
    '", "arguments": ',
    "}\n</tool_call>",
    "{}",
    _UNAVAILABLE,
    _BAD_JSON,
    _CLARIFY,
    _CLOSING,
    "No, that's all. Thank you!",
    "Great, thank you!",
)


@dataclass
class _Customer:
    """One group's task: the 4 calls' arguments and answers (JSON) and what the user and agent say."""

    args: list[str]
    near: list[str]  # the same calls with an extra `"verbose": true` (near repeats)
    returns: list[str]
    task: str
    confirm: str
    reply: str  # the user's answer to a clarifying question


def _customer(g: int, fn: str, ln: str, zip_code: int, ids: np.ndarray, cents: int, target: int) -> _Customer:
    uid = f"{fn.lower()}_{ln.lower()}_{ids[0] % 10000}"
    orders = [f"#W{ids[j]}" for j in (1, 2, 3)]
    oid = orders[target]
    pm = f"credit_card_{ids[4]}"
    total = round(int(cents) / 100, 2)
    args = [
        {"first_name": fn, "last_name": ln, "zip": str(zip_code)},
        {"user_id": uid},
        {"order_id": oid},
        {"order_id": oid, "reason": "no longer needed"},
    ]
    rets = [
        {"user_id": uid},
        {
            "user_id": uid,
            "name": {"first_name": fn, "last_name": ln},
            "address": {"city": CITIES[g % len(CITIES)], "zip": str(zip_code)},
            "orders": orders,
            "payment_methods": [{"id": pm, "type": "credit_card", "last_four": str(ids[4])[-4:]}],
        },
        {
            "order_id": oid,
            "user_id": uid,
            "status": "pending",
            "items": [{"item_id": f"{ids[5]}", "name": "Wireless Headphones", "price": total}],
            "total": total,
            "payment_method_id": pm,
        },
        {"order_id": oid, "status": "cancelled", "refund": {"amount": total, "payment_method_id": pm}},
    ]
    return _Customer(
        [json.dumps(a, ensure_ascii=False) for a in args],
        [json.dumps({**a, "verbose": True}, ensure_ascii=False) for a in args],
        [json.dumps(r, ensure_ascii=False) for r in rets],
        f"Hi, I'm {fn} {ln} and my zip code is {zip_code}. I ordered some headphones by mistake and "
        f"would like to cancel that order, order {oid}, and get my money back.",
        f"Your order {oid} has been cancelled. A refund of ${total:.2f} will go back to {pm} "
        f"within 5-7 business days.",
        f"Yes, it's order {oid}. Please cancel it, I no longer need it.",
    )


def _customers(rng: np.random.Generator, G: int) -> list[_Customer]:
    first = rng.integers(0, len(FIRST), G)
    last = rng.integers(0, len(LAST), G)
    zips = rng.integers(10000, 99999, G)
    ids = rng.integers(1_000_000, 9_999_999, (G, 6))
    cents = rng.integers(1500, 99999, G)
    target = rng.integers(0, 3, G)
    return [
        _customer(g, FIRST[first[g]], LAST[last[g]], int(zips[g]), ids[g], int(cents[g]), int(target[g]))
        for g in range(G)
    ]


@dataclass
class _Pieces:
    """The pool pieces of a batch's tool groups ([group, milestone] for the per-group calls)."""

    args: np.ndarray  # (G, 4)
    near: np.ndarray
    returns: np.ndarray
    names: np.ndarray  # the 4 tool names
    unknown: np.ndarray  # tool names that do not exist
    bad_json: np.ndarray  # (G, 4) arguments without their closing brace
    fixed: dict[str, int]
    err_unknown: np.ndarray
    err_missing: np.ndarray
    leads: np.ndarray
    confirms: np.ndarray
    replies: np.ndarray
    system: int
    tasks: np.ndarray


def _pieces(pool: Pool, cs: list[_Customer]) -> _Pieces:
    args = np.array([pool.ids(c.args) for c in cs])
    near = np.array([pool.ids(c.near) for c in cs])
    returns = np.array([pool.ids(c.returns) for c in cs])
    names = pool.ids(_TOOL_NAMES)
    unknown = pool.ids(_UNKNOWN_TOOLS)
    bad_json = np.array([pool.ids(a[:-1] for a in c.args) for c in cs])
    fixed = {t: pool.add(t) for t in _PIECES}
    err_unknown = pool.ids(json.dumps({"error": f"Unknown tool: {t}"}) for t in _UNKNOWN_TOOLS)
    err_missing = pool.ids(
        json.dumps({"error": f"Missing required argument: {r}"})
        for r in ("first_name", "user_id", "order_id", "order_id")
    )
    leads = pool.ids(_TOOL_LEADS)
    confirms = pool.ids(c.confirm for c in cs)
    replies = pool.ids(c.reply for c in cs)
    system = pool.add(_TOOL_SYSTEM)
    tasks = pool.ids(c.task for c in cs)
    return _Pieces(
        args,
        near,
        returns,
        names,
        unknown,
        bad_json,
        fixed,
        err_unknown,
        err_missing,
        leads,
        confirms,
        replies,
        system,
        tasks,
    )


class _State(TurnState):
    """Each trajectory's progress over its turns (its history: the milestones of earlier valid calls), and
    what its steps hold (role, error flag, calls)."""

    def __init__(self, N: int, K: int, n_steps: int) -> None:
        super().__init__(N, K)
        self.role = base_roles(N, n_steps)
        self.is_error = np.zeros((N, n_steps), dtype=bool)
        self.call_name = np.full((N, K), -1, dtype=np.int64)
        self.call_args = np.full((N, K), -1, dtype=np.int64)
        self.done = np.zeros(N, dtype=np.int64)  # milestones done (0..5)


@dataclass
class _Turn:
    """What each trajectory does on one turn."""

    invalid: np.ndarray
    repeat: np.ndarray
    near: np.ndarray
    clarify: np.ndarray  # asks the user which order (a turn that makes no progress)
    closing: np.ndarray  # the task is done: asks whether anything else is needed
    tell: np.ndarray  # tells the user the order is cancelled (the 5th milestone)
    runtime_err: np.ndarray
    milestone: np.ndarray  # the call's milestone (a repeat: an earlier one)
    has_call: np.ndarray


def _play_turn(st: _State, u: np.ndarray, k: int, s: SynthSettings, skill: np.ndarray) -> _Turn:
    """Turn k's actions and scores from its uniforms u (N, 6); updates the state."""
    succ = st.done >= _N_MILESTONES
    invalid = u[:, 0] < s.invalid_rate
    repeat = ~invalid & (st.n_hist > 0) & (u[:, 1] < s.repeat_rate)
    near = repeat & (u[:, 2] < s.near_share)
    act = ~invalid & ~repeat & ~succ
    progress = act & (u[:, 3] < skill)
    nxt = np.minimum(st.done, 3)  # next tool milestone (or the last call's slot for invalid turns)
    tell = progress & (st.done == 4)  # the 5th milestone is telling the user
    call = progress & ~tell
    runtime_err = call & (u[:, 4] < s.error_rate)
    st.done = st.done + (call & ~runtime_err) + tell
    earlier = st.earlier(u[:, 5])
    r = np.round(st.done / _N_MILESTONES, 2)
    r = np.where(invalid, np.maximum(st.prev - 0.1, 0.0), r)
    st.record(k, r, invalid)
    st.remember(call, nxt)
    closing = ~invalid & ~repeat & succ
    milestone = np.where(repeat, earlier, nxt)
    has_call = call | repeat | invalid
    return _Turn(invalid, repeat, near, act & ~progress, closing, tell, runtime_err, milestone, has_call)


def _write_assistant(
    rng: np.random.Generator,
    segs: Segments,
    st: _State,
    k: int,
    t: _Turn,
    pc: _Pieces,
    g_of: np.ndarray,
    word_starts: np.ndarray,
    text_len: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Turn k's assistant text: lead + filler, then the rendered call (or a message to the user). Returns the
    kind of each invalid call (0 unknown tool, 1 bad JSON, 2 a missing argument) and the unknown tool drawn."""
    N, step, m, P = len(g_of), 2 + 2 * k, t.milestone, pc.fixed
    invalid = t.invalid
    inv_kind = rng.integers(0, 3, N)
    unknown = rng.integers(0, len(_UNKNOWN_TOOLS), N)
    call_piece = np.where(invalid & (inv_kind == 0), pc.unknown[unknown], pc.names[m])
    args_now = np.where(t.near, pc.near[g_of, m], pc.args[g_of, m])
    args_now = np.where(invalid & (inv_kind == 1), pc.bad_json[g_of, m], args_now)
    args_now = np.where(invalid & (inv_kind == 2), P["{}"], args_now)
    st.call_name[t.has_call, k] = call_piece[t.has_call]
    st.call_args[t.has_call, k] = args_now[t.has_call]
    sa = segs.piece[:, step]
    segs.filler(rng, word_starts, step, 1, np.maximum(text_len, 8))
    sa[:, 0] = pc.leads[m]
    sa[:, 1] = -2
    put(sa, t.has_call, 2, P['\n<tool_call>\n{"name": "'])
    put(sa, t.has_call, 3, call_piece)
    put(sa, t.has_call, 4, P['", "arguments": '])
    put(sa, t.has_call, 5, args_now)
    put(sa, t.has_call, 6, P["}\n</tool_call>"])
    put(sa, t.clarify, 0, P[_CLARIFY])
    put(sa, t.closing, 0, P[_CLOSING])
    put(sa, t.tell, 0, pc.confirms[g_of])
    return inv_kind, unknown


def _write_observation(
    segs: Segments,
    st: _State,
    step: int,
    t: _Turn,
    pc: _Pieces,
    g_of: np.ndarray,
    inv_kind: np.ndarray,
    unknown: np.ndarray,
) -> None:
    """The step after a turn: the tool's answer (or its error) to a call, else the user's reply."""
    so, m, P, invalid = segs.piece[:, step], t.milestone, pc.fixed, t.invalid
    st.role[t.has_call, step] = TOOL
    st.is_error[:, step] = invalid | t.runtime_err
    ret = pc.returns[g_of, m]
    ret = np.where(t.runtime_err, P[_UNAVAILABLE], ret)
    ret = np.where(invalid & (inv_kind == 0), pc.err_unknown[unknown], ret)
    ret = np.where(invalid & (inv_kind == 1), P[_BAD_JSON], ret)
    ret = np.where(invalid & (inv_kind == 2), pc.err_missing[m], ret)
    put(so, t.has_call, 0, ret)
    put(so, t.clarify, 0, pc.replies[g_of])
    put(so, t.tell, 0, P["Great, thank you!"])
    put(so, t.closing, 0, P["No, that's all. Thank you!"])


def build_tool(
    rng: np.random.Generator, s: SynthSettings, n_groups: int, pool: Pool, word_starts: np.ndarray
) -> Built:
    """`n_groups` retail groups of `s.samples` trajectories, played turn by turn (vectorised over
    trajectories)."""
    G, S, K, T = n_groups, s.samples, s.turns, float(s.tokens)
    N = G * S
    n_steps, _, _ = step_layout(N, K)
    g_of = np.repeat(np.arange(G), S)
    cs = _customers(rng, G)
    pc = _pieces(pool, cs)
    segs = Segments(N, n_steps)
    segs.piece[:, 0, 0] = pc.system
    segs.piece[:, 1, 0] = pc.tasks[g_of]
    st = _State(N, K, n_steps)
    skill = np.clip(rng.beta(3.0, 1.5, G)[g_of] + rng.normal(0, 0.1, N), 0.2, 0.98)
    text_len = turn_lengths(rng, (N, K), T) - 123.0  # lead, rendered call
    for k in range(K):
        turn = _play_turn(st, rng.random((N, 6)), k, s, skill)
        inv_kind, unknown = _write_assistant(rng, segs, st, k, turn, pc, g_of, word_starts, text_len[:, k])
        if k < K - 1:
            _write_observation(segs, st, 2 + 2 * k + 1, turn, pc, g_of, inv_kind, unknown)
    tools_json = json.dumps(TOOL_SPECS)
    meta = [
        f'{{"env": "synthetic_retail", "task": {json.dumps(c.task, ensure_ascii=False)}, '
        f'"gold": {{"cancelled_order": {json.dumps(json.loads(c.args[2])["order_id"])}}}, '
        f'"tools": {tools_json}}}'
        for c in cs
    ]
    return Built(
        segs.piece,
        segs.start,
        segs.len,
        st.role,
        st.is_error,
        st.score,
        st.prev_score,
        st.call_name,
        st.call_args,
        (st.score.max(axis=1) >= 1.0).astype(np.float64),
        1.0 - st.n_invalid / K,
        [meta[g] for g in g_of],
        "openai_tools",
        "synth:tool",
    )
