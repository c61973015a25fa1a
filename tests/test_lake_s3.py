"""The lake on object storage (#25): a real S3 API (moto's server, started here) behind `--lake s3://...`.
ingest, process, export, query (also --as-of) and report run on it; two process runs of one round on one S3
lake (as from two machines: separate local state) both finish with identical results; a writer killed with
SIGKILL mid-write leaves every table readable at its last committed version; a URI that holds no lake is one
line and creates nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

pytest.importorskip("deltalake")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from flows.cli import app  # noqa: E402
from warehouse.lake import Lake  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server in its own process (`python -m moto.server`): in a thread of this process it would
    wait for the GIL that delta-rs holds while it waits for the server's answer."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("moto's S3 server did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch, tmp_path):
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "CREDITFLOW_STATE_DIR": str(tmp_path / "state"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def bucket(s3_env, request):
    name = "cf-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return name


def _objects(bucket: str, endpoint: str) -> list[str]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _round(lake: Lake, groups: int = 4) -> None:
    from pipeline.synth import SynthSettings, generate
    from warehouse.rounds import write_round

    traj, steps = generate(SynthSettings(groups=groups, samples=4, turns=4, tokens=24, seed=0, round=0))
    write_round(lake, 0, traj, steps, batch_groups=2)


def test_lake_api_on_s3(bucket):
    lake = Lake(f"s3://{bucket}/lake")
    assert lake.format == "delta" and not lake.exists()
    t = pa.table({"traj_id": ["a", "b"], "n": [1, 2]})
    lake.write_part("experiments", 0, t, part="p0")
    lake.write_part("experiments", 0, t, part="p0")  # idempotent
    lake.write_part("experiments", 1, t.slice(0, 1), part="p0")
    assert lake.read("experiments", 0).num_rows == 2 and lake.rounds("experiments") == [0, 1]
    v = lake._table("experiments").version()
    lake.replace_partition("experiments", 0, {"q": t.slice(1)})
    assert lake.read("experiments", 0).column("traj_id").to_pylist() == ["b"]
    assert lake.read("experiments", 1).num_rows == 1  # round 1 untouched by round 0's replace
    old = lake.read("experiments", 0, as_of={"experiments": v})
    assert sorted(old.column("traj_id").to_pylist()) == ["a", "b"]
    assert [p.name for p in lake.parts("experiments", 0)] == ["part-q.parquet"]


def test_commands_on_s3(bucket, s3_env, tmp_path):
    uri = f"s3://{bucket}/lake"
    src = tmp_path / "in"
    src.mkdir()
    rows = [
        {
            "traj_id": f"t{g}{s}",
            "group_id": f"g{g}",
            "reward": float(s % 2),
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{s}"}],
        }
        for g in range(2)
        for s in range(4)
    ]
    (src / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(
        app,
        ["ingest", str(src), "--format", "chat-jsonl", "--lake", uri, "--round", "0", "--tokenizer", "bytes"],
    )
    assert res.exit_code == 0, res.output
    assert not Path("s3:").exists() and any(
        k.startswith("lake/trajectories/_delta_log/") for k in _objects(bucket, s3_env["AWS_ENDPOINT_URL"])
    )
    res = runner.invoke(app, ["process", "--lake", uri, "--round", "0", "--methods", "grpo"])
    assert res.exit_code == 0, res.output
    # again: up to date (keys from the Delta log, cache records in the local state folder), no flow run
    res = runner.invoke(app, ["process", "--lake", uri, "--round", "0", "--methods", "grpo"])
    assert res.exit_code == 0 and "round 0 is up to date" in res.output, res.output
    out = tmp_path / "batch.parquet"
    res = runner.invoke(app, ["export", "--lake", uri, "--round", "0", "--method", "grpo", "--out", str(out)])
    assert res.exit_code == 0, res.output
    import pyarrow.parquet as pq

    version = pq.read_schema(out).metadata[b"creditflow.lake_version"].decode()
    assert "advantages=" in version and pq.read_table(out).num_rows == 8
    sql = "SELECT count(*) AS n FROM advantages WHERE method = 'grpo'"
    res = runner.invoke(app, ["query", sql, "--lake", uri, "--format", "json"])
    assert res.exit_code == 0, res.output
    n = json.loads(res.output)[0]["n"]
    assert n > 0
    # a later change to the advantages; --as-of the exported version still reads what the batch used
    Lake(uri).delete_parts("advantages", 0)
    now = runner.invoke(app, ["query", sql, "--lake", uri, "--format", "json"])
    then = runner.invoke(app, ["query", sql, "--lake", uri, "--format", "json", "--as-of", version])
    assert json.loads(now.output)[0]["n"] == 0 and json.loads(then.output)[0]["n"] == n, then.output
    report = tmp_path / "r.html"
    res = runner.invoke(app, ["report", "--lake", uri, "--out", str(report)])
    assert res.exit_code == 0, res.output
    assert report.stat().st_size > 1000


def test_a_uri_without_a_lake_is_one_line_and_creates_nothing(bucket, s3_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cmd in (
        ["query", "SELECT 1", "--lake", f"s3://{bucket}/nope"],
        ["report", "--lake", f"s3://{bucket}/nope", "--out", str(tmp_path / "r.html")],
        ["export", "--lake", f"s3://{bucket}/nope", "--round", "0", "--method", "grpo", "--out", "b.parquet"],
        ["query", "SELECT 1", "--lake", "ftp://host/lake"],
    ):
        res = runner.invoke(app, cmd)
        assert res.exit_code != 0, cmd
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert _objects(bucket, s3_env["AWS_ENDPOINT_URL"]) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"] or not list(tmp_path.glob("s3*"))
    assert not list(tmp_path.glob("s3*")) and not list(tmp_path.glob("ftp*"))


def _cli(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", "from flows.cli import app; app()", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _sorted(lake: Lake, table: str) -> pa.Table:
    t = lake.read(table, 0)
    keys = [k for k in ("method", "traj_id", "step_idx") if k in t.column_names]
    return t.sort_by([(k, "ascending") for k in keys])


@pytest.mark.slow
def test_two_process_runs_on_one_s3_lake_both_finish_identically(bucket, s3_env, tmp_path):
    """Two machines (separate local state: no shared lock file) process the same round at once: the Delta
    commits that lose a race are retried; both runs finish and the tables equal one run's."""
    uri = f"s3://{bucket}/lake"
    lake = Lake(uri)
    _round(lake)
    args = ["process", "--lake", uri, "--round", "0", "--methods", "grpo,gae"]
    runs = [_cli(args, {**s3_env, "CREDITFLOW_STATE_DIR": str(tmp_path / f"machine{i}")}) for i in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    first = {t: _sorted(lake, t) for t in ("advantages", "train_batch")}
    assert first["advantages"].num_rows > 0
    solo_uri = f"s3://{bucket}/solo"  # the same round processed by one run alone
    _round(Lake(solo_uri))
    solo = _cli([*args[:2], solo_uri, *args[3:]], {**s3_env, "CREDITFLOW_STATE_DIR": str(tmp_path / "solo")})
    out = solo.communicate(timeout=600)[0]
    assert solo.returncode == 0, out
    for table, together in first.items():
        assert _sorted(Lake(solo_uri), table).equals(together), table


_WRITER = """
import sys, pyarrow as pa
from warehouse.lake import Lake
lake = Lake(sys.argv[1])
big = pa.table({"traj_id": [f"t{i}" for i in range(200_000)], "n": list(range(200_000))})
i = 0
while True:
    lake.write_part("experiments", 0, big.slice(0, 1000 + i), part="p")
    print(i, flush=True)
    i += 1
"""


def test_kill_9_mid_write_leaves_the_last_version_readable(bucket, s3_env):
    uri = f"s3://{bucket}/lake"
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, uri],
        cwd=ROOT,
        env={**os.environ, **s3_env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        committed = [proc.stdout.readline() for _ in range(3)]
        assert all(c.strip() for c in committed), committed
        time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    lake = Lake(uri)
    t = lake.read("experiments", 0)
    version = lake._table("experiments").version()
    # each commit replaced the part whole: the table holds exactly one write's rows, the last committed one
    # (version 0: the table's creation, empty)
    assert t.num_rows >= 1002 and t.num_rows - 1000 == version - 1
    assert pc.count_distinct(t.column("traj_id")).as_py() == t.num_rows


def test_vacuum_and_compact_on_s3(bucket, s3_env):
    """`lake vacuum` on the S3 lake removes the object only an older version references (its size from the
    store), after a dry run that removes nothing; `lake compact` runs there too."""
    uri = f"s3://{bucket}/lake"
    lake = Lake(uri)
    _round(lake)
    endpoint = s3_env["AWS_ENDPOINT_URL"]
    (part,) = lake.parts("trajectories", 0)[:1]
    before = set(_objects(bucket, endpoint))
    lake.write_part(
        "trajectories", 0, lake.read("trajectories", 0, parts=[part]).slice(0, 1), part=lake.part_name(part)
    )
    new = {k for k in set(_objects(bucket, endpoint)) - before if k.endswith(".parquet")}
    old = {k for k in before if k.startswith("lake/trajectories/") and k.endswith(".parquet")}
    old = {
        k for k in old if f"_part={lake.part_name(part)}/" in k or f"_part={lake.part_name(part)}.gen-" in k
    }
    assert len(new) == 1 and len(old) == 1
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    size = client.head_object(Bucket=bucket, Key=next(iter(old)))["ContentLength"]
    args = ["lake", "vacuum", "--lake", uri, "--retain-hours", "0", "--force"]
    res = runner.invoke(app, [*args, "--dry-run"])
    assert res.exit_code == 0 and "would remove 1 files" in res.output, res.output
    from warehouse.maintenance import human_bytes

    assert f"1 files, {human_bytes(size)}" in res.output
    assert old <= set(_objects(bucket, endpoint))
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and "removed 1 files" in res.output, res.output
    assert not old & set(_objects(bucket, endpoint)) and new <= set(_objects(bucket, endpoint))
    assert Lake(uri).read("trajectories", 0, parts=[part]).num_rows == 1
    res = runner.invoke(app, ["lake", "compact", "--lake", uri])
    assert res.exit_code == 0 and "removed 0 files" in res.output, res.output
