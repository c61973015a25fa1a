"""What the synthetic environments share: the settings, the names and filler text they draw from, the pool
of text pieces a batch's contents are cut from, and the (trajectory, step) arrays an environment fills
(`Built`), which `pipeline.synth.tables` turns into tables."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

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
FIRST = "Margaret Alden Beatrice Caspian Delphine Emeric Fiorella Gideon Henrike Isidore Jolanda Kasimir Leopold Mireille Nikolai Ottilie Percival Quintus Rosalind Severin Theodora Ulric Valentina Wendelin Xaver Yolanda Zebulon".split()
LAST = "Holloway Ashcombe Brightwater Castellanos Dunmore Everhart Fairweather Greenleaf Hartigan Ingersoll Jessop Kettering Lindqvist Montgomery Northcott Oyelaran Pemberton Quenneville Rothschild Stanhope Thornbury Underhill Vanderbilt Whitcombe Yardley".split()
CITIES = "Edinburgh Valparaíso Kraków Montevideo Trondheim Ljubljana Winnipeg Brisbane Salzburg Cartagena Tbilisi Ostrava".split()


@functools.lru_cache(maxsize=4)
def corpus(min_chars: int) -> tuple[str, np.ndarray]:
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


class Pool:
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
class Built:
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
def filler(
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


def turn_lengths(rng: np.random.Generator, shape: tuple[int, ...], mean: float) -> np.ndarray:
    return rng.gamma(6.0, mean / 6.0, shape)


def put(arr: np.ndarray, mask: np.ndarray, col: int, value) -> None:
    """arr[..., col] = value where mask (value broadcast or an array shaped like mask)."""
    view = arr[..., col]
    if np.ndim(value):
        view[mask] = np.asarray(value)[mask]
    else:
        view[mask] = value


class Segments:
    """Every step's text as up to MAXSEG segments: a pool piece id (-1 empty, -2 a filler range), and the
    corpus byte range of each filler segment; arrays indexed [trajectory, step, segment]."""

    def __init__(self, n: int, n_steps: int) -> None:
        self.piece = np.full((n, n_steps, MAXSEG), -1, dtype=np.int64)
        self.start = np.zeros((n, n_steps, MAXSEG), dtype=np.int64)
        self.len = np.zeros((n, n_steps, MAXSEG), dtype=np.int64)

    def filler(self, rng: np.random.Generator, word_starts: np.ndarray, step: int, col: int, n_bytes) -> None:
        """The corpus range of segment `col` of `step`, about n_bytes per trajectory (where that segment is a
        filler, -2)."""
        self.start[:, step, col], self.len[:, step, col] = filler(rng, word_starts, n_bytes)


class TurnState:
    """Each trajectory's scores over its turns and its earlier valid actions (vectors over trajectories)."""

    def __init__(self, N: int, K: int) -> None:
        self.score = np.zeros((N, K))
        self.prev_score = np.zeros((N, K))  # the score before each turn (for critic values)
        self.hist = np.zeros((N, K), dtype=np.int64)  # earlier valid actions (query ids, milestones)
        self.n_hist = np.zeros(N, dtype=np.int64)
        self.n_invalid = np.zeros(N)
        self.prev = np.zeros(N)

    def earlier(self, u: np.ndarray) -> np.ndarray:
        """One earlier valid action per trajectory, picked by the uniforms u (slot 0 where there is none)."""
        pick = np.minimum((u * self.n_hist).astype(np.int64), np.maximum(self.n_hist - 1, 0))
        return self.hist[np.arange(len(u)), pick]

    def record(self, k: int, score: np.ndarray, invalid: np.ndarray) -> None:
        self.prev_score[:, k], self.score[:, k] = self.prev, score
        self.prev = score
        self.n_invalid += invalid

    def remember(self, valid: np.ndarray, action: np.ndarray) -> None:
        """The actions of this turn's valid (new) actions, for later repeats."""
        self.hist[np.flatnonzero(valid), self.n_hist[valid]] = action[valid]
        self.n_hist += valid


def base_roles(n: int, n_steps: int) -> np.ndarray:
    """(n, n_steps) roles: system, user, then assistant and user (an observation) alternating."""
    role = np.full((n, n_steps), USER, dtype=np.int8)
    role[:, 0] = SYSTEM
    role[:, 2::2] = ASSISTANT
    return role


def step_layout(n: int, k: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Steps per trajectory (system, user, then assistant/observation alternating), and per-step turn."""
    n_steps = 2 * k + 1
    turn = np.zeros(n_steps, dtype=np.int32)
    turn[2::2] = np.arange(1, k + 1)
    turn[3::2] = np.arange(1, k)
    return n_steps, np.broadcast_to(turn, (n, n_steps)).copy(), np.arange(n_steps)
