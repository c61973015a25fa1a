"""Issue 34's labelled sample: C3 spans on steps with positive advantage (the only ones where C3 changes
credit), from tau2 airline, tau2 telecom (with a user, and solo) and FireAct, drawn with a fixed seed.

    python tests/c3_sample34.py            # print every sampled span with what a labeller reads
    python tests/c3_sample34.py --table    # precision per behaviour and source, before and after issue 34

The sample is the union of the spans of the current rules and of the rules before issue 34 (every repeat a
loop, near repetition of query tools only: `c3_sample._issue_24_rules`), on steps whose GRPO advantage is
positive, up to `CAP` per source and behaviour (seeded). Each item's id is `source|traj_id|step_idx|behavior`;
`tests/data/c3_labels_34.json` maps it to [label, reason]: "real" (the behaviour is there and is waste or
invalid), or "false". Precision of a rule set = real / flagged by it; recall = flagged and real / real in the
labelled union."""

from __future__ import annotations

import gzip
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import c3_sample

REAL = Path(__file__).resolve().parents[1] / "data" / "real"
LABELS = Path(__file__).resolve().parent / "data" / "c3_labels_34.json"
SOURCES = {
    "tau2-airline": ("tau2-bench", "tau2_bench/qwen2.5-7b_airline_1trial.json"),
    "tau2-telecom-sft": ("tau2-bench", "tau2_bench/gpt-4.1-sft_telecom_default_1trial.json.gz"),
    "tau2-telecom-solo": ("tau2-bench", "tau2_bench/gpt-4.1_telecom_no-user_1trial.json.gz"),
    "tau2-telecom-solo-sft": ("tau2-bench", "tau2_bench/gpt-4.1-sft_telecom_no-user_1trial.json.gz"),
    "fireact-7b": (
        "react",
        "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json",
    ),
    "fireact-13b": (
        "react",
        "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-13b-d_1000_0.7_2023-09-18-13-40-08.json.gz",
    ),
    "fireact-gpt-3.5": (
        "react",
        "fireact_hotpotqa/hotpotqa_dev_0_500_ft_gpt-3.5-turbo-0613_princeton-nlp__7woQRsdi_0.0_2023-09-21-16-19-51.json",
    ),
}
CAP = 25
BEHAVIOURS = ("invalid_action", "query_loop", "near_repetition")


@dataclass
class Item(c3_sample.Item):
    """A sampled span; `flagged`: by the current rules (also `now`), `before`: by the rules before issue 34."""

    before: bool = False

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


def _batch(source: str, real: Path = REAL):
    from pipeline.ingest import ingest
    from pipeline.tokenize import ByteTokenizer

    fmt, rel = SOURCES[source]
    res = ingest(fmt, [read_source(rel, real)], tokenizer=ByteTokenizer())
    return res.trajectories, res.steps


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


def _context(view, step_idx: int, behavior: str) -> str:
    """The reward, every step since the earlier call the span names (tool calls with a short result), the
    flagged step and what followed."""

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
    from pipeline.detect import run_detectors, traj_views
    from pipeline.detect.registry import DetectSettings

    _issue_24_rules = c3_sample._issue_24_rules
    rng = random.Random(34)
    items: list[Item] = []
    for source in SOURCES:
        t, s = _batch(source, real)
        pos = positive_steps(t, s)
        hits = {}
        for rules, which in ((DetectSettings(), "now"), (_issue_24_rules(), "before")):
            views = traj_views(t, s)
            for tid, h, _ in run_detectors(views, rules):
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
                items.append(
                    Item(
                        f"{source}|{tid}|{idx}|{behavior}",
                        source,
                        tid,
                        idx,
                        behavior,
                        h["rule"],
                        h["now"],
                        h["evidence"],
                        _context(by_id[tid], idx, behavior),
                        before=h["before"],
                    )
                )
    return items


RECALL = Path(__file__).resolve().parent / "data" / "c3_recall_34.json"


def recall_sample(real: Path = REAL, per_source: int = 4) -> list[tuple[str, str, str]]:
    """Recall's side: up to `per_source` successful trajectories per source on which the current rules flag
    nothing (seed 3434), each as (source, traj_id, its actions in order with a short result) for reading:
    a wasted repeat or an invalid action in one of them is a miss."""
    from pipeline.detect import run_detectors, traj_views
    from pipeline.detect.builtin import action_results
    from pipeline.detect.registry import DetectSettings

    rng = random.Random(3434)
    settings = DetectSettings()
    out = []
    for source in SOURCES:
        t, s = _batch(source, real)
        views = {v.traj_id: v for v in traj_views(t, s)}
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
    """Per group (default: behaviour): flagged by `rules` ("now" or "before"), real among them, recall."""
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
    items = draw()
    if "--table" in argv:
        labels = json.loads(LABELS.read_text())
        for rules in ("before", "now"):
            print(f"## rules {rules}")
            for b, s in scores(items, labels, rules).items():
                print(" ", b, s)
            for k, s in scores(items, labels, rules, by=lambda i: (i.source, i.behavior)).items():
                print("   ", k, s)
        return
    if "--recall" in argv:
        for source, tid, seq in recall_sample():
            print(f"## {source} {tid}\n   {seq}")
        return
    for it in items:
        print(f"### {it.id} now={it.now} before={it.before}\n{it.evidence[:300]}\n{it.context}\n")
    print(len(items), "items", file=sys.stderr)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1:])
