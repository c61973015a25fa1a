"""How much positive credit C3 removes on real third-party runs, and what its spans are, with one checkout of the
code (run it twice, before and after a change, and compare):

    python bench/c3_real_credit.py --code DIR --out before.json SOURCE=FORMAT:PATH ...
    python bench/c3_real_credit.py --compare before.json after.json     # a markdown table

Per source: ingest (byte tokenizer: the spans and credit do not depend on it), the `detect` stage's spans with
the default settings, GRPO and GRPO+C3 on the steps (no logprobs in these logs: C3's confidence is missing and
taken as 1.0), and
- spans per behaviour, and of them the spans on a step with positive GRPO advantage (where C3 changes credit);
- positive credit: the sum of the positive token advantages of GRPO, and the share of it C3 removes
  (sum over tokens with A > 0 of A - A', over the sum of A)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def measure(fmt: str, path: str) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    from pipeline.config import Config
    from pipeline.credit.process import process_batch
    from pipeline.detect import detect_spans
    from pipeline.ingest import ingest
    from pipeline.tokenize import ByteTokenizer

    p = Path(path)
    res = ingest(fmt, [(str(p), p.read_text())], tokenizer=ByteTokenizer())
    t, s = res.trajectories, res.steps
    spans, _ = detect_spans(t, s)
    tables, _ = process_batch(t, s, ["grpo", "grpo+c3"], Config(), {"spans": spans})
    base, c3 = tables["grpo"], tables["grpo+c3"]
    key = [f"{a}|{b}" for a, b in zip(base["traj_id"].to_pylist(), base["step_idx"].to_pylist(), strict=True)]
    adv = base["token_adv"].to_pylist()
    positive_steps = {k for k, a in zip(key, adv, strict=True) if a and max(a) > 0}
    a = np.concatenate([np.asarray(x, dtype=np.float64) for x in adv if x is not None] or [np.zeros(0)])
    b = np.concatenate(
        [np.asarray(x, dtype=np.float64) for x in c3["token_adv"].to_pylist() if x is not None]
        or [np.zeros(0)]
    )
    pos = a > 0
    behaviours = spans.column("behavior").to_pylist()
    span_keys = [
        f"{x}|{y}" for x, y in zip(spans["traj_id"].to_pylist(), spans["step_idx"].to_pylist(), strict=True)
    ]
    roles = Counter(s.column("role").to_pylist())
    return {
        "trajectories": t.num_rows,
        "quarantined": res.quarantine.num_rows,
        "assistant_steps": roles.get("assistant", 0),
        "assistant_tokens": int(
            pc.sum(pc.list_value_length(s.filter(pc.equal(s["role"], "assistant"))["token_ids"])).as_py() or 0
        ),
        "spans": dict(Counter(behaviours)),
        "spans_on_positive": dict(
            Counter(bh for bh, k in zip(behaviours, span_keys, strict=True) if k in positive_steps)
        ),
        "positive_credit": float(a[pos].sum()),
        "removed": float((a[pos] - b[pos]).sum()),
    }


def compare(before: dict, after: dict) -> str:
    rows = [
        "| source | trajectories | spans before -> after (invalid / loop / near) | on positive steps before -> after "
        "| positive credit C3 removes before -> after |",
        "|---|---|---|---|---|",
    ]

    def trio(d: dict) -> str:
        return " / ".join(str(d.get(b, 0)) for b in ("invalid_action", "query_loop", "near_repetition"))

    def share(m: dict) -> str:
        return f"{100 * m['removed'] / m['positive_credit']:.1f}%" if m["positive_credit"] else "-"

    for name in after:
        x, y = before.get(name), after[name]
        if x is None:
            continue
        rows.append(
            f"| {name} | {y['trajectories']} | {trio(x['spans'])} -> {trio(y['spans'])} | "
            f"{trio(x['spans_on_positive'])} -> {trio(y['spans_on_positive'])} | {share(x)} -> {share(y)} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", help="checkout whose pipeline/ and schemas/ to run (default: this one)")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("sources", nargs="*", help="NAME=FORMAT:PATH")
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(f).read_text()) for f in args.compare)
        print(compare(before, after))
        return
    sys.path.insert(0, str(Path(args.code).resolve() if args.code else Path(__file__).resolve().parents[1]))
    out = {}
    for item in args.sources:
        name, rest = item.split("=", 1)
        fmt, path = rest.split(":", 1)
        out[name] = measure(fmt, path)
        print(name, json.dumps(out[name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
