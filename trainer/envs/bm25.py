"""A small Okapi BM25 retriever in NumPy (dense term matrix: for corpora of up to a few thousand docs)."""

from __future__ import annotations

import re

import numpy as np

_WORD = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset(
    "a an and are as at be by did do does for from has have he her his how in is it its of on or she that the "
    "their them there they this to was were what when where which who whom whose why with".split()
)


def tokenize(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


class BM25:
    def __init__(self, docs: list[str], k1: float = 1.5, b: float = 0.75):
        toks = [tokenize(d) for d in docs]
        self.vocab = {w: i for i, w in enumerate(sorted({w for t in toks for w in t}))}
        tf = np.zeros((len(docs), len(self.vocab)), dtype=np.float64)
        for d, t in enumerate(toks):
            idx, cnt = np.unique(
                np.fromiter((self.vocab[w] for w in t), dtype=np.int64, count=len(t)), return_counts=True
            )
            tf[d, idx] = cnt
        dl = tf.sum(axis=1, keepdims=True)
        avgdl = max(float(dl.mean()), 1e-9)
        df = (tf > 0).sum(axis=0)
        n = len(docs)
        self.idf = np.log(1.0 + (n - df + 0.5) / (df + 0.5))
        self.weights = tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))  # (docs, vocab)

    def scores(self, query: str) -> np.ndarray:
        q = [self.vocab[w] for w in tokenize(query) if w in self.vocab]
        if not q:
            return np.zeros(self.weights.shape[0])
        idx, cnt = np.unique(np.asarray(q), return_counts=True)
        return self.weights[:, idx] @ (self.idf[idx] * cnt)

    def top(self, query: str, k: int) -> list[int]:
        """Indices of the k best documents (ties broken by document order); docs scoring 0 are left out."""
        s = self.scores(query)
        order = np.lexsort((np.arange(len(s)), -s))[:k]
        return [int(i) for i in order if s[i] > 0]
