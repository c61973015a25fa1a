"""Text helpers of the detectors: Search-R1 answer normalisation, n-gram sets, Jaccard, <think> masking."""

from __future__ import annotations

import re
import string
import unicodedata
from functools import lru_cache

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_THINK = re.compile(r"<think>.*?</think>", re.S)
_LEADING_THINK = re.compile(r"\s*<think>.*?</think>\s*", re.S)


def normalize_answer(s: str) -> str:
    """Search-R1 / SQuAD normalize_answer: lower-case, drop punctuation, drop a/an/the, collapse spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def normalize_query(s: str) -> str:
    """A query as the query rules compare it: NFKC (so NFC / NFD / compatibility forms of one text match),
    then `normalize_answer`."""
    return normalize_answer(unicodedata.normalize("NFKC", s))


_TOKEN = re.compile(r"[^\s,;()\[\]{}\"'`]+")
_EDGE = re.compile(r"^[^\w]+|[^\w]+$")


@lru_cache(maxsize=1 << 16)  # pure; logs repeat their texts (a query tool's arguments, a tool's note)
def identifiers(s: str) -> frozenset[str]:
    """Identifier and number tokens of a text (NFKC, lower-cased): tokens with a digit (L1002, 2024-05-20,
    1914), with an underscore (user ids), or codes in capitals (JFK, EHGLP). Two queries whose sets differ ask
    about different things, however similar their letters."""
    out = set()
    for tok in _TOKEN.findall(unicodedata.normalize("NFKC", s)):
        tok = _EDGE.sub("", tok)
        if not tok:
            continue
        letters = [c for c in tok if c.isalpha()]
        if (
            any(c.isdigit() for c in tok)
            or "_" in tok
            or (len(letters) >= 2 and all(c.isupper() for c in letters))
        ):
            out.add(tok.lower())
    return frozenset(out)


_STOP = frozenset(
    "a an the of in on at to for from by with and or is are was were be which what who whom whose when where "
    "how did does do".split()
)


def content_words(normalised: str) -> frozenset[str]:
    """The content words of a normalised query, lightly stemmed (a trailing s dropped), stop words left out:
    a query whose words are all among an earlier query's re-asks it (reordered, inflected, shortened); one that
    adds a word refines it."""
    return frozenset(
        w[:-1] if len(w) > 3 and w.endswith("s") else w for w in normalised.split() if w not in _STOP
    )


@lru_cache(maxsize=1 << 16)
def ngrams(s: str, n: int = 3, unit: str = "char") -> frozenset:
    """Character (or word) n-grams of a normalised string; a string shorter than n is its own single gram."""
    items = list(s) if unit == "char" else s.split()
    if len(items) < n:
        return frozenset([tuple(items)]) if items else frozenset()
    return frozenset(tuple(items[i : i + n]) for i in range(len(items) - n + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def mask_think(content: str) -> str:
    """<think>...</think> blocks replaced by spaces of the same length (char positions are kept)."""
    if "<think>" not in content:
        return content
    return _THINK.sub(lambda m: " " * len(m.group(0)), content)


def turn_range(content: str, exclude_think: bool) -> tuple[int, int]:
    """Char range of the whole turn; with exclude_think, a leading <think>...</think> block is left out."""
    start, end = 0, len(content)
    if exclude_think:
        m = _LEADING_THINK.match(content)
        if m and m.end() < end:
            start = m.end()
    return start, end
