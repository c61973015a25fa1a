"""QA verifiers: Search-R1 exact match (qa_em.py) and SQuAD-style token F1, both after normalize_answer."""

from __future__ import annotations

import re
import string
from collections import Counter

from pipeline.verifiers import Verdict, gold_answers, register_verifier

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(s: str) -> str:
    """Search-R1 / SQuAD: lower, drop punctuation and articles, collapse whitespace."""

    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def extract_answer(text: str) -> str | None:
    """The last <answer>...</answer> (Search-R1 scores the last one); the whole text when there is no tag."""
    matches = _ANSWER.findall(text)
    if matches:
        return matches[-1].strip()
    if "<answer>" in text:
        return None
    return text.strip()


def _gold_or_fail(meta: dict, name: str) -> list[str] | Verdict:
    golds = gold_answers(meta)
    if not golds:
        return Verdict(0.0, name, ok=False, error="no gold answer in meta (golden_answers/answers/answer)")
    return golds


@register_verifier("em")
def exact_match(output: str, meta: dict) -> Verdict:
    golds = _gold_or_fail(meta, "em")
    if isinstance(golds, Verdict):
        return golds
    answer = extract_answer(output)
    if answer is None:
        return Verdict(0.0, "em", error="no complete <answer> tag")
    pred = normalize_answer(answer)
    return Verdict(1.0 if any(normalize_answer(g) == pred for g in golds) else 0.0, "em")


def f1_score(pred: str, gold: str) -> float:
    p, g = normalize_answer(pred).split(), normalize_answer(gold).split()
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


@register_verifier("f1")
def token_f1(output: str, meta: dict) -> Verdict:
    golds = _gold_or_fail(meta, "f1")
    if isinstance(golds, Verdict):
        return golds
    answer = extract_answer(output)
    if answer is None:
        return Verdict(0.0, "f1", error="no complete <answer> tag")
    return Verdict(max(f1_score(answer, g) for g in golds), "f1")
