"""The HTML credit report: content checks, and a real headless Chromium opening it."""

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from flows.run import run_report
from pipeline.config import Config
from pipeline.credit.process import process_batch
from warehouse.rounds import write_round

ARTIFACTS = Path(
    os.environ.get("CREDITFLOW_ARTIFACTS", Path(__file__).resolve().parents[1] / "out" / "test-artifacts")
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _round(lake, round_=0):
    rng = np.random.default_rng(round_)
    trajs, steps = [], []
    for g in range(3):
        for s in range(4):
            tid = f"r{round_}g{g}s{s}"
            trajs.append(
                dict(traj_id=tid, group_id=f"g{g}", sample_idx=s, reward=float(s % 2), source="test")
            )
            idx = 0
            for k in range(1, 4):
                for role in ("user", "assistant"):
                    words = [f"w{j}" for j in range(int(rng.integers(2, 6)))]
                    text = " ".join(words)
                    offs = [m.start() for m in re.finditer(r"\S+", text)]
                    steps.append(
                        dict(
                            traj_id=tid,
                            step_idx=idx,
                            role=role,
                            turn=k,
                            content=text,
                            is_error=False,
                            token_ids=list(range(len(offs))),
                            token_offsets=offs,
                            logprobs=[-0.2] * len(offs) if role == "assistant" else None,
                        )
                    )
                    idx += 1
    traj, st = pa.Table.from_pylist(trajs), pa.Table.from_pylist(steps)
    write_round(lake, round_, traj, st)
    tables, _ = process_batch(traj, st, ["grpo", "dr_grpo"], Config(), round_=round_)
    for m, t in tables.items():
        lake.write_part("advantages", round_, t, part=f"b00000.{m}")
    # a method with the opposite sign everywhere: the switcher must show it
    import pyarrow.compute as pc

    flipped = tables["grpo"].set_column(1, "method", pa.array(["flipped"] * tables["grpo"].num_rows))
    neg = pa.ListArray.from_arrays(
        flipped.column("token_adv").combine_chunks().offsets,
        pc.negate(pc.list_flatten(flipped.column("token_adv").combine_chunks())),
    )
    flipped = flipped.set_column(flipped.column_names.index("token_adv"), "token_adv", neg)
    lake.write_part("advantages", round_, flipped, part="b00000.flipped")
    # a span so the viewer draws one
    lake.write_part(
        "spans",
        round_,
        pa.Table.from_pylist(
            [
                dict(
                    traj_id=f"r{round_}g0s1",
                    step_idx=1,
                    turn=1,
                    token_start=0,
                    token_end=1,
                    char_start=0,
                    char_end=2,
                    behavior="query_loop",
                    severity=1.0,
                    rule="test",
                    evidence="x",
                )
            ]
        ),
        part="b00000",
    )


def test_report_is_self_contained(lake, tmp_path):
    _round(lake, 0)
    _round(lake, 1)
    out = run_report(lake.root, tmp_path / "report.html")
    html = out.read_text()
    assert "<script src" not in html and "http://" not in html and "https://" not in html
    assert "Per-turn credit by method (round 0)" in html and "Trend over rounds" in html
    assert html.count("<svg") >= 2
    assert '"traj_id":"r0g0s1"' in html or "r0g0s1" in html


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_report_in_headless_chromium(lake, tmp_path):
    from playwright.sync_api import sync_playwright

    _round(lake, 0)
    out = run_report(lake.root, tmp_path / "report.html", rounds=[0])
    errors = []
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(out.as_uri())
        page.select_option("#traj", index=0)
        tokens = page.locator(".step.assistant .tok")
        assert tokens.count() > 0

        def colours():
            return tokens.evaluate_all("els => els.map(e => e.style.background)")

        page.select_option("#method", "grpo")
        grpo = colours()
        page.select_option("#method", "flipped")
        flipped = colours()
        assert grpo != flipped, "the method switcher must recolour the tokens"
        assert sum("214, 80, 112" in c for c in grpo) == sum("84, 110, 138" in c for c in flipped)
        assert any("214, 80, 112" in c or "84, 110, 138" in c for c in grpo)
        assert page.locator(".tok.span").count() >= 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert errors == []
    assert (ARTIFACTS / "report.png").stat().st_size > 10_000


def test_report_views(lake):
    from warehouse.catalog import query

    _round(lake, 0)
    rows = query(
        lake, "SELECT * FROM sign_disagreement WHERE method_a = 'flipped' AND method_b = 'grpo'"
    ).to_pylist()
    assert len(rows) == 1
    # flipped is -grpo: every nonzero token differs in sign, zeros (tied groups) do not
    nonzero = query(
        lake,
        "SELECT sum(len(list_filter(token_adv, lambda x: x <> 0))) AS n FROM advantages "
        "WHERE method = 'grpo' AND role = 'assistant'",
    ).to_pylist()[0]["n"]
    assert rows[0]["tokens_sign_differs"] == nonzero > 0
    grpo_vs_dr = query(
        lake,
        "SELECT share_sign_differs FROM sign_disagreement WHERE method_a = 'dr_grpo' AND method_b = 'grpo'",
    ).to_pylist()
    assert grpo_vs_dr == [{"share_sign_differs": 0.0}]
    trends = query(lake, "SELECT * FROM reward_trends").to_pylist()
    assert trends[0]["trajectories"] == 12 and trends[0]["success_rate"] == 0.5


def test_every_view_is_documented_in_the_readme():
    from warehouse.views import VIEWS

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    missing = [name for name in VIEWS if f"`{name}`" not in readme]
    assert not missing, f"views without a README entry: {missing}"
