"""A round's ingest writes all its tables or none (#33): `creditflow ingest` killed with SIGKILL at each point of
its write ($CREDITFLOW_FAULT, `warehouse.lake.fault_point`), or stopped by a full disk (simulated at the same
points, and a real one: RLIMIT_FSIZE), leaves the round every reader sees (the batch reads `process` makes, the
whole-table reads, SQL) as it was before the publish or whole after it, never half; a re-run completes it and
leaves no other generation behind. Delta (local and on moto's S3 server) and the hive layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_lake_s3 import bucket, s3_endpoint, s3_env  # noqa: F401 - the fixtures of the moto server

from warehouse.lake import FAULT_ENV, FORMAT_ENV, Lake, split_generation
from warehouse.rounds import batch_names, read_batch

CLI = str(Path(sys.executable).parent / "creditflow")
KILLED = -9
# (fault point, what a reader sees after a kill there): before the publish the old round, after it the new
POINTS = {
    "delta": [("ingest-stage", "old"), ("ingest-staged", "old"), ("ingest-published", "new")],
    "parquet": [
        ("ingest-stage", "old"),
        ("ingest-staged", "old"),
        ("publish-journal", "new"),  # rolled forward by the next reader
        ("publish-first-move", "new"),  # trajectories moved in, steps not yet: rolled forward
    ],
}


def _source(path: Path, tag: str, groups: int, bad: int) -> Path:
    rows = [
        json.dumps(
            {
                "traj_id": f"{tag}{g}-{s}",
                "group_id": f"{tag}g{g}",
                "reward": float(s),
                "messages": [
                    {"role": "user", "content": f"question {g}"},
                    {"role": "assistant", "content": f"answer {s}"},
                ],
            }
        )
        for g in range(groups)
        for s in range(2)
    ]
    rows += [
        '{"traj_id": "broken", "messages": ['
    ] * bad  # quarantined records (their number tells the two apart)
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.fixture
def sources(tmp_path):
    old = _source(tmp_path / "old.jsonl", "a", groups=3, bad=1)
    new = _source(tmp_path / "new.jsonl", "b", groups=7, bad=2)
    expect = {
        "old": ({f"a{g}-{s}" for g in range(3) for s in range(2)}, 1),
        "new": ({f"b{g}-{s}" for g in range(7) for s in range(2)}, 2),
    }
    return old, new, expect


def _ingest(src: Path, lake: str, fault: str | None = None, env: dict | None = None, preexec=None, prefix=()):
    full = {**os.environ, **(env or {})}
    full.pop(FAULT_ENV, None)
    if fault:
        full[FAULT_ENV] = fault
    args = [*prefix, CLI, "ingest", str(src), "--format", "chat-jsonl", "--lake", lake, "--round", "0"]
    args += ["--tokenizer", "bytes", "--batch-groups", "2"]
    return subprocess.run(args, env=full, capture_output=True, text=True, timeout=300, preexec_fn=preexec)


def _seen(uri: str) -> tuple[set[str], int]:
    """The round as every reader sees it, checked to be one round: the batches `process` reads (each part's
    steps are its trajectories' steps), the whole-table reads and SQL agree. Returns (traj ids, quarantined)."""
    from warehouse.catalog import query

    lake = Lake(uri)
    ids: set[str] = set()
    for name in batch_names(lake, 0):
        traj = set(read_batch(lake, "trajectories", 0, name).column("traj_id").to_pylist())
        steps = set(read_batch(lake, "steps", 0, name).column("traj_id").to_pylist())
        assert steps == traj and traj, f"part {name}: steps of {sorted(steps ^ traj)} do not match"
        ids |= traj
    assert set(lake.read("trajectories", 0).column("traj_id").to_pylist()) == ids
    assert set(lake.read("steps", 0).column("traj_id").to_pylist()) == ids
    quarantined = lake.read("quarantine", 0).num_rows
    sql = query(
        lake,
        "SELECT (SELECT count(*) FROM trajectories) AS t, (SELECT count(DISTINCT traj_id) FROM steps) AS s, "
        "(SELECT count(*) FROM quarantine) AS q",
    ).to_pylist()[0]
    assert sql == {"t": len(ids), "s": len(ids), "q": quarantined}
    return ids, quarantined


def _generations(uri: str) -> set[str]:
    """The generations stored in the ingest tables of round 0 (Delta), visible or not."""
    lake = Lake(uri)
    if lake.format != "delta":
        return set()
    out = set()
    for table in ("trajectories", "steps", "quarantine"):
        acts = lake._raw_actions(table)
        if acts is not None:
            out |= {split_generation(n)[1] for n in acts.column("partition._part").to_pylist()}
    return out


def _staged_leftovers(uri: str) -> list[str]:
    lake = Lake(uri)
    if lake.format != "parquet":
        return []
    return [str(p) for p in lake.root.glob("*/.staging-*")] + [
        str(p) for p in lake.root.glob("_flow/publish/*")
    ]


def _kill_and_rerun(uri: str, sources, point: str, after: str) -> None:
    old, new, expect = sources
    assert _ingest(old, uri).returncode == 0
    assert _seen(uri) == expect["old"]
    res = _ingest(new, uri, fault=point)
    assert res.returncode == KILLED, res.stderr
    assert _seen(uri) == expect[after], point
    res = _ingest(new, uri)
    assert res.returncode == 0, res.stderr
    assert _seen(uri) == expect["new"]
    assert len(_generations(uri)) <= 1 and not _staged_leftovers(uri)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["delta", "parquet"])
def test_kill_at_every_point_of_an_ingest_leaves_one_whole_round(fmt, tmp_path, sources, monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, fmt)
    for k, (point, after) in enumerate(POINTS[fmt]):
        uri = str(tmp_path / f"lake{k}")
        _kill_and_rerun(uri, sources, point, after)
        assert Lake(uri).format == fmt


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["delta", "parquet"])
def test_a_full_disk_leaves_the_old_round_and_says_so_in_one_line(fmt, tmp_path, sources, monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, fmt)
    old, new, expect = sources
    uri = str(tmp_path / "lake")
    assert _ingest(old, uri).returncode == 0
    for point in ("ingest-stage", "ingest-staged"):
        res = _ingest(new, uri, fault=f"{point}:enospc", env={FORMAT_ENV: fmt})
        assert res.returncode == 1, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "No space left on device" in lines[0], res.stderr
        assert _seen(uri) == expect["old"]
    # a real one: the process may write no file past 1 KB (EFBIG from the kernel, in delta-rs or pyarrow)
    res = _ingest(new, uri, preexec=_file_size_limit(1024))
    assert res.returncode == 1, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "panicked" not in res.stderr, res.stderr
    assert _seen(uri) == expect["old"]
    assert _ingest(new, uri).returncode == 0
    assert _seen(uri) == expect["new"] and len(_generations(uri)) <= 1 and not _staged_leftovers(uri)


def _file_size_limit(limit: int):
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_read_only_lake_is_one_line(sources, monkeypatch):
    """Another user's lake (no write permission): one line naming the folder, no Rust panic, exit 2."""
    import shutil
    import tempfile

    monkeypatch.delenv(FORMAT_ENV, raising=False)
    old, new, expect = sources
    base = Path(tempfile.mkdtemp(prefix="creditflow-ro-"))
    try:
        uri = str(base / "lake")
        assert _ingest(old, uri).returncode == 0
        shutil.copy(new, base / "new.jsonl")
        prefix: tuple[str, ...] = ()
        if os.geteuid() == 0:  # root writes anywhere: the lake is root's and the ingest runs as nobody
            if not shutil.which("setpriv"):
                pytest.skip("running as root without setpriv: no way to be a user the lake refuses")
            for path in [base, *base.rglob("*")]:
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            prefix = ("setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups")
        else:
            for path in Path(uri).rglob("*"):
                os.chmod(path, os.stat(path).st_mode & ~0o222)
        res = _ingest(base / "new.jsonl", uri, env={"HOME": str(base / "home")}, prefix=prefix)
        assert res.returncode == 2, res.stderr
        root = Path(uri).resolve()
        assert res.stderr.strip().splitlines() == [
            f"lake {root}: cannot write {root / 'quarantine'} (no write permission)"
        ]
        assert _seen(uri) == expect["old"]
    finally:
        for path in base.rglob("*"):
            os.chmod(path, 0o755)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_kill_during_an_ingest_on_s3(bucket, s3_env, sources):  # noqa: F811 - fixtures
    for k, (point, after) in enumerate(POINTS["delta"]):
        _kill_and_rerun(f"s3://{bucket}/lake{k}", sources, point, after)
