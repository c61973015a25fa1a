"""The labelled samples of C3 detector spans on the shipped real data, and the script that draws them.

    python tests/c3_sample.py --sample 24            # print every span of a sample with what a labeller reads
    python tests/c3_sample.py --sample 24 --table    # precision / recall per behaviour against its labels
    python tests/c3_sample.py --table                # issue 34's sample (the default), before and after 34
    python tests/c3_sample.py --recall               # issue 34's recall side: trajectories without spans
    python tests/c3_sample.py --sample near --table  # every near repetition, with and without "learned nothing"

Issue 24's sample (seed 24, `draw`, labels in tests/data/c3_labels.json): from tau-bench v1 (gpt-4o airline),
tau2-bench (qwen2.5-7b airline) and FireAct (llama-2-7b HotpotQA), drawn from what the issue-24 rules flag
(every repeat a loop, near repetition of query tools only: `_issue_24_rules`), so the labels made then still
apply; `flagged` is what the current rules flag:
- query_loop: up to 20 spans per source;
- invalid_action: up to 15 spans per source;
- near_repetition: every span, and every near repetition the previous rule flagged (tool name prefixed,
  arguments stripped of punctuation, char-trigram Jaccard >= 0.9 over every tool call): the spans the current
  rule dropped are labelled too, so recall is measured on the union.

Issue 34's sample (seed 34, `draw_positive`, labels in tests/data/c3_labels_34.json): spans on steps with
positive GRPO advantage (the only ones where C3 changes credit), from tau2 airline, tau2 telecom (with a user,
and solo) and FireAct: the union of the spans of the current rules and of the issue-24 rules, up to `CAP` per
source and behaviour. Its recall side (`recall_sample`, seed 3434, tests/data/c3_recall_34.json): successful
trajectories on which the current rules flag nothing, each read whole.

The near-repetition sample (`draw_near`, labels in tests/data/c3_labels_near.json): positive-advantage steps
hold only 3 near repetitions in all these logs (and none in tau2 retail, ToolOrchestra's tau2 runs or FireAct's
GPT-4 fine-tuning trajectories), so every near repetition on any step of issue 34's sources and tau2 retail
(`NEAR_EXTRA`), under the rules now (`now`) and with `detect.near_needs_nothing_new=false` (`before`: the
thresholds alone), up to `NEAR_CAP` (seed 3435); `positive` says whether the step has positive advantage.

Each item's id is `source|traj_id|step_idx|behavior`; a label file maps it to [label, reason], label "real"
(the behaviour is there and is waste or invalid) or "false". Precision of a rule set = real / flagged by it;
recall = flagged and real / real in the labelled union.
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
LABELS = Path(__file__).resolve().parent / "data" / "c3_labels.json"
LABELS_34 = Path(__file__).resolve().parent / "data" / "c3_labels_34.json"
LABELS_NEAR = Path(__file__).resolve().parent / "data" / "c3_labels_near.json"
NEAR_CAP = 40
RECALL = Path(__file__).resolve().parent / "data" / "c3_recall_34.json"
FIREACT_7B = (
    "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json"
)
SOURCES = {  # issue 24's sample
    "tau-bench": ("tau-bench", "tau_bench_v1/gpt-4o-airline.json"),
    "tau2": ("tau2-bench", "tau2_bench/qwen2.5-7b_airline_1trial.json"),
    "fireact": ("react", FIREACT_7B),
}
SOURCES_34 = {  # issue 34's sample
    "tau2-airline": ("tau2-bench", "tau2_bench/qwen2.5-7b_airline_1trial.json"),
    "tau2-telecom-sft": ("tau2-bench", "tau2_bench/gpt-4.1-sft_telecom_default_1trial.json.gz"),
    "tau2-telecom-solo": ("tau2-bench", "tau2_bench/gpt-4.1_telecom_no-user_1trial.json.gz"),
    "tau2-telecom-solo-sft": ("tau2-bench", "tau2_bench/gpt-4.1-sft_telecom_no-user_1trial.json.gz"),
    "fireact-7b": ("react", FIREACT_7B),
    "fireact-13b": (
        "react",
        "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-13b-d_1000_0.7_2023-09-18-13-40-08.json.gz",
    ),
    "fireact-gpt-3.5": (
        "react",
        "fireact_hotpotqa/hotpotqa_dev_0_500_ft_gpt-3.5-turbo-0613_princeton-nlp__7woQRsdi_0.0_2023-09-21-16-19-51.json",
    ),
}
NEAR_EXTRA = {  # the near-repetition sample also reads these (fetched for it; they hold no near repetition)
    "tau2-retail": ("tau2-bench", "tau2_bench/gpt-4.1_retail_default_1trial.json.gz"),
    "tau2-retail-sft": ("tau2-bench", "tau2_bench/gpt-4.1-sft_retail_default_1trial.json.gz"),
}
PER_SOURCE = {"query_loop": 20, "invalid_action": 15}  # issue 24
CAP = 25  # issue 34: per source and behaviour
BEHAVIOURS = ("invalid_action", "query_loop", "near_repetition")


def _issue_24_rules():
    from pipeline.detect.registry import DetectSettings

    return DetectSettings(loop_needs_no_change=False, free_text_min_words=10**6, near_needs_nothing_new=False)


@dataclass
class Item:
    """A sampled span; `flagged` (also `now`): by the current rules; `before`: by the rules before issue 34
    (issue 34's sample only)."""

    id: str
    source: str
    traj_id: str
    step_idx: int
    behavior: str
    rule: str
    flagged: bool
    evidence: str
    context: str
    before: bool = False
    positive: bool = False

    @property
    def now(self) -> bool:
        return self.flagged


def read_source(rel: str, real: Path = REAL) -> tuple[str, str]:
    """(file name, text) of a shipped file; `.gz` ones are the unmodified file, compressed."""
    path = real / rel
    data = path.read_bytes()
    name = path.name
    if name.endswith(".gz"):
        data, name = gzip.decompress(data), name[:-3]
    return name, data.decode("utf-8")


def _batch(fmt: str, rel: str, real: Path = REAL):
    from pipeline.ingest import ingest
    from pipeline.tokenize import ByteTokenizer

    res = ingest(fmt, [read_source(rel, real)], tokenizer=ByteTokenizer())
    return res.trajectories, res.steps


def _views(source: str, real: Path = REAL):
    """Detector views of an issue-24 source."""
    from pipeline.detect import traj_views

    return traj_views(*_batch(*SOURCES[source], real))


def positive_steps(trajectories, steps) -> set[tuple[str, int]]:
    from pipeline.config import Config
    from pipeline.credit.process import process_batch

    adv = process_batch(trajectories, steps, ["grpo"], Config())[0]["grpo"]
    return {
        (t, i)
        for t, i, a in zip(
            adv["traj_id"].to_pylist(), adv["step_idx"].to_pylist(), adv["token_adv"].to_pylist(), strict=True
        )
        if a and max(a) > 0
    }


def previous_near(view) -> list[tuple[int, str]]:
    """The previous near-repetition rule (before issue 24), for the recall side of issue 24's sample: every
    tool call (name prefixed, arguments as canonical JSON) and every search query, normalize_answer, char
    trigrams, Jaccard >= 0.9, >= 8 chars, no exact match; (step_idx, evidence)."""
    from pipeline.detect.parse import parse_step
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
    """What a labeller reads: the reward, every step since the earlier call the span names (tool calls with a
    short result), the flagged step and what followed."""

    def brief(s, n):
        s = " ".join(str(s).split())
        return s if len(s) <= n else s[: n - 3] + "..."

    steps = view.steps
    pos = next(i for i, s in enumerate(steps) if s.step_idx == step_idx)
    lines = [f"reward={view.reward}"]
    lo = max(0, pos - (3 if behavior == "invalid_action" else 16))
    for s in steps[lo : pos + 3]:
        mark = ">>" if s.step_idx == step_idx else "  "
        if s.tool_calls:
            text = "; ".join(f"{c['name']}({brief(c.get('arguments'), 90)})" for c in s.tool_calls)
            if s.role == "assistant" and view.action_format == "react":
                text = brief(s.content, 400 if mark == ">>" else 160)
        else:
            text = brief(s.content, 400 if mark == ">>" else 140)
        lines.append(f"{mark}[{s.step_idx} {s.role} t{s.turn}] {text}")
    return "\n".join(lines)


def draw(real: Path = REAL) -> list[Item]:
    """Issue 24's sample (see the module doc)."""
    from pipeline.detect import run_detectors
    from pipeline.detect.registry import DetectSettings

    rng = random.Random(24)
    items: list[Item] = []
    for source in SOURCES:
        views = _views(source, real)
        by_id = {v.traj_id: v for v in views}
        hits = run_detectors(views, _issue_24_rules())
        now = {
            (tid, h.step_idx, h.behavior)
            for tid, h, _ in run_detectors(_views(source, real), DetectSettings())
        }
        found: dict[str, list] = {b: [] for b in BEHAVIOURS}
        for tid, hit, _ in sorted(hits, key=lambda h: (h[0], h[1].step_idx, h[1].behavior, h[1].rule)):
            found[hit.behavior].append((tid, hit.step_idx, hit.rule, hit.evidence))
        previous = [
            (v.traj_id, idx, "previous.char_jaccard", ev) for v in views for idx, ev in previous_near(v)
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
            for tid, idx, rule, ev in rows:
                key = f"{source}|{tid}|{idx}|{behavior}"
                if key in seen:
                    continue
                seen.add(key)
                flagged = (tid, idx, behavior) in now
                context = _context(by_id[tid], idx, behavior)
                items.append(Item(key, source, tid, idx, behavior, rule, flagged, ev, context))
    return items


def draw_positive(real: Path = REAL) -> list[Item]:
    """Issue 34's sample (see the module doc)."""
    from pipeline.detect import run_detectors, traj_views
    from pipeline.detect.registry import DetectSettings

    rng = random.Random(34)
    items: list[Item] = []
    for source, (fmt, rel) in SOURCES_34.items():
        t, s = _batch(fmt, rel, real)
        pos = positive_steps(t, s)
        hits = {}
        for rules, which in ((DetectSettings(), "now"), (_issue_24_rules(), "before")):
            for tid, h, _ in run_detectors(traj_views(t, s), rules):
                if (tid, h.step_idx) not in pos:
                    continue
                key = (tid, h.step_idx, h.behavior)
                entry = hits.setdefault(
                    key, {"now": False, "before": False, "evidence": h.evidence, "rule": h.rule}
                )
                entry[which] = True
        by_id = {v.traj_id: v for v in traj_views(t, s)}
        for behavior in BEHAVIOURS:
            keys = sorted(k for k in hits if k[2] == behavior)
            for tid, idx, _ in rng.sample(keys, min(CAP, len(keys))):
                h = hits[(tid, idx, behavior)]
                key = f"{source}|{tid}|{idx}|{behavior}"
                context = _context(by_id[tid], idx, behavior)
                items.append(
                    Item(
                        key,
                        source,
                        tid,
                        idx,
                        behavior,
                        h["rule"],
                        h["now"],
                        h["evidence"],
                        context,
                        h["before"],
                    )
                )
    return items


def draw_near(real: Path = REAL) -> list[Item]:
    """The near-repetition sample (see the module doc)."""
    from pipeline.detect import run_detectors, traj_views
    from pipeline.detect.registry import DetectSettings

    hits: dict[tuple[str, str, int], dict] = {}
    views: dict[tuple[str, str], object] = {}
    positive: set[tuple[str, str, int]] = set()
    for source, (fmt, rel) in (SOURCES_34 | NEAR_EXTRA).items():
        t, s = _batch(fmt, rel, real)
        positive |= {(source, tid, i) for tid, i in positive_steps(t, s)}
        tv = traj_views(t, s)
        views.update({(source, v.traj_id): v for v in tv})
        for rules, which in (
            (DetectSettings(), "now"),
            (DetectSettings(near_needs_nothing_new=False), "before"),
        ):
            for tid, h, _ in run_detectors(tv, rules):
                if h.behavior == "near_repetition":
                    entry = hits.setdefault(
                        (source, tid, h.step_idx), {"now": False, "before": False, "hit": h}
                    )
                    entry[which] = True
    keys = sorted(hits)
    items = []
    for source, tid, idx in random.Random(3435).sample(keys, min(NEAR_CAP, len(keys))):
        e = hits[(source, tid, idx)]
        h = e["hit"]
        items.append(
            Item(
                f"{source}|{tid}|{idx}|near_repetition",
                source,
                tid,
                idx,
                "near_repetition",
                h.rule,
                e["now"],
                h.evidence,
                _context(views[(source, tid)], idx, "near_repetition"),
                e["before"],
                (source, tid, idx) in positive,
            )
        )
    return items


def recall_sample(real: Path = REAL, per_source: int = 4) -> list[tuple[str, str, str]]:
    """Issue 34's recall side: up to `per_source` successful trajectories per source on which the current rules
    flag nothing (seed 3434), each as (source, traj_id, its actions in order with a short result) for reading:
    a wasted repeat or an invalid action in one of them is a miss."""
    from pipeline.detect import run_detectors, traj_views
    from pipeline.detect.builtin import action_results
    from pipeline.detect.registry import DetectSettings

    rng = random.Random(3434)
    settings = DetectSettings()
    out = []
    for source, (fmt, rel) in SOURCES_34.items():
        views = {v.traj_id: v for v in traj_views(*_batch(fmt, rel, real))}
        flagged = {tid for tid, _, _ in run_detectors(list(views.values()), settings)}
        clean = sorted(tid for tid, v in views.items() if v.reward > 0 and tid not in flagged)
        for tid in rng.sample(clean, min(per_source, len(clean))):
            v = views[tid]
            res = action_results(v, settings)
            seq = []
            for x in v.steps:
                if x.role == "assistant" and v.action_format == "react":
                    act = next(
                        (line for line in x.content.split("\n") if line.startswith("Action")), "no Action"
                    )
                    r = res.get((x.step_idx, 0))
                    seq.append(f"{act[7:80]} = {r[0][:40] if r else '?'}")
                elif x.role == "assistant":
                    for k, c in enumerate(x.tool_calls or []):
                        r = res.get((x.step_idx, k))
                        seq.append(f"{c['name']}({c['arguments'][:40]}) = {r[0][:40] if r else '?'}")
                elif x.tool_calls:
                    seq.append(f"[{x.role}] {x.tool_calls[0]['name']}")
            out.append((source, tid, " | ".join(seq)))
    return out


def scores(
    items: list[Item], labels: dict[str, list[str]], rules: str = "now", by=lambda i: i.behavior
) -> dict:
    """Per group (default: behaviour): flagged by `rules` ("now" or "before"), real among them (precision),
    real in the labelled union (recall)."""
    out: dict = {}
    for key in sorted({by(i) for i in items}):
        rows = [(i, labels[i.id][0] == "real") for i in items if by(i) == key]
        flagged = [real for i, real in rows if getattr(i, rules)]
        real_all = [getattr(i, rules) for i, real in rows if real]
        out[key] = {
            "labelled": len(rows),
            "flagged": len(flagged),
            "real_flagged": sum(flagged),
            "precision": sum(flagged) / len(flagged) if flagged else float("nan"),
            "real": len(real_all),
            "recall": sum(real_all) / len(real_all) if real_all else float("nan"),
        }
    return out


def main(argv: list[str]) -> None:
    issue_24 = "--sample" in argv and argv[argv.index("--sample") + 1] == "24"
    if "--recall" in argv:
        for source, tid, seq in recall_sample():
            print(f"## {source} {tid}\n   {seq}")
        return
    near = "--sample" in argv and argv[argv.index("--sample") + 1] == "near"
    items = draw() if issue_24 else draw_near() if near else draw_positive()
    if "--table" in argv:
        labels = json.loads((LABELS if issue_24 else LABELS_NEAR if near else LABELS_34).read_text())
        for rules in ("now",) if issue_24 else ("before", "now"):
            print(f"## rules {rules}")
            for b, s in scores(items, labels, rules).items():
                print(" ", b, s)
            for k, s in scores(items, labels, rules, by=lambda i: (i.source, i.behavior)).items():
                print("   ", k, s)
            if near:
                for k, s in scores(items, labels, rules, by=lambda i: ("positive", i.positive)).items():
                    print("   ", k, s)
        return
    for it in items:
        print(
            f"### {it.id} rule={it.rule} now={it.now} before={it.before} positive={it.positive}\n"
            f"{it.evidence[:300]}\n{it.context}\n"
        )
    print(len(items), "items", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main(sys.argv[1:])
