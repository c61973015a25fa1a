"""Synthetic rollouts at scale: seeded, canonical `trajectories` + `steps` tables for demos, tests and benchmarks.

Two environments, chosen per group (a group is all samples of one prompt):

- **search** (`action_format="search_r1"`): assistant turns `<think>...</think>\\n<search> q </search>` or
  `<answer> a </answer>`; observations are user steps `\\n\\n<information>{docs}</information>\\n\\n` (an answer
  gets an acknowledgement, an invalid action the Search-R1 "My previous action is invalid ..." message).
- **tool** (`action_format="openai_tools"`): a retail customer-service task (find user -> user details -> order
  details -> cancel -> tell the user). Assistant steps carry one OpenAI tool call, rendered into `content` exactly
  as `pipeline.render.render_assistant` does; tool steps answer with JSON whose ids and amounts (user id, order
  id, payment method, refund amount) are reused by later calls' arguments, which is what IAPO's annotator finds.
  Some turns talk to the user instead (clarifying question, final confirmation) and get a user reply.

Every trajectory has a system and a user prompt step, then exactly K assistant turns (a fixed budget: turns after
the first success are still played and scored) interleaved with K-1 observation steps.

**Per-turn verifier score** r_k in [0,1] (rounded to 2 decimals):
- search: an answer turn scores 1.0 if it is the gold answer, else the evidence found (partial credit); a search
  turn scores max(evidence found, score of the last answer); evidence grows only on new (non-repeated) queries.
- tool: milestones done / 5 (success = 1.0).
- an invalid turn scores the previous score minus 0.1 (clipped at 0), so scores are mostly non-decreasing with
  regressions at invalid turns and (search) at a wrong answer given after a right one.

**Outcome reward**: search = strict EM of the *last* valid `<answer>` (the Search-R1 env rule), i.e. 1.0 iff the
last answer turn scored 1.0; tool = 1.0 iff the task was completed (best score == 1.0; a cancellation cannot be
undone). `reward_components` (GDPO) = {"correct": reward, "format": 1 - invalid turns / K}.

**Rates** (per assistant turn, measured on the generated text in tests/test_synth.py):
- `invalid_rate`: malformed actions. search: unclosed `<search>`, both `<search>` and `<answer>`, or no action
  tag at all; tool: unknown tool name, arguments that are not JSON, or a missing required argument (the tool step
  returns an `{"error": ...}` with `is_error` true). Tool calls also fail at `error_rate` with a runtime error.
- `repeat_rate`: among valid action turns that have an earlier valid query/call in the trajectory, the fraction
  that repeats one: exact (same query / same call) or, with probability `near_share`, a near repeat (search: the
  query with an "s" appended, char-trigram Jaccard >= 0.9 after Search-R1 normalisation; tool: the same call with
  an extra `"verbose": true` argument).

**Tokens**: one token per UTF-8 byte (ids 0..255), i.e. `pipeline.tokenize.ByteTokenizer` semantics, computed
for the whole batch at once over the concatenated UTF-8 bytes of all contents; `token_offsets` is the char index
of each byte within its content. A BPE tokenizer would be ~100x slower at 16M tokens. `tokens` (T) is the mean
number of bytes of an assistant turn; observations are shorter (search docs ~T/2, tool JSON and user replies are
short). Logprobs (float32, `logprob_source="synthetic"`) are mostly near 0 with a heavy tail; `values` are critic
values (float32) near 0.2 + 0.6 x the score before the turn. Both are on assistant steps only (null elsewhere).

**Speed**: texts are built without per-token Python: each step is a row of up to `MAXSEG` segments (byte ranges
into one pool of template pieces and a filler corpus), chosen with NumPy over (trajectory, step); one gather
produces every content's bytes; list columns are built from flat arrays + offsets.

Limits: one tool call per assistant turn; a search group has 24 distinct queries, so beyond 24 fresh queries a
trajectory starts repeating them (exact repeats on top of `repeat_rate`); the whole-batch offsets are int32, so a
batch (batch_groups x samples x bytes) must stay under 2 GiB of text.

Same settings -> bit-identical tables. Batches of whole groups are generated independently (the RNG of a batch
is seeded with (seed, round, first group)), so memory is bounded by `batch_groups`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas import steps as steps_schema
from schemas import trajectories as traj_schema

KINDS = ("search", "tool", "mixed")
MAXSEG = 10
ROLE_NAMES = np.array(["system", "user", "assistant", "tool"])
SYSTEM, USER, ASSISTANT, TOOL = 0, 1, 2, 3


@dataclass(frozen=True)
class SynthSettings:
    groups: int = 8
    samples: int = 4
    turns: int = 4
    tokens: int = 200
    round: int = 0
    seed: int = 0
    kind: str = "mixed"
    invalid_rate: float = 0.1
    repeat_rate: float = 0.15
    near_share: float = 0.5
    error_rate: float = 0.05
    batch_groups: int = 64
    policy_version: str = "synthetic-v0"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if min(self.groups, self.samples, self.turns, self.tokens, self.batch_groups) < 1:
            raise ValueError("groups, samples, turns, tokens and batch_groups must be >= 1")
        for name in ("invalid_rate", "repeat_rate", "near_share", "error_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")


# ---- vocabulary ---------------------------------------------------------------------------------------------
_WORDS = (
    "the of and to in is was that for it as with on by this be are from at or an which have has not were "
    "but all one their they more been its also can two first only other new some would into time may about "
    "after when there these such most years then over between under during while where both because against "
    "information source result evidence question answer search document article record report page first "
    "second earlier later known found called named born city country river film album company university "
    "team season league novel author director founder member president government state century war music "
    "series character award history founded located released played written directed produced published "
    "order account customer refund payment address policy request item price total status pending cancel "
    "check confirm verify details should need might seems likely probably clearly however therefore "
    "so next now let me I we it look up find see whether correct enough more still missing "
    "café naïve Zürich São Paulo Malmö résumé Ångström"
).split()
_FIRST = "Margaret Alden Beatrice Caspian Delphine Emeric Fiorella Gideon Henrike Isidore Jolanda Kasimir Leopold Mireille Nikolai Ottilie Percival Quintus Rosalind Severin Theodora Ulric Valentina Wendelin Xaver Yolanda Zebulon".split()
_LAST = "Holloway Ashcombe Brightwater Castellanos Dunmore Everhart Fairweather Greenleaf Hartigan Ingersoll Jessop Kettering Lindqvist Montgomery Northcott Oyelaran Pemberton Quenneville Rothschild Stanhope Thornbury Underhill Vanderbilt Whitcombe Yardley".split()
_CITIES = "Edinburgh Valparaíso Kraków Montevideo Trondheim Ljubljana Winnipeg Brisbane Salzburg Cartagena Tbilisi Ostrava".split()
_QUESTIONS = (
    "Who was the spouse of {e}?",
    "In which city was {e} born?",
    "Who founded the company that first employed {e}?",
    "Who was the doctoral advisor of {e}?",
    "Who directed the film in which {e} made a debut?",
)
_ASPECTS = (
    "where was {e} born",
    "{e} early life and education",
    "{e} spouse",
    "{e} married to whom",
    "{e} university attended",
    "{e} first employer company",
    "{e} debut film director",
    "{e} biography",
    "{e} awards and honours",
    "{e} family background",
    "{e} nationality citizenship",
    "{e} notable works list",
    "{e} career timeline",
    "{e} founded company name",
    "{e} birthplace city",
    "{e} obituary newspaper",
    "who hired {e} first",
    "{e} mentor and teacher",
    "{e} publications bibliography",
    "{e} years active period",
    "{e} political party membership",
    "{e} hometown history",
    "{e} interview transcript",
    "{e} later life",
)
_THINK_LEADS = (
    "<think>I need more information before answering. ",
    "<think>Let me search for what is still missing. ",
    "<think>The previous results were not enough. ",
    "<think>Based on the information so far, ",
    "<think>I should check this carefully. ",
)
_SEARCH_SYSTEM = "You are a helpful assistant."
_SEARCH_PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge needed, "
    "you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. For "
    "example, <answer> Beijing </answer>. Question: {q}\n"
)
_SEARCH_INVALID = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
    "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
_SEARCH_ACK = "\n\nYour answer has been recorded. You may continue searching or revise your answer.\n\n"

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


@functools.lru_cache(maxsize=4)
def _corpus(min_chars: int) -> tuple[str, np.ndarray]:
    """A fixed pseudo-English filler text and the byte positions where its words start (ASCII-safe cuts)."""
    rng = np.random.default_rng(12345)
    words = np.array(_WORDS)
    n_words = max(60_000, min_chars // 4)
    picks = words[rng.integers(0, len(words), n_words)].tolist()
    ends = set(np.cumsum(rng.integers(6, 16, n_words // 6)).tolist())
    out = []
    for i, w in enumerate(picks):
        out.append(w + "." if i in ends else w)
    text = " ".join(out)
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    starts = np.flatnonzero(np.concatenate([[True], raw[:-1] == 32]))
    return text, starts


class _Pool:
    """Interned text pieces laid end to end in one byte buffer; a segment is a (byte start, byte length)."""

    def __init__(self, corpus: str):
        self.strings: list[str] = [corpus]
        self._index: dict[str, int] = {}
        self._bytes: list[bytes] = [corpus.encode("utf-8")]

    def add(self, text: str) -> int:
        idx = self._index.get(text)
        if idx is None:
            idx = len(self.strings)
            self._index[text] = idx
            self.strings.append(text)
            self._bytes.append(text.encode("utf-8"))
        return idx

    def ids(self, texts) -> np.ndarray:
        return np.array([self.add(t) for t in texts], dtype=np.int64)

    def finish(self) -> None:
        lens = np.array([len(b) for b in self._bytes], dtype=np.int64)
        self.start = np.concatenate([[0], np.cumsum(lens)[:-1]])
        self.len = lens
        self.buf = np.frombuffer(b"".join(self._bytes), dtype=np.uint8)


@dataclass
class _Built:
    """One environment's batch before it becomes tables (arrays indexed [trajectory, step] / [trajectory, turn])."""

    seg_piece: np.ndarray  # (N, S, MAXSEG) piece id, -1 = empty, -2 = filler
    filler_start: np.ndarray  # (N, S, MAXSEG) corpus byte start for filler segments
    filler_len: np.ndarray
    role: np.ndarray  # (N, S)
    is_error: np.ndarray  # (N, S)
    score: np.ndarray  # (N, K)
    prev_score: np.ndarray  # (N, K) score before each turn (for critic values)
    call_name: np.ndarray  # (N, K) piece id or -1 (no call)
    call_args: np.ndarray  # (N, K)
    reward: np.ndarray  # (N,)
    fmt: np.ndarray  # (N,)
    meta: list[str]
    action_format: str
    source: str


# ---- shared helpers -------------------------------------------------------------------------------------------
def _filler(
    rng: np.random.Generator, word_starts: np.ndarray, n_bytes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Corpus ranges of about n_bytes each, cut at word starts (so every cut is a char boundary)."""
    n_bytes = np.maximum(n_bytes.astype(np.int64), 1)
    limit = word_starts[-1] - int(n_bytes.max()) - 64
    hi = int(np.searchsorted(word_starts, max(limit, 1)))
    begin = word_starts[rng.integers(0, max(hi, 1), n_bytes.shape)]
    end_idx = np.minimum(np.searchsorted(word_starts, begin + n_bytes), len(word_starts) - 1)
    end = word_starts[end_idx] - 1  # drop the space before the next word
    return begin, np.maximum(end - begin, 0)


def _turn_lengths(rng: np.random.Generator, shape: tuple[int, ...], mean: float) -> np.ndarray:
    return rng.gamma(6.0, mean / 6.0, shape)


def _put(arr: np.ndarray, mask: np.ndarray, col: int, value) -> None:
    """arr[..., col] = value where mask (value broadcast or an array shaped like mask)."""
    view = arr[..., col]
    if np.ndim(value):
        view[mask] = np.asarray(value)[mask]
    else:
        view[mask] = value


def _layout(n: int, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Steps per trajectory (system, user, then assistant/observation alternating), and per-step turn."""
    n_steps = 2 * k + 1
    turn = np.zeros(n_steps, dtype=np.int32)
    turn[2::2] = np.arange(1, k + 1)
    turn[3::2] = np.arange(1, k)
    return n_steps, np.broadcast_to(turn, (n, n_steps)).copy(), np.arange(n_steps)


# ---- search -----------------------------------------------------------------------------------------------------
def _build_search(
    rng: np.random.Generator, s: SynthSettings, n_groups: int, pool: _Pool, word_starts: np.ndarray
) -> _Built:
    G, S, K, T = n_groups, s.samples, s.turns, float(s.tokens)
    N = G * S
    n_steps, _, _ = _layout(N, K)
    # group-level text: entity, question, gold and wrong answers, query pool, doc titles
    first = rng.integers(0, len(_FIRST), G)
    last = rng.integers(0, len(_LAST), G)
    ents = [f"{_FIRST[a]} {_LAST[b]}" for a, b in zip(first, last, strict=True)]
    qtype = rng.integers(0, len(_QUESTIONS), G)
    questions = [_QUESTIONS[q].format(e=e) for q, e in zip(qtype, ents, strict=True)]
    answers = rng.integers(0, len(_FIRST) * len(_LAST) + len(_CITIES), (G, 4))

    def ans_text(code: int, q: int) -> str:
        if q == 1:
            return _CITIES[code % len(_CITIES)]
        return f"{_FIRST[code % len(_FIRST)]} {_LAST[(code // len(_FIRST)) % len(_LAST)]}"

    ans_txt = [[ans_text(int(answers[g, j]), int(qtype[g])) for j in range(4)] for g in range(G)]
    for g in range(G):  # wrong answers differ from the gold one
        for j in range(1, 4):
            if ans_txt[g][j] == ans_txt[g][0]:
                ans_txt[g][j] = ans_txt[g][j] + " Jr."
    gold_piece = pool.ids(a[0] for a in ans_txt)
    wrong_piece = pool.ids(a[j] for a in ans_txt for j in range(1, 4)).reshape(G, 3)
    Q = len(_ASPECTS)
    order = np.argsort(rng.random((G, Q)), axis=1)  # per-group query order
    qtext = [
        [_ASPECTS[order[g, j]].format(e=ents[g].lower() if j % 3 == 0 else ents[g]) for j in range(Q)]
        for g in range(G)
    ]
    qpiece = np.array(
        [[pool.add(q) for q in row] + [pool.add(q + "s") for q in row] for row in qtext]
    )  # (G, 2Q)
    ent_piece = pool.ids(ents)
    other_piece = pool.ids(
        f"{_FIRST[(a + 7) % len(_FIRST)]} {_LAST[(b + 3) % len(_LAST)]}"
        for a, b in zip(first, last, strict=True)
    )
    sys_piece = pool.add(_SEARCH_SYSTEM)
    user_piece = pool.ids(_SEARCH_PROMPT.format(q=q) for q in questions)

    g_of = np.repeat(np.arange(G), S)
    skill = np.clip(rng.beta(2.0, 2.0, G)[g_of] + rng.normal(0, 0.1, N), 0.05, 1.0)
    qshift = rng.integers(0, Q, N)  # where each sample starts in its group's query order

    P = {
        t: pool.add(t)
        for t in (
            "</think>\n",
            "<search> ",
            " </search>",
            "<answer> ",
            " </answer>",
            " </search>\n<answer> ",
            "I will look up ",
            " next.",
            _SEARCH_INVALID,
            _SEARCH_ACK,
            '\n\n<information>Doc 1(Title: "',
            '") ',
            '\nDoc 2(Title: "',
            "</information>\n\n",
        )
    }
    lead_piece = pool.ids(_THINK_LEADS)

    # ---- the turn loop: vectorised over trajectories ----
    seg = np.full((N, n_steps, MAXSEG), -1, dtype=np.int64)
    fstart = np.zeros((N, n_steps, MAXSEG), dtype=np.int64)
    flen = np.zeros((N, n_steps, MAXSEG), dtype=np.int64)
    seg[:, 0, 0] = sys_piece
    seg[:, 1, 0] = user_piece[g_of]
    score = np.zeros((N, K))
    prev_score = np.zeros((N, K))
    hist = np.zeros((N, K), dtype=np.int64)  # query ids (0..2Q) of earlier valid searches
    n_hist = np.zeros(N, dtype=np.int64)
    n_new = np.zeros(N, dtype=np.int64)
    evidence = np.zeros(N)
    last_ans = np.full(N, -1.0)  # score of the last valid answer, -1 = none yet
    succ = np.zeros(N, dtype=bool)
    n_invalid = np.zeros(N)
    prev = np.zeros(N)
    rows = np.arange(N)
    think_len = _turn_lengths(rng, (N, K), T) - 103.0  # lead, tags, query
    for k in range(K):
        st = 2 + 2 * k
        u = rng.random((N, 8))
        invalid = u[:, 0] < s.invalid_rate
        p_answer = np.where(succ, 0.9, 0.1 + 0.6 * evidence)
        answer = ~invalid & ((u[:, 1] < p_answer) | (k == K - 1))
        search = ~invalid & ~answer
        repeat = search & (n_hist > 0) & (u[:, 2] < s.repeat_rate)
        near = repeat & (u[:, 3] < s.near_share)
        new_q = (n_new + qshift) % Q
        earlier = hist[rows, np.minimum((u[:, 4] * n_hist).astype(np.int64), np.maximum(n_hist - 1, 0))]
        near_of = np.where(earlier >= Q, earlier - Q, earlier + Q)
        qid = np.where(repeat, np.where(near, near_of, earlier), new_q)
        n_new += (~repeat).astype(np.int64)  # invalid turns use up a fresh query too
        # evidence grows on new, valid searches only
        gain = np.where(search & ~repeat & (u[:, 5] < 0.85), skill * (0.1 + 0.35 * u[:, 6]), 0.0)
        evidence = np.minimum(evidence + gain, 0.95)
        correct = answer & np.where(succ, u[:, 7] < 0.9, u[:, 7] < evidence**1.5 * (0.5 + 0.5 * skill))
        ans_score = np.where(correct, 1.0, np.round(evidence, 2))
        last_ans = np.where(answer, ans_score, last_ans)
        r = np.where(answer, ans_score, np.where(search, np.maximum(evidence, last_ans), 0.0))
        r = np.where(invalid, np.maximum(prev - 0.1, 0.0), r)
        r = np.clip(np.round(r, 2), 0.0, 1.0)
        prev_score[:, k], score[:, k] = prev, r
        prev = r
        succ |= correct
        n_invalid += invalid
        hist[rows[search], n_hist[search]] = qid[search]
        n_hist += search
        # ---- assistant text ----
        inv_kind = rng.integers(0, 3, N)
        q_piece = qpiece[g_of, qid]
        wrong = wrong_piece[g_of, rng.integers(0, 3, N)]
        a_piece = np.where(correct, gold_piece[g_of], wrong)
        sa = seg[:, st]
        sa[:, 0] = lead_piece[rng.integers(0, len(lead_piece), N)]
        sa[:, 1] = -2
        b, ln = _filler(rng, word_starts, np.maximum(think_len[:, k], 8))
        fstart[:, st, 1], flen[:, st, 1] = b, ln
        sa[:, 2] = P["</think>\n"]
        _put(sa, search | invalid & (inv_kind < 2), 3, P["<search> "])
        _put(sa, search | invalid, 4, q_piece)
        _put(sa, search | invalid & (inv_kind == 1), 5, P[" </search>"])
        _put(sa, answer, 3, P["<answer> "])
        _put(sa, answer, 4, a_piece)
        _put(sa, answer, 5, P[" </answer>"])
        both = invalid & (inv_kind == 1)
        _put(sa, both, 5, P[" </search>\n<answer> "])
        _put(sa, both, 6, wrong)
        _put(sa, both, 7, P[" </answer>"])
        plain = invalid & (inv_kind == 2)
        _put(sa, plain, 3, P["I will look up "])
        _put(sa, plain, 5, P[" next."])
        # ---- observation ----
        if k == K - 1:
            continue
        so = seg[:, st + 1]
        _put(so, invalid, 0, P[_SEARCH_INVALID])
        _put(so, answer, 0, P[_SEARCH_ACK])
        so[search, 0] = P['\n\n<information>Doc 1(Title: "']
        so[search, 1] = ent_piece[g_of][search]
        so[search, 2] = P['") ']
        so[search, 3] = -2
        so[search, 4] = P['\nDoc 2(Title: "']
        so[search, 5] = np.where(evidence >= 0.5, gold_piece[g_of], other_piece[g_of])[search]
        so[search, 6] = P['") ']
        so[search, 7] = -2
        so[search, 8] = P["</information>\n\n"]
        for col in (3, 7):
            b, ln = _filler(rng, word_starts, np.maximum(_turn_lengths(rng, (N,), T / 4) - 20, 8))
            fstart[:, st + 1, col], flen[:, st + 1, col] = b, ln

    role = np.full((N, n_steps), USER, dtype=np.int8)
    role[:, 0] = SYSTEM
    role[:, 2::2] = ASSISTANT
    reward = np.where(last_ans == 1.0, 1.0, 0.0)
    meta = [
        json.dumps(
            {
                "env": "synthetic_search",
                "question": questions[g],
                "gold_answers": [ans_txt[g][0]],
                "data_source": "synth",
            },
            ensure_ascii=False,
        )
        for g in range(G)
    ]
    return _Built(
        seg,
        fstart,
        flen,
        role,
        np.zeros((N, n_steps), dtype=bool),
        score,
        prev_score,
        np.full((N, K), -1),
        np.full((N, K), -1),
        reward,
        1.0 - n_invalid / K,
        [meta[g] for g in g_of],
        "search_r1",
        "synth:search",
    )


# ---- tool -------------------------------------------------------------------------------------------------------
def _build_tool(
    rng: np.random.Generator, s: SynthSettings, n_groups: int, pool: _Pool, word_starts: np.ndarray
) -> _Built:
    G, S, K, T = n_groups, s.samples, s.turns, float(s.tokens)
    N = G * S
    n_steps, _, _ = _layout(N, K)
    g_of = np.repeat(np.arange(G), S)
    first = rng.integers(0, len(_FIRST), G)
    last = rng.integers(0, len(_LAST), G)
    zips = rng.integers(10000, 99999, G)
    ids = rng.integers(1_000_000, 9_999_999, (G, 6))
    cents = rng.integers(1500, 99999, G)
    target = rng.integers(0, 3, G)
    # per group: the 4 calls (args, near-repeat args, return JSON) and the user-facing texts
    calls_args, calls_near, returns, tasks, confirms, clar_replies = [], [], [], [], [], []
    for g in range(G):
        fn, ln = _FIRST[first[g]], _LAST[last[g]]
        uid = f"{fn.lower()}_{ln.lower()}_{ids[g, 0] % 10000}"
        orders = [f"#W{ids[g, j]}" for j in (1, 2, 3)]
        oid = orders[target[g]]
        pm = f"credit_card_{ids[g, 4]}"
        total = round(int(cents[g]) / 100, 2)
        item = f"{ids[g, 5]}"
        args = [
            {"first_name": fn, "last_name": ln, "zip": str(zips[g])},
            {"user_id": uid},
            {"order_id": oid},
            {"order_id": oid, "reason": "no longer needed"},
        ]
        rets = [
            {"user_id": uid},
            {
                "user_id": uid,
                "name": {"first_name": fn, "last_name": ln},
                "address": {"city": _CITIES[g % len(_CITIES)], "zip": str(zips[g])},
                "orders": orders,
                "payment_methods": [{"id": pm, "type": "credit_card", "last_four": str(ids[g, 4])[-4:]}],
            },
            {
                "order_id": oid,
                "user_id": uid,
                "status": "pending",
                "items": [{"item_id": item, "name": "Wireless Headphones", "price": total}],
                "total": total,
                "payment_method_id": pm,
            },
            {"order_id": oid, "status": "cancelled", "refund": {"amount": total, "payment_method_id": pm}},
        ]
        calls_args.append([json.dumps(a, ensure_ascii=False) for a in args])
        calls_near.append([json.dumps({**a, "verbose": True}, ensure_ascii=False) for a in args])
        returns.append([json.dumps(r, ensure_ascii=False) for r in rets])
        tasks.append(
            f"Hi, I'm {fn} {ln} and my zip code is {zips[g]}. I ordered some headphones by mistake and "
            f"would like to cancel that order, order {oid}, and get my money back."
        )
        confirms.append(
            f"Your order {oid} has been cancelled. A refund of ${total:.2f} will go back to {pm} "
            f"within 5-7 business days."
        )
        clar_replies.append(f"Yes, it's order {oid}. Please cancel it, I no longer need it.")
    args_piece = np.array([pool.ids(a) for a in calls_args])  # (G, 4)
    near_piece = np.array([pool.ids(a) for a in calls_near])
    ret_piece = np.array([pool.ids(r) for r in returns])
    name_piece = pool.ids(_TOOL_NAMES)
    unknown_piece = pool.ids(_UNKNOWN_TOOLS)
    badjson_piece = np.array([pool.ids(a[:-1] for a in row) for row in calls_args])  # missing closing brace
    P = {
        t: pool.add(t)
        for t in (
            '\n<tool_call>\n{"name": "',
            '", "arguments": ',
            "}\n</tool_call>",
            "{}",
            '{"error": "Service temporarily unavailable. Please retry."}',
            '{"error": "Invalid JSON in arguments: Expecting \',\' delimiter"}',
            "Could you confirm which order you would like to cancel? ",
            "Is there anything else I can help you with? ",
            "No, that's all. Thank you!",
            "Great, thank you!",
        )
    }
    err_unknown = pool.ids(json.dumps({"error": f"Unknown tool: {t}"}) for t in _UNKNOWN_TOOLS)
    err_missing = pool.ids(
        json.dumps({"error": f"Missing required argument: {r}"})
        for r in ("first_name", "user_id", "order_id", "order_id")
    )
    lead_piece = pool.ids(_TOOL_LEADS)
    confirm_piece = pool.ids(confirms)
    reply_piece = pool.ids(clar_replies)

    seg = np.full((N, n_steps, MAXSEG), -1, dtype=np.int64)
    fstart = np.zeros((N, n_steps, MAXSEG), dtype=np.int64)
    flen = np.zeros((N, n_steps, MAXSEG), dtype=np.int64)
    seg[:, 0, 0] = pool.add(_TOOL_SYSTEM)
    seg[:, 1, 0] = pool.ids(tasks)[g_of]
    role = np.full((N, n_steps), USER, dtype=np.int8)
    role[:, 0] = SYSTEM
    role[:, 2::2] = ASSISTANT
    is_error = np.zeros((N, n_steps), dtype=bool)
    call_name = np.full((N, K), -1, dtype=np.int64)
    call_args = np.full((N, K), -1, dtype=np.int64)
    score = np.zeros((N, K))
    prev_score = np.zeros((N, K))
    skill = np.clip(rng.beta(3.0, 1.5, G)[g_of] + rng.normal(0, 0.1, N), 0.2, 0.98)
    done = np.zeros(N, dtype=np.int64)  # milestones done (0..5)
    hist = np.zeros((N, K), dtype=np.int64)  # milestone index of earlier valid calls
    n_hist = np.zeros(N, dtype=np.int64)
    n_invalid = np.zeros(N)
    prev = np.zeros(N)
    rows = np.arange(N)
    text_len = _turn_lengths(rng, (N, K), T) - 123.0  # lead, rendered call
    for k in range(K):
        st = 2 + 2 * k
        u = rng.random((N, 6))
        succ = done >= _N_MILESTONES
        invalid = u[:, 0] < s.invalid_rate
        repeat = ~invalid & (n_hist > 0) & (u[:, 1] < s.repeat_rate)
        near = repeat & (u[:, 2] < s.near_share)
        act = ~invalid & ~repeat & ~succ
        progress = act & (u[:, 3] < skill)
        clarify = act & ~progress
        closing = ~invalid & ~repeat & succ
        nxt = np.minimum(done, 3)  # next tool milestone (or the last call's slot for invalid turns)
        tell = progress & (done == 4)  # the 5th milestone is telling the user
        call = progress & ~tell
        runtime_err = call & (u[:, 4] < s.error_rate)
        done = done + (call & ~runtime_err) + tell
        earlier = hist[rows, np.minimum((u[:, 5] * n_hist).astype(np.int64), np.maximum(n_hist - 1, 0))]
        r = np.round(done / _N_MILESTONES, 2)
        r = np.where(invalid, np.maximum(prev - 0.1, 0.0), r)
        prev_score[:, k], score[:, k] = prev, r
        prev = r
        n_invalid += invalid
        valid_call = call | repeat
        m = np.where(repeat, earlier, nxt)
        hist[rows[call], n_hist[call]] = nxt[call]
        n_hist += call
        # ---- assistant: lead + filler, then the rendered call (or a message to the user) ----
        inv_kind = rng.integers(0, 3, N)
        unknown = rng.integers(0, len(_UNKNOWN_TOOLS), N)
        has_call = valid_call | invalid
        call_piece = np.where(invalid & (inv_kind == 0), unknown_piece[unknown], name_piece[m])
        args_now = np.where(near, near_piece[g_of, m], args_piece[g_of, m])
        args_now = np.where(invalid & (inv_kind == 1), badjson_piece[g_of, m], args_now)
        args_now = np.where(invalid & (inv_kind == 2), P["{}"], args_now)
        call_name[has_call, k] = call_piece[has_call]
        call_args[has_call, k] = args_now[has_call]
        sa = seg[:, st]
        b, ln = _filler(rng, word_starts, np.maximum(text_len[:, k], 8))
        fstart[:, st, 1], flen[:, st, 1] = b, ln
        sa[:, 0] = lead_piece[m]
        sa[:, 1] = -2
        _put(sa, has_call, 2, P['\n<tool_call>\n{"name": "'])
        _put(sa, has_call, 3, call_piece)
        _put(sa, has_call, 4, P['", "arguments": '])
        _put(sa, has_call, 5, args_now)
        _put(sa, has_call, 6, P["}\n</tool_call>"])
        _put(sa, clarify, 0, P["Could you confirm which order you would like to cancel? "])
        _put(sa, closing, 0, P["Is there anything else I can help you with? "])
        _put(sa, tell, 0, confirm_piece[g_of])
        # ---- observation: tool return or user reply ----
        if k == K - 1:
            continue
        so = seg[:, st + 1]
        role[has_call, st + 1] = TOOL
        is_error[:, st + 1] = invalid | runtime_err
        ret = ret_piece[g_of, m]
        ret = np.where(runtime_err, P['{"error": "Service temporarily unavailable. Please retry."}'], ret)
        ret = np.where(invalid & (inv_kind == 0), err_unknown[unknown], ret)
        ret = np.where(
            invalid & (inv_kind == 1),
            P['{"error": "Invalid JSON in arguments: Expecting \',\' delimiter"}'],
            ret,
        )
        ret = np.where(invalid & (inv_kind == 2), err_missing[m], ret)
        _put(so, has_call, 0, ret)
        _put(so, clarify, 0, reply_piece[g_of])
        _put(so, tell, 0, P["Great, thank you!"])
        _put(so, closing, 0, P["No, that's all. Thank you!"])

    reward = (score.max(axis=1) >= 1.0).astype(np.float64)
    tools_json = json.dumps(TOOL_SPECS)
    meta = [
        f'{{"env": "synthetic_retail", "task": {json.dumps(tasks[g], ensure_ascii=False)}, '
        f'"gold": {{"cancelled_order": {json.dumps(json.loads(calls_args[g][2])["order_id"])}}}, '
        f'"tools": {tools_json}}}'
        for g in range(G)
    ]
    return _Built(
        seg,
        fstart,
        flen,
        role,
        is_error,
        score,
        prev_score,
        call_name,
        call_args,
        reward,
        1.0 - n_invalid / K,
        [meta[g] for g in g_of],
        "openai_tools",
        "synth:tool",
    )


# ---- tables -----------------------------------------------------------------------------------------------------
def _list_array(offsets: np.ndarray, values: pa.Array, valid: np.ndarray | None = None) -> pa.Array:
    offs = pa.array(offsets.astype(np.int32))
    if valid is None:
        return pa.ListArray.from_arrays(offs, values)
    return pa.ListArray.from_arrays(offs, values, mask=pa.array(~valid))


def _tables(
    b: _Built, s: SynthSettings, group_ids: np.ndarray, pool: _Pool, rng: np.random.Generator
) -> tuple[pa.Table, pa.Table]:
    N, n_steps, _ = b.seg_piece.shape
    K = s.turns
    n_rows = N * n_steps
    # segment byte ranges -> one gather over the pool buffer
    piece = b.seg_piece.reshape(-1)
    starts = np.where(piece >= 0, pool.start[np.maximum(piece, 0)], b.filler_start.reshape(-1))
    lens = np.where(
        piece >= 0, pool.len[np.maximum(piece, 0)], np.where(piece == -2, b.filler_len.reshape(-1), 0)
    )
    step_bytes = lens.reshape(n_rows, MAXSEG).sum(axis=1)
    nz = lens > 0
    seg_s, seg_l = starts[nz], lens[nz]
    out_pos = np.cumsum(seg_l) - seg_l
    total = int(seg_l.sum())
    gather = np.arange(total, dtype=np.int64) - np.repeat(out_pos - seg_s, seg_l)
    data = pool.buf[gather]
    offsets = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(step_bytes, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("batch too large for int32 offsets: lower batch_groups")
    content = pa.StringArray.from_buffers(n_rows, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))
    # tokens: one per byte; offset = char index of the byte within its content
    char_idx = np.cumsum((data & 0xC0) != 0x80) - 1
    first_char = np.concatenate([char_idx, [0]])[offsets[:-1]]
    tok_offsets = (char_idx - np.repeat(first_char, step_bytes)).astype(np.int32)
    token_ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(data.astype(np.int32)))
    token_offsets = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tok_offsets))
    role = b.role.reshape(-1)
    is_asst = role == ASSISTANT
    # logprobs + critic values on assistant tokens only
    asst_bytes = np.where(is_asst, step_bytes, 0)
    a_off = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(asst_bytes, out=a_off[1:])
    n_a = int(a_off[-1])
    logprobs = rng.standard_exponential(n_a, dtype=np.float32)
    logprobs *= np.float32(-0.03)  # most tokens: p close to 1
    heavy = np.flatnonzero(rng.random(n_a, dtype=np.float32) < 0.12)  # a heavy tail of unlikely tokens
    logprobs[heavy] = np.maximum(-rng.gamma(0.8, 2.0, len(heavy)), -25.0)
    turn_prev = np.zeros((N, n_steps))
    turn_prev[:, 2::2] = b.prev_score
    base = 0.2 + 0.6 * turn_prev.reshape(-1)
    values = rng.standard_normal(n_a, dtype=np.float32)
    values *= np.float32(0.03)
    values += np.repeat(base.astype(np.float32), asst_bytes)
    score: np.ndarray = np.full((N, n_steps), np.nan)
    score[:, 2::2] = b.score
    score = score.reshape(-1)
    # ids
    group_str = np.array([f"r{s.round}-g{g:06d}" for g in group_ids], dtype=object)
    sample = np.tile(np.arange(s.samples, dtype=np.int32), len(group_ids))
    traj_ids = [f"{group_str[i // s.samples]}-s{i % s.samples:02d}" for i in range(N)]
    traj_arr = pa.array(traj_ids, pa.string())
    step_traj = np.repeat(np.arange(N), n_steps)
    turn: np.ndarray = np.zeros((N, n_steps), dtype=np.int32)
    turn[:, 2::2] = np.arange(1, K + 1)
    turn[:, 3::2] = np.arange(1, K)
    turn = turn.reshape(-1)
    # tool calls (one per assistant turn that calls a tool) and tool_call_id on its observation
    names = pa.array(pool.strings, pa.string())
    call_name: np.ndarray = np.full((N, n_steps), -1, dtype=np.int64)
    call_name[:, 2::2] = b.call_name
    call_args: np.ndarray = np.full((N, n_steps), -1, dtype=np.int64)
    call_args[:, 2::2] = b.call_args
    call_name, call_args = call_name.reshape(-1), call_args.reshape(-1)
    has_call = call_name >= 0
    rows_call = np.flatnonzero(has_call)
    call_nums = rng.integers(0, 2**62, len(rows_call))
    call_ids = pa.array([f"call_{x:016x}" for x in call_nums.tolist()], pa.string())
    struct = pa.StructArray.from_arrays(
        [call_ids, names.take(pa.array(call_name[rows_call])), names.take(pa.array(call_args[rows_call]))],
        fields=list(steps_schema.TOOL_CALL),
    )
    tc_off = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(has_call, out=tc_off[1:])
    tool_calls = _list_array(tc_off, struct, has_call)
    id_of_row = np.full(n_rows, -1, dtype=np.int64)
    id_of_row[rows_call] = np.arange(len(rows_call))
    obs_rows = rows_call + 1
    obs_rows = obs_rows[(obs_rows < n_rows) & (role[np.minimum(obs_rows, n_rows - 1)] == TOOL)]
    tcid_idx = np.full(n_rows, -1, dtype=np.int64)
    tcid_idx[obs_rows] = id_of_row[obs_rows - 1]
    tool_call_id = call_ids.take(pa.array(tcid_idx, mask=tcid_idx < 0))
    steps = pa.table(
        {
            "round": pa.array(np.full(n_rows, s.round, dtype=np.int32)),
            "traj_id": traj_arr.take(pa.array(step_traj)),
            "step_idx": pa.array(np.tile(np.arange(n_steps, dtype=np.int32), N)),
            "role": pa.array(ROLE_NAMES[role].astype(object), pa.string()),
            "turn": pa.array(turn, pa.int32(), mask=turn == 0),
            "content": content,
            "tool_calls": tool_calls,
            "tool_call_id": tool_call_id,
            "is_error": pa.array(b.is_error.reshape(-1)),
            "token_ids": token_ids,
            "token_offsets": token_offsets,
            "logprobs": _list_array(a_off, pa.array(logprobs), is_asst),
            "logprob_source": pc.if_else(pa.array(is_asst), "synthetic", pa.scalar(None, pa.string())),
            "values": _list_array(a_off, pa.array(values), is_asst),
            "verifier_score": pa.array(score, pa.float64(), mask=~is_asst),
        },
        schema=steps_schema.SCHEMA,
    )
    comp_keys = pa.array(np.tile(np.array(["correct", "format"], dtype=object), N), pa.string())
    comp_vals = pa.array(np.stack([b.reward, b.fmt], axis=1).reshape(-1), pa.float64())
    components = pa.MapArray.from_arrays(
        pa.array(np.arange(0, 2 * N + 1, 2, dtype=np.int32)), comp_keys, comp_vals
    )
    traj = pa.table(
        {
            "round": pa.array(np.full(N, s.round, dtype=np.int32)),
            "traj_id": traj_arr,
            "group_id": pa.array(np.repeat(group_str, s.samples), pa.string()),
            "sample_idx": pa.array(sample),
            "reward": pa.array(b.reward, pa.float64()),
            "reward_components": components,
            "source": pa.array([b.source] * N, pa.string()),
            "action_format": pa.array([b.action_format] * N, pa.string()),
            "policy_version": pa.array([s.policy_version] * N, pa.string()),
            "meta": pa.array(b.meta, pa.string()),
        },
        schema=traj_schema.SCHEMA,
    )
    return traj, steps


def generate_batch(settings: SynthSettings, first_group: int, n_groups: int) -> tuple[pa.Table, pa.Table]:
    """Groups [first_group, first_group + n_groups) of the round: (trajectories, steps), sorted by traj_id
    (mixed: the search groups take the lower ids, the tool groups the rest, so the two pieces concatenate in
    order and readers never sort)."""
    s = settings
    rng = np.random.default_rng([s.seed, s.round, first_group])
    text, word_starts = _corpus(max(8 * s.tokens, 1))
    if s.kind == "mixed":
        n_search = int((rng.random(n_groups) >= 0.5).sum())
        is_tool = np.arange(n_groups) >= n_search
    else:
        is_tool = np.full(n_groups, s.kind == "tool")
    group_ids = np.arange(first_group, first_group + n_groups)
    pieces = []
    for kind_is_tool, builder in ((False, _build_search), (True, _build_tool)):
        chosen = group_ids[is_tool == kind_is_tool]
        if len(chosen) == 0:
            continue
        pool = _Pool(text)
        built = builder(rng, s, len(chosen), pool, word_starts)
        pool.finish()
        pieces.append(_tables(built, s, chosen, pool, rng))
    if len(pieces) == 1:
        return pieces[0]
    # search groups (lower ids) first, then tool groups: in traj_id order
    return (
        pa.concat_tables([p[0] for p in pieces]).combine_chunks(),
        pa.concat_tables([p[1] for p in pieces]).combine_chunks(),
    )


def iter_batches(settings: SynthSettings) -> Iterator[tuple[pa.Table, pa.Table]]:
    """The round as batches of `batch_groups` whole groups (the unit a lake part holds). A writer may generate
    the next batch while it writes this one (`warehouse.rounds.prefetched`)."""
    for first in range(0, settings.groups, settings.batch_groups):
        yield generate_batch(settings, first, min(settings.batch_groups, settings.groups - first))


def generate(settings: SynthSettings) -> tuple[pa.Table, pa.Table]:
    """The whole round in memory (small rounds: tests, demos)."""
    batches = list(iter_batches(settings))
    return (
        pa.concat_tables([b[0] for b in batches]).combine_chunks(),
        pa.concat_tables([b[1] for b in batches]).combine_chunks(),
    )
