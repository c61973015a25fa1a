"""Faults of #22.8: a degraded LLM result is never cached as final (a re-run after the endpoint recovers asks
again); answers that are all garbage complete the round with warnings; two `process` runs on one lake never
break each other (one writer per (lake, round), temporary files named by their process)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
from test_flows_process import cfg_for, make_round

from flows.process_round import WARNING_STATE, process_round_flow
from warehouse.lake import FORMAT_ENV, FORMATS, Lake
from warehouse.locks import RoundBusy, round_lock


def process(cfg, round_: int = 0) -> dict:
    state = process_round_flow(round_=round_, config=cfg, return_state=True)
    return {**state.result(), "state": state.name}


def llm_cfg(lake: Lake, server, tmp_path: Path):
    return cfg_for(
        lake,
        methods=["grpo+iapo"],
        sets=[
            f"llm.endpoints=[{server.url}]",
            "llm.max_retries=0",
            "llm.timeout_s=5",
            f"llm.cache_dir={tmp_path / 'llm-cache'}",
            "flow.processes=false",
            "flow.retries=0",
        ],
        annotator="llm",
    )


@pytest.mark.slow
def test_degraded_llm_result_is_asked_again_after_recovery(tmp_path, prefect_harness, llm_standin):
    lake = Lake(tmp_path / "lake")
    batches = make_round(lake, groups=4, batch_groups=2)
    cfg = llm_cfg(lake, llm_standin, tmp_path)

    llm_standin.fail_next(10_000, "500")  # the endpoint is down: every trajectory falls back
    down = process(cfg)
    assert down["state"] == WARNING_STATE
    assert down["this_run"]["annotate"]["warnings"]

    llm_standin.reset()  # the endpoint is back, with answers in the annotator's schema
    llm_standin.behaviour = lambda body, kind, i: '{"actions": []}'
    calls = llm_standin.calls
    back = process(cfg)
    assert back["state"] != WARNING_STATE and not back["warnings"]
    assert back["this_run"]["annotate"]["cached"] == 0  # the fallbacks were not served from the cache
    assert llm_standin.calls > calls
    nodes = lake.read("nodes", 0)
    assert not pc.any(nodes.column("parse_failed")).as_py()

    calls = llm_standin.calls
    final = process(cfg)  # a good result is final: served from the cache, no request
    assert final["this_run"]["annotate"]["cached"] == len(batches)
    assert llm_standin.calls == calls


@pytest.mark.slow
def test_garbage_answers_complete_with_warnings(tmp_path, prefect_harness, llm_standin):
    lake = Lake(tmp_path / "lake")
    make_round(lake, groups=4, batch_groups=2)
    llm_standin.behaviour = lambda body, kind, i: "Sure! Here is the dependency graph you asked for :)"
    summary = process(llm_cfg(lake, llm_standin, tmp_path))
    assert summary["state"] == WARNING_STATE
    assert any("not the JSON schema" in w for w in summary["warnings"]), summary["warnings"]
    # the round is complete: iapo on its uniform fallback
    assert lake.read("advantages", 0).num_rows == lake.read("steps", 0).num_rows


# ---- one writer per (lake, round) ------------------------------------------------------------------------


def _holder(lake: Lake, round_: int) -> subprocess.Popen:
    code = (
        "import sys, time; sys.path.insert(0, '.');"
        "from warehouse.lake import Lake; from warehouse.locks import round_lock\n"
        f"with round_lock(Lake({str(lake.root)!r}), {round_}):\n"
        "    print('held', flush=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE
    )
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_round_lock_names_its_holder_and_dies_with_it(tmp_path):
    lake = Lake(tmp_path / "lake")
    holder = _holder(lake, 0)
    try:
        with pytest.raises(RoundBusy, match=rf"round 0 of .* is being processed by pid {holder.pid} since"):
            with round_lock(lake, 0):
                pass
        with round_lock(lake, 1):  # another round of the same lake is free
            with round_lock(lake, 1):  # re-entrant in one process (the CLI, then the flow)
                pass
    finally:
        holder.kill()  # kill -9: the kernel drops the lock with its holder
        holder.wait()
    with round_lock(lake, 0, wait_s=5):
        pass


@pytest.mark.parametrize("fmt", FORMATS)
def test_cleanup_keeps_a_live_runs_temporary_files(tmp_path, monkeypatch, fmt):
    from warehouse.tempfiles import temp_token

    monkeypatch.setenv(FORMAT_ENV, fmt)
    lake = Lake(tmp_path / "lake")
    assert lake.format == fmt
    # hive: a part's temp file in its partition folder; Delta (parts are commits): the lake's own temp files
    # (catalog, ledger) at its root
    folder = lake.partition_dir("advantages", 0) if fmt == "parquet" else lake.root
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(gone.stdout)
    live = folder / f".tmp-{temp_token()}-part-b00000.grpo.parquet"  # this process: alive
    dead = folder / f".tmp-{dead_pid}-0123abcd-part-b00001.grpo.parquet"
    unowned_old = folder / ".tmp-0123456789abcdef-part-b00002.grpo.parquet"
    unowned_new = folder / ".tmp-fedcba9876543210-part-b00003.grpo.parquet"
    for p in (live, dead, unowned_old, unowned_new):
        p.write_bytes(b"x")
    os.utime(unowned_old, (time.time() - 7200, time.time() - 7200))
    staging = lake.table_dir("advantages") / f".staging-{temp_token()}"
    staging.mkdir(parents=True)
    lake.cleanup()
    assert live.exists() and unowned_new.exists() and staging.exists()
    assert not dead.exists() and not unowned_old.exists()


@pytest.mark.slow
def test_two_process_runs_on_one_lake(tmp_path, prefect_harness):
    """Three real `creditflow process` runs at once: two on round 0 (one runs, the other stops with one line),
    one on round 1 (runs beside them); both rounds end complete and equal to rounds processed alone."""
    from prefect.settings import PREFECT_API_URL

    from flows.batch import run_batch_plain
    from warehouse.rounds import batch_names

    lake, reference = Lake(tmp_path / "lake"), Lake(tmp_path / "reference")
    for r in (0, 1):
        make_round(lake, round_=r, groups=16, batch_groups=2, seed=r)
        make_round(reference, round_=r, groups=16, batch_groups=2, seed=r)
    methods = "grpo,grpo+c3,gae"
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "200"}

    def start(round_: int) -> subprocess.Popen:
        cmd = _process_cmd(lake, round_, methods)
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    procs = [start(0), start(0), start(1)]
    outcomes = []
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        outcomes.append((proc.returncode, err.decode()))
    first, second, other = outcomes
    assert other[0] == 0, other[1][-3000:]
    assert sorted([first[0], second[0]]) == [0, 1], (first[1][-3000:], second[1][-3000:])
    stopped = [line for line in (first if first[0] else second)[1].splitlines() if line.startswith("error:")]
    assert len(stopped) == 1 and "round 0 of" in stopped[0] and "is being processed by pid" in stopped[0]

    cfg = cfg_for(reference, methods=methods.split(","))
    for r in (0, 1):
        for b in batch_names(reference, r):
            run_batch_plain(reference, r, b, cfg)
        for table in ("advantages", "train_batch"):
            keys = [("method", "ascending"), ("traj_id", "ascending")]
            got, want = lake.read(table, r).sort_by(keys), reference.read(table, r).sort_by(keys)
            assert got.num_rows == want.num_rows > 0, table
            if table == "advantages":
                order = [*keys, ("step_idx", "ascending")]
                assert got.sort_by(order).column("token_adv").equals(want.sort_by(order).column("token_adv"))
    assert not list(lake.root.rglob(".tmp-*"))


def test_round_lock_names_a_holder_caught_before_its_line(tmp_path):
    """A holder between its flock and its "pid N since" line (CI caught a second `process` there, which then
    named "another run"): the contender looks again until the line is there."""
    from warehouse.locks import lock_path

    lake = Lake(tmp_path / "lake")
    path = lock_path(lake, 0)
    path.parent.mkdir(parents=True)
    code = (
        "import fcntl, os, sys, time\n"
        f"fh = open({str(path)!r}, 'a+')\n"
        "fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('held', flush=True); time.sleep(0.4)\n"
        "fh.write(f'pid {os.getpid()} since now\\n'); fh.flush(); time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(RoundBusy, match=rf"is being processed by pid {holder.pid} since now;"):
            with round_lock(lake, 0):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_a_hostile_lock_file_is_repeated_as_one_short_printable_line(tmp_path):
    """Whatever a lock file holds (a huge file, several lines, terminal escapes), the error names at most the
    first HOLDER_CHARS printable characters of its first line."""
    from warehouse.locks import HOLDER_CHARS, lock_path

    lake = Lake(tmp_path / "lake")
    path = lock_path(lake, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"pid 7 \x1b[31mred\x07 " + b"x" * 5_000_000 + b"\nsecond line\n\xff\xfe")
    code = (
        "import fcntl, sys, time\n"
        f"fh = open({str(path)!r}, 'rb')\n"
        "fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
        "print('held', flush=True); time.sleep(120)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(RoundBusy) as info:
            with round_lock(lake, 0):
                pass
    finally:
        holder.kill()
        holder.wait()
    msg = str(info.value)
    named = msg.split("is being processed by ", 1)[1].split(";", 1)[0]
    assert named == "pid 7 ?[31mred? " + "x" * (HOLDER_CHARS - len("pid 7 ?[31mred? "))
    assert "\n" not in msg and "\x1b" not in msg and len(msg) < HOLDER_CHARS + 400


def test_round_lock_waits_for_its_holder_saying_so_once(tmp_path):
    import math

    lake = Lake(tmp_path / "lake")
    holder = _holder(lake, 0)
    try:
        lines: list[str] = []
        with pytest.raises(RoundBusy, match=r"\(waited \d+ s\)"):  # a bounded wait gives up, saying how long
            with round_lock(lake, 0, wait_s=0.5, on_wait=lines.append):
                pass
        assert len(lines) == 1 and f"processed by pid {holder.pid} since" in lines[0]
        assert "up to 0.5 s" in lines[0]
        lines.clear()
        got = threading.Event()

        def waiter() -> None:
            with round_lock(lake, 0, wait_s=math.inf, poll_s=0.05, on_wait=lines.append):
                got.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.5)
        assert not got.is_set()  # still waiting while the holder runs
    finally:
        holder.kill()
        holder.wait()
    thread.join(timeout=10)
    assert got.is_set()
    assert len(lines) == 1 and f"pid {holder.pid}" in lines[0] and "up to" not in lines[0], lines


def _process_cmd(lake: Lake, round_: int, methods: str, *extra: str) -> list[str]:
    return [
        str(Path(sys.executable).parent / "creditflow"),
        "process",
        "--lake",
        str(lake.root),
        "--round",
        str(round_),
        "--methods",
        methods,
        "--max-workers",
        "1",
        "--set",
        "flow.progress=false",
        *extra,
    ]


@pytest.mark.slow
def test_a_second_process_run_with_wait_waits_then_finds_the_work_cached(tmp_path, prefect_harness):
    """Two real `creditflow process` runs of one round: the second, started while the first holds the round,
    with --wait: it says once that it waits and for whom, then runs, finding every stage cached (no stage runs
    again); both exit 0 and the round equals one processed alone."""
    from prefect.settings import PREFECT_API_URL
    from test_flows_process import sorted_table

    from flows.batch import run_batch_plain
    from warehouse.locks import lock_path
    from warehouse.rounds import batch_names

    lake, reference = Lake(tmp_path / "lake"), Lake(tmp_path / "reference")
    make_round(lake, groups=16, batch_groups=2)
    make_round(reference, groups=16, batch_groups=2)
    methods = "grpo,grpo+c3,gae"
    env = {**os.environ, "PREFECT_API_URL": str(PREFECT_API_URL.value()), "COLUMNS": "200"}
    pipe = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.PIPE}
    first = subprocess.Popen(_process_cmd(lake, 0, methods), **pipe)
    deadline = time.monotonic() + 120
    while f"pid {first.pid} " not in (lock_path(lake, 0).read_text() if lock_path(lake, 0).exists() else ""):
        assert first.poll() is None and time.monotonic() < deadline, "the first run never took the round"
        time.sleep(0.05)
    second = subprocess.Popen(_process_cmd(lake, 0, methods, "--wait"), **pipe)
    took: list[float] = []  # when the second run took the round (its pid in the lock file)

    def watch() -> None:
        while second.poll() is None and not took:
            text = lock_path(lake, 0).read_text() if lock_path(lake, 0).exists() else ""
            if f"pid {second.pid} " in text:
                took.append(time.time())
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    outcomes = []
    for proc in (first, second):
        _, err = proc.communicate(timeout=600)
        outcomes.append((proc.returncode, err.decode()))
    watcher.join(10)
    assert [code for code, _ in outcomes] == [0, 0], [err[-3000:] for _, err in outcomes]
    waits = [ln for ln in outcomes[1][1].splitlines() if "waiting for it to finish" in ln]
    assert len(waits) == 1, outcomes[1][1][-3000:]
    assert f"is being processed by pid {first.pid} since" in waits[0], waits
    # the second run recomputed nothing: every stage's run log row was written before it took the round
    assert took, "the second run never took the round"
    runs = lake.read("stage_runs", 0)
    assert runs.num_rows >= len(batch_names(lake, 0))
    last = max(t.timestamp() for t in runs.column("finished_at").to_pylist())
    assert last < took[0], (last, took[0])

    cfg = cfg_for(reference, methods=methods.split(","))
    for b in batch_names(reference, 0):
        run_batch_plain(reference, 0, b, cfg)
    for table in ("advantages", "train_batch"):
        got, want = sorted_table(lake, table), sorted_table(reference, table)
        assert got.num_rows == want.num_rows > 0, table
        assert got.equals(want), table


def test_cleanup_judges_another_hosts_temporary_files_by_age(tmp_path, monkeypatch):
    """A lake on a shared filesystem: a temp name carries its writer's machine, and a process id of another
    machine means nothing here (the same number may be a dead process here, or a live unrelated one), so
    another host's files stay until they are over a day old; this host's are judged by their process."""
    from warehouse.tempfiles import STALE_OTHER_HOST_S, host_name, temp_token

    monkeypatch.setenv(FORMAT_ENV, "parquet")
    lake = Lake(tmp_path / "lake")
    folder = lake.partition_dir("advantages", 0)
    folder.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    dead_pid = int(gone.stdout)
    assert temp_token().startswith(f"{os.getpid()}@{host_name()}@")
    other = "node-17.cluster.local" if host_name() != "node-17.cluster.local" else "node-18"
    hex_ = "0123456789abcdef0123456789abcdef"
    other_fresh = folder / f".tmp-{dead_pid}@{other}@{hex_}-part-b00000.grpo.parquet"  # dead pid *here*
    other_old = folder / f".tmp-{dead_pid}@{other}@{hex_}-part-b00001.grpo.parquet"
    other_staging = lake.table_dir("advantages") / f".staging-{dead_pid}@{other}@{hex_}"
    mine_dead = folder / f".tmp-{dead_pid}@{host_name()}@{hex_}-part-b00002.grpo.parquet"
    mine_live = folder / f".tmp-{temp_token()}-part-b00003.grpo.parquet"
    for p in (other_fresh, other_old, mine_dead, mine_live):
        p.write_bytes(b"x")
    other_staging.mkdir()
    day_ago = time.time() - STALE_OTHER_HOST_S - 60
    os.utime(other_old, (day_ago, day_ago))
    lake.cleanup()
    assert other_fresh.exists() and other_staging.exists() and mine_live.exists()
    assert not other_old.exists() and not mine_dead.exists()
