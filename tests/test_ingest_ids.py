"""Issue 34: trajectory ids stay unique when several files of one layout are ingested together. The run in an
id is the file's stem, or for a stem that names no run (LLMDebugger's `<dataset>/<model>/results.jsonl`) its
two parent folders."""

from __future__ import annotations

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pipeline.ingest.ldb  # noqa: F401  (registers the adapters)
import pipeline.ingest.react  # noqa: F401
from pipeline.ingest.core import GENERIC_STEMS, SourceRecord, ingest
from pipeline.tokenize import ByteTokenizer
from warehouse.sources import read_text_sources

LDB = "ldb_code_repair/humaneval-gpt-3.5-turbo-0613.jsonl"


@pytest.fixture
def ldb_layout(real_data, tmp_path):
    """The shipped LDB HumanEval run laid out as LLMDebugger writes it, under two model folders."""
    src = real_data / LDB
    if not src.exists():
        pytest.skip(f"{LDB} not shipped")
    for model in ("gpt-3.5-turbo-0613", "codellama"):
        folder = tmp_path / "results" / "ldb" / "humaneval" / model
        folder.mkdir(parents=True)
        shutil.copy(src, folder / "results.jsonl")
    return tmp_path / "results"


def test_ldb_layout_of_several_models_ingests_whole(ldb_layout):
    sources = read_text_sources([str(ldb_layout)], (".jsonl",))
    assert len(sources) == 2
    res = ingest("ldb", sources, tokenizer=ByteTokenizer())
    assert res.quarantine.num_rows == 0 and res.trajectories.num_rows == 2 * 164
    ids = res.trajectories.column("traj_id").to_pylist()
    assert "humaneval/codellama:HumanEval/0" in ids and "humaneval/gpt-3.5-turbo-0613:HumanEval/0" in ids
    # one group per task, one sample per model
    groups = res.trajectories.group_by("group_id").aggregate([("sample_idx", "count_distinct")])
    assert set(groups.column("sample_idx_count_distinct").to_pylist()) == {2}


def test_the_same_file_twice_is_still_a_duplicate(ldb_layout):
    path = ldb_layout / "ldb" / "humaneval" / "codellama" / "results.jsonl"
    text = path.read_text()
    res = ingest("ldb", [(str(path), text), (str(path), text)], tokenizer=ByteTokenizer())
    assert res.trajectories.num_rows == 164 and res.quarantined_by_reason() == {"duplicate_traj_id": 164}
    # another copy of the run elsewhere, under the same dataset/model folders: quarantined, naming the first file
    other = "elsewhere/humaneval/codellama/results.jsonl"
    res = ingest("ldb", [(str(path), text), (other, text)], tokenizer=ByteTokenizer())
    assert res.quarantine.column("reason").to_pylist() == ["duplicate_traj_id"] * 164
    assert str(path) in res.quarantine.column("detail")[0].as_py()


def test_named_files_keep_their_stem(real_data):
    src = real_data / LDB
    if not src.exists():
        pytest.skip(f"{LDB} not shipped")
    res = ingest("ldb", [(f"some/dir/{src.name}", src.read_text())], tokenizer=ByteTokenizer())
    assert "humaneval-gpt-3.5-turbo-0613:HumanEval/0" in res.trajectories.column("traj_id").to_pylist()


name = st.text(alphabet="abcXYZ019-_.", min_size=1, max_size=8).filter(lambda s: s not in (".", ".."))


@given(
    st.lists(name, max_size=4),
    st.one_of(name, st.sampled_from(sorted(GENERIC_STEMS))),
    st.sampled_from([".jsonl", ".json"]),
)
def test_run_is_the_stem_or_the_folders(folders, stem, ext):
    rec = SourceRecord("/".join([*folders, stem + ext]), "line 1", "{}")
    if stem.lower() in GENERIC_STEMS and folders:
        assert rec.run == "/".join(folders[-2:])
    else:
        assert rec.run == rec.stem


def test_quarantine_reason_is_a_category_and_detail_the_words(ldb_layout):
    """The README's `SELECT reason, count(*) FROM quarantine GROUP BY ALL` gives one row per category."""
    import duckdb

    path = ldb_layout / "ldb" / "humaneval" / "codellama" / "results.jsonl"
    lines = path.read_text().splitlines()
    bad = ["{broken", '{"task_id": "x"}', '{"task_id": "y", "prompt": 1}', lines[0]]
    res = ingest("ldb", [(str(path), "\n".join([*lines[:3], *bad]))], tokenizer=ByteTokenizer())
    quarantine = res.quarantine  # noqa: F841  (read by DuckDB below)
    rows = duckdb.sql("SELECT reason, count(*) AS n FROM quarantine GROUP BY ALL ORDER BY reason").fetchall()
    assert rows == [("duplicate_traj_id", 1), ("malformed_json", 1), ("missing_field", 2)]
    details = dict(
        zip(res.quarantine["location"].to_pylist(), res.quarantine["detail"].to_pylist(), strict=True)
    )
    assert details["line 5"] == "'prompt' is missing" and "was already read" in details["line 7"]


def test_llmdebugger_mbpp_runs_of_two_models(real_data, tmp_path):
    """The issue's case on LLMDebugger's own files (results/ldb/mbpp/<model>/results.jsonl, shipped gzipped):
    both models' 500 MBPP runs ingest together; by file stem alone all 500 ids of the second would collide."""
    import gzip
    import json

    models = ("gpt-3.5-turbo-0613", "codellama")
    for model in models:
        src = real_data / "ldb_code_repair" / "mbpp" / model / "results.jsonl.gz"
        if not src.exists():
            pytest.skip(f"{src} not shipped")
        folder = tmp_path / "results" / "ldb" / "mbpp" / model
        folder.mkdir(parents=True)
        (folder / "results.jsonl").write_bytes(gzip.decompress(src.read_bytes()))
    sources = read_text_sources([str(tmp_path / "results")], (".jsonl",))
    tasks = [
        {json.loads(line)["task_id"] for line in text.splitlines() if line.strip()} for _, text in sources
    ]
    assert len(tasks[0] & tasks[1]) == 500  # the same 500 tasks: `results:<task>` would collide on every one
    res = ingest("ldb", sources, tokenizer=ByteTokenizer())
    assert res.quarantine.num_rows == 0 and res.trajectories.num_rows == 1000
    runs = {tid.split(":", 1)[0] for tid in res.trajectories.column("traj_id").to_pylist()}
    assert runs == {f"mbpp/{m}" for m in models}
