"""The HTML credit report: content checks, and a real headless Chromium opening it."""

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from flows.run import run_report
from pipeline.config import Config
from pipeline.credit.process import process_batch
from warehouse.rounds import write_round

ARTIFACTS = Path(
    os.environ.get("CREDITFLOW_ARTIFACTS", Path(__file__).resolve().parents[1] / "out" / "test-artifacts")
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _round(lake, round_=0, *, tid=None, gid=None, source="test"):
    rng = np.random.default_rng(round_)
    tid_of = tid or (lambda g, s: f"r{round_}g{g}s{s}")
    gid_of = gid or (lambda g: f"g{g}")
    trajs, steps = [], []
    for g in range(3):
        for s in range(4):
            tid = tid_of(g, s)
            trajs.append(
                dict(traj_id=tid, group_id=gid_of(g), sample_idx=s, reward=float(s % 2), source=source)
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
                    traj_id=tid_of(0, 1),
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


def _tokenwise(lake, round_=0):
    """A method whose credit varies inside trajectories (grpo's value times +1, -0.5, +1, ... by token): the
    viewer must open on it."""
    t = lake.read("advantages", round_)
    t = t.filter(pc.equal(t.column("method"), "grpo"))
    lists = t.column("token_adv").combine_chunks()
    offsets = lists.offsets.to_numpy()
    values = lists.flatten().to_numpy(zero_copy_only=False)
    pos = np.arange(len(values)) - np.repeat(offsets[:-1], np.diff(offsets))
    scaled = pa.ListArray.from_arrays(
        lists.offsets, pa.array(values * np.where(pos % 2 == 0, 1.0, -0.5), pa.float32())
    )
    t = t.set_column(t.column_names.index("token_adv"), "token_adv", scaled)
    t = t.set_column(t.column_names.index("method"), "method", pa.array(["tokenwise"] * t.num_rows))
    lake.write_part(
        "advantages", round_, t.drop(["round"]) if "round" in t.column_names else t, part="b00000.tokenwise"
    )


def _train_metrics(lake):
    from schemas.train_metrics import SCHEMA

    rows = []
    for rnd in (0, 1):
        for step in range(3):
            rows.append(
                dict(
                    round=rnd,
                    method="grpo",
                    step=step,
                    epoch=0,
                    micro_batches=1,
                    sequences=4,
                    tokens=100,
                    loss=1.0 / (1 + step + 3 * rnd),
                    pg_loss=0.5,
                    vf_loss=None,
                    kl=0.01,
                    clip_frac=0.1,
                    approx_kl=0.01,
                    entropy=2.0 - 0.1 * step,
                    grad_norm=1.5,
                    lr=1e-5,
                    seconds=0.1,
                )
            )
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    for rnd in (0, 1):
        part = table.filter(pc.equal(table.column("round"), rnd)).drop(["round"])
        lake.write_part("train_metrics", rnd, part, part="loop-grpo")


CHART_KEYS = ["turns-r0", "turns-r1", "histograms", "outcomes", "disagreement", "trends", "train"]


def _figures(html: str) -> dict:
    import json

    m = re.search(r"<script type='application/json' id='report-figures'>(.*?)</script>", html, re.S)
    return json.loads(m.group(1).replace("<\\/", "</"))


def test_report_is_self_contained(lake, tmp_path):
    import plotly.graph_objects as go

    _round(lake, 0)
    _round(lake, 1)
    _tokenwise(lake, 1)
    _train_metrics(lake)
    out = run_report(lake.root, tmp_path / "report.html", quiet=True)
    html = out.read_text()
    assert "<script src" not in html and "<link" not in html  # plotly.js is inlined
    figs = _figures(html)
    assert set(CHART_KEYS) <= set(figs)
    for key, fig in figs.items():
        go.Figure(fig)  # plotly's own validator: every trace and layout property is real
        assert any(len(tr.get("x") or tr.get("z") or []) for tr in fig["data"]), key
    # the figures say what the lake holds: the method names, and one line per method in the turn chart
    assert {tr["name"] for tr in figs["turns-r1"]["data"]} >= {"grpo", "dr_grpo", "flipped", "tokenwise"}
    assert {tr["name"] for tr in figs["train"]["data"]} == {"grpo"}
    assert "r0g0s1" in html
    assert "no TCPO method in this lake" in html  # an empty chart says why


def test_report_data_by_hand(lake):
    """The interval, outcome split, histogram and default method against NumPy on the same rows."""
    from warehouse.catalog import connect
    from warehouse.report_data import (
        advantage_histograms,
        default_method,
        gather,
        outcome_split,
        turn_intervals,
        within_trajectory_spread,
    )

    _round(lake, 0)
    _tokenwise(lake, 0)
    adv = lake.read("advantages", 0).to_pylist()
    trajs = {r["traj_id"]: r["reward"] for r in lake.read("trajectories", 0).to_pylist()}
    con = connect(lake)
    try:
        got = {(r["method"], r["turn"]): r for r in turn_intervals(con, [0])}
        split = {(r["method"], r["outcome"]): r for r in outcome_split(con, [0])}
        hist = advantage_histograms(con, 0)
        spread = within_trajectory_spread(con, 0)
    finally:
        con.close()
    for (method, turn), row in got.items():
        m = [
            np.mean(r["token_adv"])
            for r in adv
            if r["method"] == method and r["turn"] == turn and r["role"] == "assistant" and r["token_adv"]
        ]
        assert row["n"] == len(m) == 12
        assert row["mean_adv"] == pytest.approx(np.mean(m), abs=1e-6)
        assert row["ci95"] == pytest.approx(1.96 * np.std(m, ddof=1) / np.sqrt(len(m)), abs=1e-6)
    for (method, outcome), row in split.items():
        m = [
            np.mean(r["token_adv"])
            for r in adv
            if r["method"] == method
            and r["role"] == "assistant"
            and r["token_adv"]
            and (trajs[r["traj_id"]] > 0) == (outcome == "success")
        ]
        assert row["n"] == len(m) and row["mean_adv"] == pytest.approx(np.mean(m), abs=1e-6)
    for method in ("grpo", "tokenwise"):
        tokens = sum(len(r["token_adv"]) for r in adv if r["method"] == method and r["role"] == "assistant")
        assert sum(r["tokens"] for r in hist if r["method"] == method) == tokens
    # grpo gives every token of a trajectory the same credit: no variance within trajectories
    by = {r["method"]: r for r in spread}
    assert by["grpo"]["within_var"] == pytest.approx(0, abs=1e-9) and by["tokenwise"]["within_var"] > 0
    assert default_method(spread) == "tokenwise"
    data = gather(lake, [0])
    assert data["default_method"] == "tokenwise"
    (group,) = data["groups"]
    members = [data["trajectories"][i] for i in group["members"]]
    assert len(members) == 4 and {t["group_id"] for t in members} == {group["group_id"]}
    assert {t["reward"] for t in members} == {0.0, 1.0}  # a group with both outcomes is preferred


def _chromium_page(p):
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
    return browser, browser.new_page(viewport={"width": 1400, "height": 1000})


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_report_in_headless_chromium(lake, tmp_path):
    from playwright.sync_api import sync_playwright

    _round(lake, 0)
    _round(lake, 1)
    _tokenwise(lake, 1)
    _train_metrics(lake)
    out = run_report(lake.root, tmp_path / "report.html", quiet=True)
    errors, requests = [], []
    with sync_playwright() as p:
        browser, page = _chromium_page(p)
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on(
            "request", lambda r: requests.append(r.url) if not r.url.startswith(("file:", "data:")) else None
        )
        page.goto(out.as_uri())
        page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 7")
        # every chart is drawn with its data (Plotly keeps the traces on the element)
        drawn = page.evaluate(
            "() => Object.fromEntries([...document.querySelectorAll('.js-plotly-plot')].map(el => "
            "[el.id, el.data.map(t => (t.x || t.z || []).length)]))"
        )
        for key in CHART_KEYS:
            assert f"fig-{key}" in drawn and drawn[f"fig-{key}"] and max(drawn[f"fig-{key}"]) > 0, key
        assert page.locator("#fig-turns-r1 .main-svg .scatterlayer .trace").count() >= 4
        # legend toggle: a click hides a trace, a second click shows it again
        hist = "#fig-histograms"
        vis = f"() => document.querySelector('{hist}').data[0].visible"
        assert page.evaluate(vis) in (True, None)
        page.locator(f"{hist} .legend .traces").first.click()
        page.wait_for_function(f"{vis.replace('() => ', '() => ')} === 'legendonly'")
        page.locator(f"{hist} .legend .traces").first.click()
        page.wait_for_function(f"() => document.querySelector('{hist}').data[0].visible === true")
        # the viewer opens on the method whose credit varies most within trajectories
        assert page.input_value("#method") == "tokenwise"
        assert page.input_value("#group-method") == "tokenwise"
        tokens = page.locator("#viewer .step.assistant .tok")
        assert tokens.count() > 0

        def colours(loc):
            return loc.evaluate_all("els => els.map(e => e.style.background)")

        tokenwise = colours(tokens)
        assert len(set(tokenwise)) == 2, "token-level credit: two colours (+1 and -0.5 times grpo's value)"
        page.select_option("#method", "grpo")
        grpo = colours(tokens)
        assert len(set(grpo)) == 1  # trajectory-level credit: one colour
        page.select_option("#method", "flipped")
        flipped = colours(tokens)
        assert grpo != flipped, "the method switcher must recolour the tokens"
        assert sum("214, 80, 112" in c for c in grpo) == sum("84, 110, 138" in c for c in flipped)
        # group view: the 4 samples of one prompt side by side, coloured, recoloured by its own switcher
        samples = page.locator("#group-view .sample")
        assert samples.count() == 4
        group_toks = page.locator("#group-view .step.assistant .tok")
        before = colours(group_toks)
        assert any("214, 80, 112" in c or "84, 110, 138" in c for c in before)
        page.select_option("#group-method", "flipped")
        assert colours(group_toks) != before
        assert page.locator("#group-view .sample.win").count() == 2
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        browser.close()
    assert errors == []
    assert requests == [], f"the report asked the network for {requests[:3]}"
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


# ---- the report is a page of someone else's data (issue #33) --------------------------------------------


class _Listener:
    """A web server on the loopback that counts what reaches it: the ground truth of 'nothing left'."""

    def __init__(self):
        import http.server
        import threading

        hits = self.hits = []

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                hits.append(self.path)
                self.send_response(204)
                self.end_headers()

            do_POST = do_GET  # noqa: N815

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/leak"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener():
    ear = _Listener()
    yield ear
    ear.close()


LEAK = "http://127.0.0.1:9/leak"  # replaced by the listener's address in the payloads
HOSTILE = [
    f"<img src=x onerror=\"window.__pwned='img';fetch('{LEAK}')\">",
    f"<svg onload=\"window.__pwned='svg';fetch('{LEAK}')\"></svg>",
    f"</script><script>window.__pwned='script';fetch('{LEAK}')</script>",
    "<b>bold</b> &amp; <style>body{background:url(LEAK)}</style>".replace("LEAK", LEAK),
    '" onmouseover="window.__pwned=\'attr\'" x="',
    f'<iframe src="{LEAK}"></iframe><link rel=stylesheet href="{LEAK}">',
    f'<a href="javascript:window.__pwned=\'href\'">x</a><img src="{LEAK}">',
]


def _hostile_lake(lake, leak):
    """Every string the page shows from data is a payload: trajectory, group and source ids, a method name,
    an edge's type and information unit, a span's behaviour and rule."""
    bad = [h.replace(LEAK, leak) for h in HOSTILE]
    _round(
        lake,
        0,
        tid=lambda g, s: f"{bad[(4 * g + s) % len(bad)]}#{g}.{s}",
        gid=lambda g: bad[g] + f"#g{g}",
        source=bad[3],
    )
    adv = lake.read("advantages", 0)
    evil = adv.filter(pc.equal(adv.column("method"), "flipped"))
    evil = evil.set_column(evil.column_names.index("method"), "method", pa.array([bad[0]] * evil.num_rows))
    lake.write_part(
        "advantages", 0, evil.drop(["round"]) if "round" in evil.column_names else evil, part="b00000.evil"
    )
    from schemas.edges import SCHEMA

    tids = lake.read("trajectories", 0).column("traj_id").to_pylist()
    edges = [
        dict(
            traj_id=t,
            src_turn=1,
            dst_turn=2,
            sign=1,
            type="input",
            info_unit=bad[4],
            binding=bad[5],
            annotator=bad[6],
            prompt_version=None,
        )
        for t in tids
    ]
    lake.write_part("edges", 0, pa.Table.from_pylist(edges, schema=SCHEMA.remove(0)), part="b00000")
    return bad


def test_data_cannot_close_or_reopen_its_script_element():
    """Data goes into the page as JSON in a non-running script element: no `<` in it at all (a `<!--<script>`
    in a value would otherwise put the parser in a state where the element's own end tag is not one)."""
    from pipeline.report import _json_script

    value = {"a": ["</script><script>x()</script>", "<!--<script>", "&lt;", "<\\/script>"]}
    out = _json_script("x", value)
    body = out[len("<script type='application/json' id='x'>") : -len("</script>")]
    assert "<" not in body and ">" not in body and "&" not in body
    import json

    assert json.loads(body) == value


def _open(page, url, violations, requests):
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith(("file:", "data:")) else None)
    page.expose_function("__cspViolation", lambda d: violations.append(d))
    page.add_init_script(
        "document.addEventListener('securitypolicyviolation', e => "
        "window.__cspViolation(e.violatedDirective + ' ' + e.blockedURI))"
    )
    page.goto(url)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 3")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_hostile_ids_run_no_script_and_send_nothing(lake, tmp_path, listener):
    """Issue #33: a traj_id `<img src=x onerror=fetch(...)>` ran its script when the report was opened. Every
    value from data is text in the page: no payload runs, no element it names exists, nothing is requested,
    and the page itself needs nothing its policy forbids (no violation report)."""
    from playwright.sync_api import sync_playwright

    bad = _hostile_lake(lake, listener.url)
    out = run_report(lake.root, tmp_path / "report.html", quiet=True)
    errors, requests, violations = [], [], []
    with sync_playwright() as p:
        browser, page = _chromium_page(p)
        page.on("pageerror", lambda e: errors.append(str(e)))
        _open(page, out.as_uri(), violations, requests)
        opts = page.locator("#traj option").all_text_contents()
        assert any(bad[0] in o for o in opts)  # the id is shown, as text
        for sel in ("#traj", "#group"):  # every trajectory and group through the viewer and the group view
            for value in page.locator(f"{sel} option").evaluate_all("os => os.map(o => o.value)"):
                page.select_option(sel, value)
        for value in page.locator("#method option").evaluate_all("os => os.map(o => o.value)"):
            page.select_option("#method", value)
        page.hover("#viewer .edge")
        page.mouse.move(700, 600)
        page.wait_for_timeout(300)
        assert page.evaluate("() => window.__pwned") is None, "a payload ran"
        assert listener.hits == [], f"a payload reached the network: {listener.hits}"
        shown = page.inner_text("#viewer") + page.inner_text("#group-view")
        assert "onerror" in shown and "</script>" in shown  # shown as text
        made = page.evaluate(
            "() => [...document.querySelectorAll('#viewer *, #group-view *, .legend *, td, th')]"
            ".filter(e => ['IMG','SVG','SCRIPT','IFRAME','A','LINK'].includes(e.tagName.toUpperCase())"
            " && !e.closest('.js-plotly-plot')).length"
        )
        assert made == 0
        browser.close()
    assert requests == [], f"the report asked the network for {requests[:3]}"
    assert violations == [], violations  # nothing was even attempted
    assert errors == [], errors
    assert listener.hits == []


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_the_pages_policy_stops_what_escaping_might_miss(lake, tmp_path, listener):
    """The second wall: markup put into the page by other means (a future bug) runs no inline handler or
    script element, and no script of the page can reach the network."""
    from playwright.sync_api import sync_playwright

    _round(lake, 0)
    out = run_report(lake.root, tmp_path / "report.html", quiet=True)
    html = out.read_text()
    csp = re.search(r"<meta http-equiv='Content-Security-Policy' content=\"([^\"]+)\">", html).group(1)
    assert (
        "connect-src 'none'" in csp
        and "default-src 'none'" in csp
        and "unsafe-inline" not in csp.split("style-src")[0]
    )
    assert html.index("Content-Security-Policy") < html.index("<script")
    requests, violations, failed = [], [], []
    leak = listener.url
    with sync_playwright() as p:
        browser, page = _chromium_page(p)
        page.on("requestfailed", lambda r: failed.append((r.url, r.failure)))
        _open(page, out.as_uri(), violations, requests)
        assert violations == []  # the page's own scripts and Plotly's styles are allowed
        page.evaluate(
            f"""() => {{
            const d = document.createElement('div');
            d.innerHTML = `<img src=x onerror="window.__pwned='img'"><img src="{leak}">`;
            document.body.appendChild(d);
            const s = document.createElement('script');
            s.textContent = "window.__pwned = 'script'";
            document.body.appendChild(s);
            fetch('{leak}').catch(() => null);
            navigator.sendBeacon && navigator.sendBeacon('{leak}', 'x');
            new Image().src = '{leak}';
        }}"""
        )
        page.wait_for_timeout(500)
        assert page.evaluate("() => window.__pwned") is None
        browser.close()
    assert listener.hits == [], listener.hits  # nothing reached the server
    blocked = {u for u, why in failed if why == "csp"}  # Chromium names the reason
    assert requests and set(requests) <= blocked, (requests, failed)  # what Chromium tried, it blocked
    assert any("script-src" in v for v in violations) and any("connect-src" in v for v in violations), (
        violations
    )
