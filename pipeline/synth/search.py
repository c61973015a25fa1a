"""The search environment (`action_format="search_r1"`): Search-R1 assistant turns (`<think>` + `<search>` or
`<answer>`), `<information>` observations, per-turn evidence and answer scores (see `pipeline.synth`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from pipeline.synth.common import (
    CITIES,
    FIRST,
    LAST,
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
_Q = len(_ASPECTS)  # distinct queries per group (each also as a near repeat: 2 x _Q query pieces)
_PIECES = (
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


@dataclass
class _Groups:
    """A batch's search groups as pool pieces, indexed by group (query pieces: [group, query id])."""

    questions: list[str]
    gold: list[str]
    gold_piece: np.ndarray
    wrong_piece: np.ndarray  # (G, 3)
    query_piece: np.ndarray  # (G, 2Q): the queries, then each with an "s" appended (its near repeat)
    entity_piece: np.ndarray
    other_piece: np.ndarray  # another person's name (a doc title without the evidence)
    system_piece: int
    user_piece: np.ndarray


def _answer_text(code: int, qtype: int) -> str:
    if qtype == 1:
        return CITIES[code % len(CITIES)]
    return f"{FIRST[code % len(FIRST)]} {LAST[(code // len(FIRST)) % len(LAST)]}"


def _groups(rng: np.random.Generator, G: int, pool: Pool) -> _Groups:
    """Group-level text: entity, question, gold and wrong answers, query pool, doc titles."""
    first = rng.integers(0, len(FIRST), G)
    last = rng.integers(0, len(LAST), G)
    ents = [f"{FIRST[a]} {LAST[b]}" for a, b in zip(first, last, strict=True)]
    qtype = rng.integers(0, len(_QUESTIONS), G)
    questions = [_QUESTIONS[q].format(e=e) for q, e in zip(qtype, ents, strict=True)]
    answers = rng.integers(0, len(FIRST) * len(LAST) + len(CITIES), (G, 4))
    ans_txt = [[_answer_text(int(answers[g, j]), int(qtype[g])) for j in range(4)] for g in range(G)]
    for g in range(G):  # wrong answers differ from the gold one
        for j in range(1, 4):
            if ans_txt[g][j] == ans_txt[g][0]:
                ans_txt[g][j] = ans_txt[g][j] + " Jr."
    gold_piece = pool.ids(a[0] for a in ans_txt)
    wrong_piece = pool.ids(a[j] for a in ans_txt for j in range(1, 4)).reshape(G, 3)
    order = np.argsort(rng.random((G, _Q)), axis=1)  # per-group query order
    qtext = [
        [_ASPECTS[order[g, j]].format(e=ents[g].lower() if j % 3 == 0 else ents[g]) for j in range(_Q)]
        for g in range(G)
    ]
    query_piece = np.array([[pool.add(q) for q in row] + [pool.add(q + "s") for q in row] for row in qtext])
    entity_piece = pool.ids(ents)
    other_piece = pool.ids(
        f"{FIRST[(a + 7) % len(FIRST)]} {LAST[(b + 3) % len(LAST)]}" for a, b in zip(first, last, strict=True)
    )
    system_piece = pool.add(_SEARCH_SYSTEM)
    user_piece = pool.ids(_SEARCH_PROMPT.format(q=q) for q in questions)
    return _Groups(
        questions,
        [a[0] for a in ans_txt],
        gold_piece,
        wrong_piece,
        query_piece,
        entity_piece,
        other_piece,
        system_piece,
        user_piece,
    )


class _State(TurnState):
    """Each trajectory's progress over its turns; its history holds the query ids (0..2Q) searched."""

    def __init__(self, N: int, K: int) -> None:
        super().__init__(N, K)
        self.n_new = np.zeros(N, dtype=np.int64)
        self.evidence = np.zeros(N)
        self.last_ans = np.full(N, -1.0)  # score of the last valid answer, -1 = none yet
        self.succ = np.zeros(N, dtype=bool)


@dataclass
class _Turn:
    """What each trajectory does on one turn."""

    invalid: np.ndarray
    answer: np.ndarray
    search: np.ndarray
    qid: np.ndarray  # the query searched (0..2Q)
    correct: np.ndarray


def _play_turn(
    st: _State, u: np.ndarray, k: int, s: SynthSettings, skill: np.ndarray, qshift: np.ndarray
) -> _Turn:
    """Turn k's actions and scores from its uniforms u (N, 8); updates the state."""
    K = s.turns
    invalid = u[:, 0] < s.invalid_rate
    p_answer = np.where(st.succ, 0.9, 0.1 + 0.6 * st.evidence)
    answer = ~invalid & ((u[:, 1] < p_answer) | (k == K - 1))
    search = ~invalid & ~answer
    repeat = search & (st.n_hist > 0) & (u[:, 2] < s.repeat_rate)
    near = repeat & (u[:, 3] < s.near_share)
    new_q = (st.n_new + qshift) % _Q
    earlier = st.earlier(u[:, 4])
    near_of = np.where(earlier >= _Q, earlier - _Q, earlier + _Q)
    qid = np.where(repeat, np.where(near, near_of, earlier), new_q)
    st.n_new += (~repeat).astype(np.int64)  # invalid turns use up a fresh query too
    # evidence grows on new, valid searches only
    gain = np.where(search & ~repeat & (u[:, 5] < 0.85), skill * (0.1 + 0.35 * u[:, 6]), 0.0)
    st.evidence = np.minimum(st.evidence + gain, 0.95)
    correct = answer & np.where(st.succ, u[:, 7] < 0.9, u[:, 7] < st.evidence**1.5 * (0.5 + 0.5 * skill))
    ans_score = np.where(correct, 1.0, np.round(st.evidence, 2))
    st.last_ans = np.where(answer, ans_score, st.last_ans)
    r = np.where(answer, ans_score, np.where(search, np.maximum(st.evidence, st.last_ans), 0.0))
    r = np.where(invalid, np.maximum(st.prev - 0.1, 0.0), r)
    r = np.clip(np.round(r, 2), 0.0, 1.0)
    st.record(k, r, invalid)
    st.succ |= correct
    st.remember(search, qid)
    return _Turn(invalid, answer, search, qid, correct)


def _write_assistant(
    rng: np.random.Generator,
    segs: Segments,
    step: int,
    t: _Turn,
    grp: _Groups,
    g_of: np.ndarray,
    P: dict[str, int],
    lead_piece: np.ndarray,
    word_starts: np.ndarray,
    think_len: np.ndarray,
) -> None:
    """The assistant text of one turn: a lead and filler in <think>, then the action (or a malformed one)."""
    N = len(g_of)
    inv_kind = rng.integers(0, 3, N)
    q_piece = grp.query_piece[g_of, t.qid]
    wrong = grp.wrong_piece[g_of, rng.integers(0, 3, N)]
    a_piece = np.where(t.correct, grp.gold_piece[g_of], wrong)
    sa = segs.piece[:, step]
    sa[:, 0] = lead_piece[rng.integers(0, len(lead_piece), N)]
    sa[:, 1] = -2
    segs.filler(rng, word_starts, step, 1, np.maximum(think_len, 8))
    sa[:, 2] = P["</think>\n"]
    search, invalid, answer = t.search, t.invalid, t.answer
    put(sa, search | invalid & (inv_kind < 2), 3, P["<search> "])
    put(sa, search | invalid, 4, q_piece)
    put(sa, search | invalid & (inv_kind == 1), 5, P[" </search>"])
    put(sa, answer, 3, P["<answer> "])
    put(sa, answer, 4, a_piece)
    put(sa, answer, 5, P[" </answer>"])
    both = invalid & (inv_kind == 1)
    put(sa, both, 5, P[" </search>\n<answer> "])
    put(sa, both, 6, wrong)
    put(sa, both, 7, P[" </answer>"])
    plain = invalid & (inv_kind == 2)
    put(sa, plain, 3, P["I will look up "])
    put(sa, plain, 5, P[" next."])


def _write_observation(
    rng: np.random.Generator,
    segs: Segments,
    step: int,
    t: _Turn,
    grp: _Groups,
    g_of: np.ndarray,
    P: dict[str, int],
    evidence: np.ndarray,
    word_starts: np.ndarray,
    mean_tokens: float,
) -> None:
    """The user step after a turn: two documents for a search (the second holds the gold answer once the
    evidence reaches 0.5), an acknowledgement for an answer, the Search-R1 message for an invalid action."""
    so, search = segs.piece[:, step], t.search
    put(so, t.invalid, 0, P[_SEARCH_INVALID])
    put(so, t.answer, 0, P[_SEARCH_ACK])
    so[search, 0] = P['\n\n<information>Doc 1(Title: "']
    so[search, 1] = grp.entity_piece[g_of][search]
    so[search, 2] = P['") ']
    so[search, 3] = -2
    so[search, 4] = P['\nDoc 2(Title: "']
    so[search, 5] = np.where(evidence >= 0.5, grp.gold_piece[g_of], grp.other_piece[g_of])[search]
    so[search, 6] = P['") ']
    so[search, 7] = -2
    so[search, 8] = P["</information>\n\n"]
    for col in (3, 7):
        n_bytes = np.maximum(turn_lengths(rng, (len(g_of),), mean_tokens / 4) - 20, 8)
        segs.filler(rng, word_starts, step, col, n_bytes)


def build_search(
    rng: np.random.Generator, s: SynthSettings, n_groups: int, pool: Pool, word_starts: np.ndarray
) -> Built:
    """`n_groups` search groups of `s.samples` trajectories, played turn by turn (vectorised over
    trajectories)."""
    G, S, K, T = n_groups, s.samples, s.turns, float(s.tokens)
    N = G * S
    n_steps, _, _ = step_layout(N, K)
    grp = _groups(rng, G, pool)
    g_of = np.repeat(np.arange(G), S)
    skill = np.clip(rng.beta(2.0, 2.0, G)[g_of] + rng.normal(0, 0.1, N), 0.05, 1.0)
    qshift = rng.integers(0, _Q, N)  # where each sample starts in its group's query order
    P = {t: pool.add(t) for t in _PIECES}
    lead_piece = pool.ids(_THINK_LEADS)
    segs = Segments(N, n_steps)
    segs.piece[:, 0, 0] = grp.system_piece
    segs.piece[:, 1, 0] = grp.user_piece[g_of]
    st = _State(N, K)
    think_len = turn_lengths(rng, (N, K), T) - 103.0  # lead, tags, query
    for k in range(K):
        step = 2 + 2 * k
        turn = _play_turn(st, rng.random((N, 8)), k, s, skill, qshift)
        _write_assistant(rng, segs, step, turn, grp, g_of, P, lead_piece, word_starts, think_len[:, k])
        if k < K - 1:
            _write_observation(rng, segs, step + 1, turn, grp, g_of, P, st.evidence, word_starts, T)
    meta = [
        json.dumps(
            {
                "env": "synthetic_search",
                "question": grp.questions[g],
                "gold_answers": [grp.gold[g]],
                "data_source": "synth",
            },
            ensure_ascii=False,
        )
        for g in range(G)
    ]
    return Built(
        segs.piece,
        segs.start,
        segs.len,
        base_roles(N, n_steps),
        np.zeros((N, n_steps), dtype=bool),
        st.score,
        st.prev_score,
        np.full((N, K), -1),
        np.full((N, K), -1),
        np.where(st.last_ans == 1.0, 1.0, 0.0),
        1.0 - st.n_invalid / K,
        [meta[g] for g in g_of],
        "search_r1",
        "synth:search",
    )
