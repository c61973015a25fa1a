"""`creditflow synth`: determinism, schema validity, the configured rates measured back from the generated text,
score/reward consistency, token columns, rendering of tool calls, and the CLI into a lake."""

from __future__ import annotations

import json
import re
import string

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from pipeline.render import render_assistant
from pipeline.synth import SynthSettings, generate
from pipeline.tokenize import ByteTokenizer
from schemas import steps as steps_schema
from schemas import trajectories as traj_schema

BLOCK = re.compile(r"<(search|answer)>(.*?)</\1>", re.S)


def normalize(text: str) -> str:
    """Search-R1 normalize_answer."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def trigram_jaccard(a: str, b: str) -> float:
    ta = {a[i : i + 3] for i in range(len(a) - 2)}
    tb = {b[i : i + 3] for i in range(len(b) - 2)}
    return len(ta & tb) / max(len(ta | tb), 1)


def by_traj(steps: pa.Table) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for row in steps.to_pylist():
        out.setdefault(row["traj_id"], []).append(row)
    return out


@pytest.fixture(scope="module")
def search_round():
    return generate(
        SynthSettings(
            groups=48,
            samples=8,
            turns=8,
            tokens=120,
            kind="search",
            seed=3,
            invalid_rate=0.1,
            repeat_rate=0.2,
        )
    )


@pytest.fixture(scope="module")
def tool_round():
    return generate(
        SynthSettings(
            groups=48,
            samples=8,
            turns=8,
            tokens=120,
            kind="tool",
            seed=4,
            invalid_rate=0.1,
            repeat_rate=0.2,
            error_rate=0.0,
        )
    )


def test_deterministic_and_seed_sensitive():
    s = SynthSettings(groups=5, samples=3, turns=4, tokens=80, kind="mixed", batch_groups=2, seed=7)
    a, b = generate(s), generate(s)
    assert a[0].equals(b[0]) and a[1].equals(b[1])
    c = generate(SynthSettings(groups=5, samples=3, turns=4, tokens=80, kind="mixed", batch_groups=2, seed=8))
    assert not a[1].column("content").equals(c[1].column("content"))
    from pipeline.synth import iter_batches
    from warehouse.rounds import prefetched

    plain, ahead = list(iter_batches(s)), list(prefetched(iter_batches(s)))
    assert len(plain) == 3 and all(p[1].equals(q[1]) for p, q in zip(plain, ahead, strict=True))


@pytest.mark.parametrize("kind", ["search", "tool", "mixed"])
def test_schema_valid_and_shape(kind):
    s = SynthSettings(groups=6, samples=4, turns=3, tokens=100, kind=kind, batch_groups=4, round=2)
    traj, steps = generate(s)
    traj_schema.validate(traj)
    steps_schema.validate(steps)
    assert traj.num_rows == 24 and steps.num_rows == 24 * (2 * 3 + 1)
    assert set(pc.unique(traj.column("round")).to_pylist()) == {2}
    # one group = one prompt: same group_id, same user prompt, sample_idx 0..S-1
    assert sorted(set(traj.column("sample_idx").to_pylist())) == [0, 1, 2, 3]
    per_group = pa.TableGroupBy(traj, "group_id").aggregate([("traj_id", "count")])
    assert set(per_group.column("traj_id_count").to_pylist()) == {4}
    rows = by_traj(steps)
    for steps_of in rows.values():
        roles = [r["role"] for r in steps_of]
        assert roles[:2] == ["system", "user"] and roles[2::2] == ["assistant"] * 3
        assert [r["turn"] for r in steps_of if r["role"] == "assistant"] == [1, 2, 3]
        assert all(r["turn"] == r2["turn"] for r, r2 in zip(steps_of[2::2], steps_of[3::2], strict=False))
    if kind == "mixed":
        assert set(traj.column("action_format").to_pylist()) == {"search_r1", "openai_tools"}


def test_token_columns(search_round, tool_round):
    tok = ByteTokenizer()
    for _, steps in (search_round, tool_round):
        n_ids = pc.list_value_length(steps.column("token_ids")).to_numpy()
        assert np.array_equal(n_ids, pc.list_value_length(steps.column("token_offsets")).to_numpy())
        assistant = pc.equal(steps.column("role"), "assistant").to_numpy(zero_copy_only=False)
        for name in ("logprobs", "values"):
            col = steps.column(name)
            assert col.type.value_type == pa.float32()
            assert np.array_equal(pc.is_valid(col).to_numpy(zero_copy_only=False), assistant)
            lens = pc.list_value_length(col).to_numpy(zero_copy_only=False)
            assert np.array_equal(lens[assistant], n_ids[assistant])
        lp = pc.list_flatten(steps.column("logprobs")).to_numpy()
        assert (lp <= 0).all() and np.isfinite(lp).all()
        assert np.median(lp) > -0.1 and lp.min() < -3  # mostly near 0, heavy tail
        assert set(
            steps.filter(pc.equal(steps.column("role"), "assistant")).column("logprob_source").to_pylist()
        ) == {"synthetic"}
        # ids and offsets agree with the byte tokenizer on a sample (incl. non-ASCII contents)
        sample = steps.slice(0, 300).to_pylist()
        assert any(any(ord(ch) > 127 for ch in r["content"]) for r in sample)
        ids, offs = tok.encode_batch([r["content"] for r in sample])
        for r, i, o in zip(sample, ids, offs, strict=True):
            assert r["token_ids"] == i and r["token_offsets"] == o
            assert bytes(r["token_ids"]).decode("utf-8") == r["content"]


def test_scores_and_rewards(search_round, tool_round):
    for traj, steps in (search_round, tool_round):
        score = steps.filter(pc.equal(steps.column("role"), "assistant")).column("verifier_score").to_numpy()
        assert np.isfinite(score).all() and (score >= 0).all() and (score <= 1).all()
        assert pc.all(
            pc.is_null(steps.filter(pc.not_equal(steps.column("role"), "assistant")).column("verifier_score"))
        ).as_py()
        mat = score.reshape(traj.num_rows, -1)
        drops = (np.diff(mat, axis=1) < 0).mean()
        assert 0.0 < drops < 0.25  # mostly non-decreasing, some regressions
        reward = traj.column("reward").to_numpy()
        assert 0.1 < reward.mean() < 0.9 and set(np.unique(reward)) <= {0.0, 1.0}
        comps = [dict(c) for c in traj.column("reward_components").to_pylist()]
        assert [c["correct"] for c in comps] == reward.tolist()
        assert all(0 <= c["format"] <= 1 for c in comps)
    # search: reward = strict EM of the last valid <answer> against the gold answer in meta
    traj, steps = search_round
    gold = {t["traj_id"]: json.loads(t["meta"])["gold_answers"][0] for t in traj.to_pylist()}
    reward = dict(zip(traj.column("traj_id").to_pylist(), traj.column("reward").to_pylist(), strict=True))
    for tid, rows in by_traj(steps).items():
        last = None
        for r in rows:
            blocks = BLOCK.findall(r["content"]) if r["role"] == "assistant" else []
            if len(blocks) == 1 and blocks[0][0] == "answer":
                last = (blocks[0][1], r["verifier_score"])
        em = last is not None and normalize(last[0]) == normalize(gold[tid])
        assert reward[tid] == float(em)
        if last is not None:
            assert (last[1] == 1.0) == em
    # tool: reward = the task was completed (best score 1.0)
    traj, steps = tool_round
    mat = steps.filter(pc.equal(steps.column("role"), "assistant")).column("verifier_score").to_numpy()
    assert np.array_equal(
        traj.column("reward").to_numpy(), (mat.reshape(traj.num_rows, -1).max(1) >= 1.0) * 1.0
    )


def test_search_rates_from_text(search_round):
    _, steps = search_round
    n_turns = n_invalid = n_eligible = n_repeat = n_exact = n_near = 0
    for rows in by_traj(steps).values():
        earlier: list[str] = []
        for r in rows:
            if r["role"] != "assistant":
                continue
            n_turns += 1
            blocks = BLOCK.findall(r["content"])
            valid = len(blocks) == 1 and r["content"].count("<search>") + r["content"].count("<answer>") == 1
            if not valid:
                n_invalid += 1
                continue
            if blocks[0][0] != "search":
                continue
            q = normalize(blocks[0][1])
            if earlier:
                n_eligible += 1
                if q in earlier:
                    n_repeat += 1
                    n_exact += 1
                elif len(q) >= 8 and any(trigram_jaccard(q, e) >= 0.9 for e in earlier):
                    n_repeat += 1
                    n_near += 1
            earlier.append(q)
    assert abs(n_invalid / n_turns - 0.1) < 0.03
    assert abs(n_repeat / n_eligible - 0.2) < 0.04
    assert n_exact > 20 and n_near > 20


def test_tool_rates_and_rendering(tool_round):
    traj, steps = tool_round
    specs = {
        t["function"]["name"]: t["function"] for t in json.loads(traj.column("meta")[0].as_py())["tools"]
    }
    for spec in specs.values():
        assert spec["parameters"]["type"] == "object" and spec["parameters"]["required"]
    n_turns = n_invalid = n_eligible = n_repeat = 0
    for rows in by_traj(steps).values():
        earlier: list[tuple] = []
        for i, r in enumerate(rows):
            if r["role"] != "assistant":
                continue
            n_turns += 1
            nxt = rows[i + 1] if i + 1 < len(rows) else None
            calls = r["tool_calls"] or []
            bad = False
            for call in calls:
                text = r["content"][: r["content"].index("\n<tool_call>")]
                assert render_assistant(text, calls)[0] == r["content"]
                if nxt is not None:
                    assert nxt["role"] == "tool" and nxt["tool_call_id"] == call["id"]
                    json.loads(nxt["content"])
                try:
                    args = json.loads(call["arguments"])
                except ValueError:
                    bad = True
                    continue
                if call["name"] not in specs or not set(specs[call["name"]]["parameters"]["required"]) <= set(
                    args
                ):
                    bad = True
                    continue
            if bad:
                n_invalid += 1
                if nxt is not None:
                    assert nxt["is_error"] and "error" in json.loads(nxt["content"])
                continue
            if earlier:
                n_eligible += 1
            for call in calls:
                args = json.loads(call["arguments"])
                args.pop("verbose", None)
                key = (call["name"], json.dumps(args, sort_keys=True))
                if key in earlier:
                    n_repeat += 1
                earlier.append(key)
    assert abs(n_invalid / n_turns - 0.1) < 0.03
    assert abs(n_repeat / n_eligible - 0.2) < 0.05
    # ids from tool returns are reused by later calls' arguments (what IAPO's annotator finds)
    rows = by_traj(steps)
    reused = 0
    for steps_of in rows.values():
        returned = "".join(r["content"] for r in steps_of if r["role"] == "tool" and not r["is_error"])
        for r in steps_of:
            for call in r["tool_calls"] or []:
                if call["name"] == "get_user_details" and '"user_id"' in returned:
                    try:
                        reused += json.loads(call["arguments"]).get("user_id", "-") in returned
                    except ValueError:
                        pass
    assert reused > 100


@pytest.mark.parametrize("fmt", ["delta", "parquet"])
def test_cli_into_lake_and_query(tmp_path, monkeypatch, fmt):
    from flows.cli import app
    from warehouse.lake import FORMAT_ENV, Lake

    monkeypatch.setenv(FORMAT_ENV, fmt)
    runner = CliRunner()
    out = tmp_path / "lake"
    args = [
        "synth",
        "--groups",
        "5",
        "--samples",
        "3",
        "--turns",
        "4",
        "--tokens",
        "60",
        "--out",
        str(out),
        "--round",
        "1",
        "--seed",
        "0",
        "--kind",
        "mixed",
        "--invalid-rate",
        "0.1",
        "--repeat-rate",
        "0.15",
        "--batch-groups",
        "2",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    lake = Lake(out)
    assert lake.format == fmt
    assert [lake.part_name(p) for p in lake.parts("steps", 1)] == ["b00000", "b00001", "b00002"]
    res = runner.invoke(
        app, ["query", "--lake", str(out), "--format", "json", "select count(*) as n from steps"]
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip())[0]["n"] == 15 * 9
    # rewriting the round replaces it (no duplicate rows)
    res = runner.invoke(app, args[:-1] + ["64"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(
        app,
        [
            "query",
            "--lake",
            str(out),
            "--format",
            "json",
            "select count(*) as n, count(distinct traj_id) as t from steps",
        ],
    )
    assert json.loads(res.output.strip())[0] == {"n": 15 * 9, "t": 15}


def test_write_round_parts_is_aligned_and_atomic(lake):
    from warehouse.rounds import batch_names, read_batch, write_round_parts

    s = SynthSettings(groups=4, samples=2, turns=2, tokens=40, batch_groups=2)
    from pipeline.synth import iter_batches

    assert write_round_parts(lake, 0, iter_batches(s)) == ["b00000", "b00001"]
    assert batch_names(lake, 0) == ["b00000", "b00001"]
    t = read_batch(lake, "trajectories", 0, "b00001")
    st = read_batch(lake, "steps", 0, "b00001")
    assert set(st.column("traj_id").to_pylist()) == set(t.column("traj_id").to_pylist())

    def failing():
        yield from iter_batches(s)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_round_parts(lake, 0, failing())
    assert batch_names(lake, 0) == ["b00000", "b00001"]
    assert not list(lake.root.glob("*/.staging-*"))
    assert write_round_parts(lake, 3, iter([])) == ["b00000"]
    assert lake.read("steps", 3).num_rows == 0
