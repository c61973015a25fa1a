"""The labelled sample of C3 detector spans on the shipped real data (issue 24): the script that draws it.

    python tests/c3_sample.py            # print every sampled span with its context (to label it)
    python tests/c3_sample.py --table    # precision / recall per behaviour against tests/data/c3_labels.json

The sample (fixed seed, so it is the same on every run): from tau-bench v1 (gpt-4o airline), tau2-bench
(qwen2.5-7b airline) and FireAct (llama-2-7b HotpotQA):
- query_loop: up to 20 spans of the current detector per source;
- invalid_action: up to 15 spans per source;
- near_repetition: every span of the current detector, and every near repetition the previous rule flagged
  (tool name prefixed, arguments stripped of punctuation, char-trigram Jaccard >= 0.9 over every tool call):
  the spans the current rule dropped are labelled too, so recall is measured on the union.
Each item's id is `source|traj_id|step_idx|behavior`; `tests/data/c3_labels.json` maps it to [label, reason],
label "real" (the behaviour is there and undesirable) or "false". Precision of a behaviour = real / flagged by
the current detector; recall = flagged and real / real in the labelled union.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
LABELS = Path(__file__).resolve().parent / "data" / "c3_labels.json"
SOURCES = {
    "tau-bench": ("tau-bench", "tau_bench_v1/gpt-4o-airline.json"),
    "tau2": ("tau2-bench", "tau2_bench/qwen2.5-7b_airline_1trial.json"),
    "fireact": (
        "react",
        "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json",
    ),
}
PER_SOURCE = {"query_loop": 20, "invalid_action": 15}


def _issue_24_rules():
    from pipeline.detect.registry import DetectSettings

    return DetectSettings(loop_needs_no_change=False, free_text_min_words=10**6)


BEHAVIOURS = ("invalid_action", "query_loop", "near_repetition")


@dataclass
class Item:
    id: str
    source: str
    traj_id: str
    step_idx: int
    behavior: str
    rule: str
    flagged: bool  # by the current detector
    evidence: str
    context: str


def _views(source: str, real: Path = REAL):
    from pipeline.detect import traj_views
    from pipeline.ingest import ingest
    from pipeline.tokenize import ByteTokenizer

    fmt, rel = SOURCES[source]
    path = real / rel
    res = ingest(fmt, [(path.name, path.read_text())], tokenizer=ByteTokenizer())
    return traj_views(res.trajectories, res.steps)


def previous_near(view) -> list[tuple[int, str]]:
    """The previous near-repetition rule (before issue 24), for the recall side of the sample: every tool call
    (name prefixed, arguments as canonical JSON) and every search query, normalize_answer, char trigrams, Jaccard >= 0.9, >= 8 chars, no exact
    match; (step_idx, evidence)."""
    from pipeline.detect.builtin import parse_step
    from pipeline.detect.registry import DetectSettings
    from pipeline.detect.text import jaccard, ngrams, normalize_answer
    from pipeline.render import canonical_arguments

    settings = DetectSettings()
    seen: list[tuple[str, frozenset]] = []
    out = []
    for step in view.assistant_steps():
        parsed = parse_step(view, step, settings)
        if not parsed:
            continue
        cur = []
        calls = step.tool_calls or []
        for k, act in enumerate(parsed.actions):
            if view.action_format == "openai_tools" and calls and len(calls) == len(parsed.actions):
                text = f"{calls[k]['name']} {canonical_arguments(calls[k].get('arguments'))}"
            elif act.name == "search" and act.query is not None:
                text = act.query
            else:
                continue
            q = normalize_answer(text)
            g = ngrams(q)
            cur.append((q, g))
            if any(q == e for e, _ in seen) or len(q) < 8:
                continue
            best = max(((jaccard(g, g2), e) for e, g2 in seen), default=(0.0, ""))
            if best[0] >= 0.9:
                out.append((step.step_idx, json.dumps({"query": q[:120], "earlier": best[1][:120]})))
        seen += cur
    return out


def _context(view, step_idx: int, behavior: str) -> str:
    """What a labeller reads (`c3_sample34._context`): the reward, the steps before, the flagged step and the
    observation after it."""
    from c3_sample34 import _context as context

    return context(view, step_idx, behavior)


def draw(real: Path = REAL) -> list[Item]:
    from pipeline.detect import run_detectors
    from pipeline.detect.registry import DetectSettings

    rng = random.Random(24)
    items: list[Item] = []
    for source in SOURCES:
        views = _views(source, real)
        by_id = {v.traj_id: v for v in views}
        # the sample is drawn from what the issue-24 rules flagged (every repeat a loop, near repetition of
        # query tools only), so the labels made then still apply; `flagged` is what the current rules flag
        hits = run_detectors(views, _issue_24_rules())
        now = {
            (tid, h.step_idx, h.behavior)
            for tid, h, _ in run_detectors(_views(source, real), DetectSettings())
        }
        found: dict[str, list] = {b: [] for b in BEHAVIOURS}
        for tid, hit, _ in sorted(hits, key=lambda h: (h[0], h[1].step_idx, h[1].behavior, h[1].rule)):
            found[hit.behavior].append((tid, hit.step_idx, hit.rule, hit.evidence, True))
        previous = [
            (v.traj_id, idx, "previous.char_jaccard", ev, False)
            for v in views
            for idx, ev in previous_near(v)
        ]
        flagged_near = {(t, i) for t, i, *_ in found["near_repetition"]}
        chosen = {
            b: rng.sample(found[b], min(PER_SOURCE[b], len(found[b])))
            for b in ("query_loop", "invalid_action")
        }
        chosen["near_repetition"] = found["near_repetition"] + [
            p for p in previous if (p[0], p[1]) not in flagged_near
        ]
        for behavior, rows in chosen.items():
            seen = set()
            for tid, idx, rule, ev, _flagged in rows:
                key = f"{source}|{tid}|{idx}|{behavior}"
                if key in seen:
                    continue
                seen.add(key)
                items.append(
                    Item(
                        key,
                        source,
                        tid,
                        idx,
                        behavior,
                        rule,
                        (tid, idx, behavior) in now,
                        ev,
                        _context(by_id[tid], idx, behavior),
                    )
                )
    return items


def scores(items: list[Item], labels: dict[str, list[str]]) -> dict[str, dict]:
    """Per behaviour: flagged, real among flagged (precision), real in the labelled union (recall)."""
    from c3_sample34 import scores as scores_of

    return scores_of(items, labels, "flagged")  # type: ignore[arg-type]


def main(argv: list[str]) -> None:
    items = draw()
    if "--table" in argv:
        labels = json.loads(LABELS.read_text())
        for b, s in scores(items, labels).items():
            print(b, s)
        return
    for it in items:
        print(f"### {it.id} rule={it.rule} flagged={it.flagged}\n{it.evidence[:300]}\n{it.context}\n")
    print(len(items), "items", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
