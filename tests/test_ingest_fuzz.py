"""Fuzzing every ingest format (#22): real records (data/real and the test fixtures), mutated by hypothesis
(fields deleted, types changed, NaN/inf/huge/negative numbers, lone surrogates, JSON nested ~1100 deep, bytes
that are not UTF-8, truncation, corrupt Parquet/npz files, dropped or retyped columns), read the way
`creditflow ingest` reads them. Always: no exception escapes, ingested + quarantined == records read ==
the records the test wrote (counted from its own input by the format's record unit: a line, an array item,
an `idx:` block, a table row; a lower bound where damaged bytes leave the unit to the reader's recovery), the
three tables satisfy their schemas, and the ingested token data is sound."""

from __future__ import annotations

import copy
import io
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.ingest import get_adapter, ingest
from pipeline.ingest.core import LOGPROB_TOLERANCE, TOKEN_ID_LIMIT
from pipeline.tokenize import ByteTokenizer
from schemas import quarantine as quarantine_schema
from schemas import steps as steps_schema
from schemas import trajectories as trajectories_schema
from warehouse.interop_sources import read_raw_sources
from warehouse.sources import read_table_sources, read_text_sources

BYTES = ByteTokenizer()
REAL = Path(__file__).resolve().parents[1] / "data" / "real"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
_counter = itertools.count()

DEEP = "\x00DEEP\x00"  # replaced by ~1100 nested arrays after serialising (json.dumps would recurse)
NASTY = [
    None,
    "",
    "x",
    "\ud800",
    "a\udc80b",
    0,
    -1,
    -6,
    2**31 + 5,
    2**40,
    2**64,
    2**70,
    -(2**63),
    1e308,
    -1e308,
    math.nan,
    math.inf,
    -math.inf,
    5.0,
    True,
    [],
    {},
    [math.nan, 2**40, -6],
    {"role": "narrator"},
    DEEP,
]


# ---- mutations ---------------------------------------------------------------------------------------------


def _mutate_tree(data, tree):
    """Up to three structural mutations at random paths of a parsed JSON value (returns the new value)."""
    tree = copy.deepcopy(tree)
    for _ in range(data.draw(st.integers(0, 3), label="n_mutations")):
        parent, key, node = None, None, tree
        while isinstance(node, (dict, list)) and node and data.draw(st.integers(0, 3), label="descend") > 0:
            keys = sorted(node) if isinstance(node, dict) else range(len(node))
            parent, key = node, data.draw(st.sampled_from(list(keys)), label="key")
            node = node[key]
        op = data.draw(st.sampled_from(["replace", "delete", "retype", "insert"]), label="op")
        value = copy.deepcopy(data.draw(st.sampled_from(NASTY), label="value"))  # never shared
        if parent is None:
            if op in ("replace", "retype"):
                tree = value if op == "replace" else [tree]
            continue
        if op == "delete":
            del parent[key]
        elif op == "replace":
            parent[key] = value
        elif op == "retype":
            old = parent[key]
            parent[key] = str(old) if not isinstance(old, str) else ([old] if len(old) % 2 else {"v": old})
        elif isinstance(parent, dict):
            parent[data.draw(st.sampled_from(["extra", "token_ids", "logprobs", "reward", "meta"]))] = value
        else:
            parent.insert(key, value)
    return tree


def _dumps(value) -> str:
    text = json.dumps(value, allow_nan=True)  # lone surrogates as \\ud800 escapes; NaN/Infinity literals
    return text.replace(json.dumps(DEEP), "[" * 1100 + "]" * 1100)


def _mutate_bytes(data, raw: bytes) -> bytes:
    """Byte-level damage: none, truncation, bytes that are not UTF-8, or a deeply nested value spliced in."""
    op = data.draw(st.sampled_from(["none", "none", "truncate", "bad_utf8", "deep"]), label="byte_op")
    if op == "none" or not raw:
        return raw
    at = data.draw(st.integers(0, len(raw)), label="at")
    if op == "truncate":
        return raw[:at]
    if op == "bad_utf8":
        bad = data.draw(
            st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\xfe\xff"]), label="bytes"
        )
        return raw[:at] + bad + raw[at:]
    return raw[:at] + b"[" * 1100 + b"]" * 1100 + raw[at:]


def _workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(f"fuzz{next(_counter)}", numbered=False)
    return path


# ---- the invariants ------------------------------------------------------------------------------------------


def _check(res, expected_records: int, exact: bool = True):
    """The invariants; `expected_records`: what the test wrote, counted from its own input (`exact=False`: a
    lower bound, where damaged bytes leave the count to the reader's recovery)."""
    q = res.quarantine
    out = res.trajectories.num_rows + q.num_rows
    assert out == res.stats["records_read"], (
        res.trajectories.num_rows,
        q.num_rows,
        res.stats["records_read"],
        q.column("reason").to_pylist(),
    )
    if exact:
        assert out == expected_records, (out, expected_records, q.column("reason").to_pylist())
    else:
        assert out >= expected_records, (out, expected_records, q.column("reason").to_pylist())
    trajectories_schema.validate(res.trajectories)
    steps_schema.validate(res.steps)
    quarantine_schema.validate(q)
    assert all(r for r in q.column("reason").to_pylist())
    assert set(res.steps.column("traj_id").to_pylist()) <= set(res.trajectories.column("traj_id").to_pylist())
    ids = res.steps.column("token_ids").combine_chunks()
    flat = ids.values.to_numpy() if len(ids) else np.zeros(0)
    assert ((flat >= 0) & (flat < TOKEN_ID_LIMIT)).all()
    lp_rows = [x for x in res.steps.column("logprobs").to_pylist() if x is not None]
    lp = np.array([v for row in lp_rows for v in row], dtype=np.float64)
    assert np.isfinite(lp).all() and (lp <= LOGPROB_TOLERANCE).all()
    for text in res.steps.column("content").to_pylist():
        text.encode("utf-8")


UNPARSED = object()


def _parsed(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return UNPARSED


def _records_in_document(fmt: str, tree) -> int:
    """Records a JSON document of `fmt` holds, by the format's unit: tau-bench a list of results, tau2-bench
    the `simulations` list of an object, react an object id -> trajectory, rllm an episode (a record per trajectory) or a list of them;
    any other shape is one (quarantined) record."""
    if fmt == "tau-bench":
        return len(tree) if isinstance(tree, list) else 1
    if fmt == "rllm":  # a record per trajectory of an episode
        return sum(map(_rllm_episode, tree)) if isinstance(tree, list) else _rllm_episode(tree)
    if fmt == "tau2-bench":
        sims = tree.get("simulations") if isinstance(tree, dict) else None
        return len(sims) if isinstance(sims, list) else 1
    assert fmt == "react"
    return len(tree) if isinstance(tree, dict) else 1


def _rllm_episode(episode) -> int:
    trajectories = episode.get("trajectories") if isinstance(episode, dict) else None
    return len(trajectories) if isinstance(trajectories, list) and trajectories else 1


def _document_records(fmt: str, tree, raw: bytes, written: bytes) -> tuple[int, bool]:
    """(records, exact) of one written JSON document: from the test's tree when its bytes arrived intact,
    else from the written bytes parsed by `json`; bytes `json` cannot parse hold at least one record (the
    reader keeps what it can and quarantines the rest as one), rllm's blank file none."""
    if written == raw:
        return _records_in_document(fmt, tree), True
    text = written.decode("utf-8", "surrogateescape")
    parsed = _parsed(text)
    if parsed is not UNPARSED:
        return _records_in_document(fmt, parsed), True
    return (0 if fmt == "rllm" and not text.strip() else 1), False


def _ingest_text_files(fmt: str, folder: Path):
    spec = get_adapter(fmt)
    return ingest(fmt, read_text_sources([folder], spec.extensions), tokenizer=BYTES)


# ---- seeds: real records, trimmed so that each example stays fast ---------------------------------------------


def _real(path: str) -> Path:
    p = REAL / path
    if not p.exists():
        pytest.skip(f"{p} is not shipped")
    return p


def _chat_records() -> list[dict]:
    from test_ingest_quarantine import _good

    return [_good("g1"), _good("g2", group_id="q2"), _good("g3", reward=0.0)]


def _jsonl_seed(records: list[dict]):
    return [json.dumps(r, ensure_ascii=False) for r in records]


def _fuzz_jsonl(
    data, tmp_path_factory, fmt: str, records: list[dict], name="rollouts.jsonl", one_per_line: bool = True
):
    lines = []
    for rec in records:
        tree = _mutate_tree(data, rec) if data.draw(st.booleans(), label="mutate record") else rec
        lines.append(_dumps(tree))
    raw = _mutate_bytes(data, "\n".join(lines).encode("utf-8"))
    folder = _workdir(tmp_path_factory)
    (folder / name).write_bytes(raw)
    res = _ingest_text_files(fmt, folder)
    lines = [line for line in raw.decode("utf-8", "surrogateescape").splitlines() if line.strip()]
    # ROLL's step dump holds a whole batch per line: one record per row of its column lists
    _check(res, len(lines) if one_per_line else sum(_roll_rows(line) for line in lines))


def _roll_rows(line: str) -> int:
    """Records in one line of a ROLL dump: the rows of a column dump (`trajectory_data` and every value a list
    of one length), else the line is one record."""
    data = _parsed(line)
    if not isinstance(data, dict) or "trajectory_data" not in data:
        return 1
    lens = {len(v) if isinstance(v, list) else None for v in data.values()}
    return lens.pop() if len(lens) == 1 and None not in lens else 1


def _fuzz_json(data, tmp_path_factory, fmt: str, tree, name: str):
    tree = _mutate_tree(data, tree)
    intact = _dumps(tree).encode("utf-8")
    raw = _mutate_bytes(data, intact)
    folder = _workdir(tmp_path_factory)
    (folder / name).write_bytes(raw)
    _check(_ingest_text_files(fmt, folder), *_document_records(fmt, tree, intact, raw))


@FUZZ
@given(data=st.data())
def test_fuzz_chat_jsonl(data, tmp_path_factory):
    _fuzz_jsonl(data, tmp_path_factory, "chat-jsonl", _chat_records())


@pytest.fixture(scope="module")
def ldb_records():
    lines = _real("ldb_code_repair/humaneval-gpt-3.5-turbo-0613.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:3]]


@FUZZ
@given(data=st.data())
def test_fuzz_ldb(data, tmp_path_factory, ldb_records):
    _fuzz_jsonl(data, tmp_path_factory, "ldb", ldb_records)


@pytest.fixture(scope="module")
def tau_tree():
    return json.loads(_real("tau_bench_v1/gpt-4o-airline.json").read_text())[:3]


@FUZZ
@given(data=st.data())
def test_fuzz_tau_bench(data, tmp_path_factory, tau_tree):
    _fuzz_json(data, tmp_path_factory, "tau-bench", tau_tree, "results.json")


@pytest.fixture(scope="module")
def tau2_tree():
    tree = json.loads(_real("tau2_bench/qwen2.5-7b_airline_1trial.json").read_text())
    sims = tree["simulations"][:3]
    tasks = {s["task_id"] for s in sims}
    tree["simulations"] = sims
    tree["tasks"] = [t for t in tree["tasks"] if t.get("id") in tasks]
    return tree


@FUZZ
@given(data=st.data())
def test_fuzz_tau2_bench(data, tmp_path_factory, tau2_tree):
    _fuzz_json(data, tmp_path_factory, "tau2-bench", tau2_tree, "results.json")


@pytest.fixture(scope="module")
def react_tree():
    tree = json.loads(_real("fireact_hotpotqa").glob("*.json").__next__().read_text())
    return dict(itertools.islice(tree.items(), 3))


@FUZZ
@given(data=st.data())
def test_fuzz_react(data, tmp_path_factory, react_tree):
    _fuzz_json(data, tmp_path_factory, "react", react_tree, "trajs.json")


@pytest.fixture(scope="module")
def rllm_files():
    folder = FIXTURES / "rllm" / "episodes"
    if not folder.exists():
        pytest.skip("rllm fixture not shipped")
    files = sorted(p for p in folder.rglob("*.json"))[:3]
    return [(p.relative_to(folder), json.loads(p.read_text())) for p in files]


@FUZZ
@given(data=st.data())
def test_fuzz_rllm(data, tmp_path_factory, rllm_files):
    folder = _workdir(tmp_path_factory)
    expected, exact = 0, True
    for rel, tree in rllm_files:
        tree = _mutate_tree(data, tree)
        intact = _dumps(tree).encode("utf-8")
        raw = _mutate_bytes(data, intact)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(raw)
        # rLLM's EpisodeLogger writes batch_summary.json beside the episodes: it holds no episode
        n, file_exact = (
            (0, True) if rel.name == "batch_summary.json" else _document_records("rllm", tree, intact, raw)
        )
        expected, exact = expected + n, exact and file_exact
    _check(_ingest_text_files("rllm", folder), expected, exact)


def _interop_samples():
    try:
        import interop_samples
    except ImportError:
        pytest.skip("tests/interop_samples.py is not there")
    return interop_samples


def _sample_files(writer: str, tmp_path_factory, suffixes) -> list[tuple[Path, bytes]]:
    fn = getattr(_interop_samples(), writer, None)
    if fn is None:
        pytest.skip(f"interop_samples.{writer} is gone")
    root = fn(tmp_path_factory.mktemp(writer))
    root = root[0].parent if isinstance(root, tuple) else root
    root = root if root.is_dir() else root.parent
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)[:3]
    return [(p.relative_to(root), p.read_bytes()) for p in files]


@pytest.fixture(scope="module")
def areal_files(tmp_path_factory):
    return _sample_files("write_areal", tmp_path_factory, (".txt", ".jsonl"))


AREAL_SUBS = [
    (r"reward is ", ["reward is nan", "reward is inf", "reward is 1e999", "reward is x", "reward is "]),
    (r"idx: ", ["idx: -5", "idx: 99999999999999999999", "idx: "]),
    ("\x1b[0m", ["", "\x1b[0m\x1b[0m"]),
    ("seqlen: ", ["seqlen: -1", "seqlen: 1e9"]),
    # AReaL's rollout/<version>/<task_id>.jsonl records
    ('"reward": ', ['"reward": NaN, "x": ', '"reward": "x", "x": ', '"reward": 1e999, "x": ', '"reward": ']),
    ('"prompt": ', ['"prompt": null, "x": ', '"prompt": 5, "x": ', '"prompt": ']),
    ('"task_id": ', ['"task_id": [1], "x": ', '"task_id": null, "x": ', '"task_id": ']),
    ('"sample_idx": ', ['"sample_idx": 1e30, "x": ', '"sample_idx": -1, "x": ']),
]


@FUZZ
@given(data=st.data())
def test_fuzz_areal(data, tmp_path_factory, areal_files):
    folder = _workdir(tmp_path_factory)
    expected = 0
    for rel, raw in areal_files:
        text = raw.decode("utf-8")
        for _ in range(data.draw(st.integers(0, 2), label="n_subs")):
            needle, options = data.draw(st.sampled_from(AREAL_SUBS), label="sub")
            if needle in text:
                at = data.draw(st.integers(0, text.count(needle) - 1), label="which")
                head, *parts = text.split(needle)
                repl = data.draw(st.sampled_from(options), label="repl")
                parts[at] = repl[len(needle) :] + parts[at] if repl.startswith(needle) else parts[at]
                text = head + needle.join(parts)
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        raw = _mutate_bytes(data, text.encode("utf-8"))
        (folder / rel).write_bytes(raw)
        expected += _areal_records(str(rel), raw.decode("utf-8", "surrogateescape"))
    _check(_ingest_text_files("areal", folder), expected)


def _areal_records(name: str, text: str) -> int:
    """Records in an AReaL dump: `.jsonl` one per non-blank line; `.txt` one per `idx:` block, plus one for
    text before the first block."""
    if not name.endswith(".txt"):
        return sum(1 for line in text.splitlines() if line.strip())
    starts = [m.start() for m in re.finditer(r"^idx: ", text, re.MULTILINE)]
    return len(starts) + bool(text[: starts[0] if starts else len(text)].strip())


@pytest.fixture(scope="module")
def roll_records(tmp_path_factory):
    files = _sample_files("write_roll", tmp_path_factory, (".jsonl",))
    return [json.loads(line) for _, raw in files for line in raw.decode().splitlines() if line.strip()][:3]


@FUZZ
@given(data=st.data())
def test_fuzz_roll(data, tmp_path_factory, roll_records):
    _fuzz_jsonl(data, tmp_path_factory, "roll", roll_records, name="rollouts.jsonl", one_per_line=False)


# ---- table formats -------------------------------------------------------------------------------------------


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


NASTY_CELLS = [None, -6, 2**31 + 5, 2**40, math.nan, math.inf, 5.0, "x", [], [-6, 2**40], [math.nan, 5.0]]


def _mutate_table(data, table: pa.Table) -> pa.Table:
    """Drop or retype a column, or put a nasty value into one cell (lists get a nasty element)."""
    for _ in range(data.draw(st.integers(0, 2), label="n_table_ops")):
        if not table.num_columns:
            break
        name = data.draw(st.sampled_from(table.column_names), label="column")
        op = data.draw(st.sampled_from(["drop", "to_string", "cell", "cell"]), label="table_op")
        i = table.column_names.index(name)
        if op == "drop":
            table = table.drop([name])
        elif op == "to_string":
            table = table.set_column(
                i, name, pa.array([json.dumps(v, default=str) for v in table[name].to_pylist()])
            )
        elif table.num_rows:
            rows = table[name].to_pylist()
            r = data.draw(st.integers(0, len(rows) - 1), label="row")
            value = copy.deepcopy(data.draw(st.sampled_from(NASTY_CELLS), label="cell"))
            if isinstance(rows[r], list) and rows[r] and not isinstance(value, list):
                rows[r] = list(rows[r])
                rows[r][data.draw(st.integers(0, len(rows[r]) - 1), label="pos")] = value
            else:
                rows[r] = value
            try:
                col = pa.array(rows, type=table.schema.field(name).type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
                try:
                    col = pa.array(rows)
                except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
                    col = pa.array([json.dumps(v, default=str) for v in rows])
            table = table.set_column(i, name, col)
    return table


def _write_file(data, path: Path, raw: bytes) -> bytes:
    op = data.draw(st.sampled_from(["none", "none", "none", "truncate", "garbage"]), label="file_op")
    if op == "truncate":
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)), label="cut")]
    elif op == "garbage":
        raw = b"PAR1" + bytes(data.draw(st.binary(max_size=64), label="garbage")) + b"PAR1"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(raw)
    return raw


def _parquet_written(raw: bytes) -> pa.Table | None:
    """The table the test wrote, read back by pyarrow; None where the bytes are no Parquet file."""
    try:
        return pq.read_table(io.BytesIO(raw))
    except (OSError, ValueError, pa.ArrowException):
        return None


def _traj_ids(table: pa.Table) -> set:
    return set(table["traj_id"].to_pylist()) if "traj_id" in table.column_names else {None}


@pytest.fixture(scope="module")
def canonical():
    res = ingest("chat-jsonl", [("r.jsonl", "\n".join(_jsonl_seed(_chat_records())))], tokenizer=BYTES)
    assert res.quarantine.num_rows == 0
    return res.trajectories.drop(["round"]), res.steps.drop(["round"])


@FUZZ
@given(data=st.data())
def test_fuzz_parquet(data, tmp_path_factory, canonical):
    folder = _workdir(tmp_path_factory)
    written = [
        _parquet_written(
            _write_file(data, folder / name / "part-0.parquet", _parquet_bytes(_mutate_table(data, t)))
        )
        for name, t in zip(("trajectories", "steps"), canonical, strict=True)
    ]
    res = ingest("parquet", read_table_sources([folder]), tokenizer=BYTES)
    traj, steps = written
    if traj is None or steps is None:  # the source cannot be read: one quarantined record
        _check(res, 1)
        return
    # a trajectory row each, and a group of steps whose traj_id has no trajectory row
    expected = traj.num_rows + len(_traj_ids(steps) - _traj_ids(traj) - {None})
    if not _whole_source_rejected(
        res, traj.schema != canonical[0].schema or steps.schema != canonical[1].schema
    ):
        _check(res, expected)


def _whole_source_rejected(res, retyped: bool) -> bool:
    """A table adapter that cannot take a source's columns (a column of another type: the test retyped one)
    quarantines the whole source as one record naming it (`adapter_error`); checked, and then the count is
    that one record. Tables whose columns keep their types must be counted row by row."""
    q = res.quarantine
    if not (retyped and res.trajectories.num_rows == 0 and q.num_rows == 1):
        return False
    assert q.column("reason")[0].as_py().startswith("adapter_error"), q.column("reason").to_pylist()
    _check(res, 1)
    return True


@pytest.fixture(scope="module")
def trl_files(tmp_path_factory):
    return _sample_files("write_trl", tmp_path_factory, (".parquet",))


@FUZZ
@given(data=st.data())
def test_fuzz_trl(data, tmp_path_factory, trl_files):
    folder = _workdir(tmp_path_factory)
    expected = 0
    for rel, raw in trl_files:
        table = pq.read_table(io.BytesIO(raw)).slice(0, 3)
        written = _parquet_written(
            _write_file(data, folder / rel, _parquet_bytes(_mutate_table(data, table)))
        )
        expected += 1 if written is None else written.num_rows  # a row each; a file that is no table: one
    _check(ingest("trl", read_raw_sources([folder], (".parquet",)), tokenizer=BYTES), expected)


NASTY_IDS = [-6, -1, 2**31 + 5, 2**40, 2**63 - 1]
NASTY_FLOATS = [math.nan, math.inf, -math.inf, 5.0, 1e300, -1e300]


def _mutate_arrays(data, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    a = {k: v.copy() for k, v in arrays.items()}
    for _ in range(data.draw(st.integers(0, 3), label="n_array_ops")):
        key = data.draw(st.sampled_from(sorted(a)), label="key")
        op = data.draw(st.sampled_from(["delete", "dtype", "value", "value", "shape"]), label="array_op")
        v = a[key]
        if op == "delete":
            del a[key]
        elif op == "dtype":
            to = data.draw(st.sampled_from([np.float64, np.uint64, np.int8, np.bool_, str]), label="to")
            try:
                a[key] = v.astype(to)
            except (ValueError, TypeError, OverflowError):
                pass
        elif op == "shape":
            a[key] = v.reshape(-1) if v.ndim > 1 else v[: max(0, len(v) - 1)]
        elif v.size:
            idx = tuple(data.draw(st.integers(0, n - 1), label="i") for n in v.shape)
            if v.dtype.kind in "iu":
                v = v.astype(np.int64)
                v[idx] = data.draw(st.sampled_from(NASTY_IDS), label="id")
            elif v.dtype.kind == "f":
                v = v.astype(np.float64)
                v[idx] = data.draw(st.sampled_from(NASTY_FLOATS), label="float")
            else:
                v = v.astype(object)
                v[idx] = data.draw(st.sampled_from(["", "\ud800", 3]), label="obj")
                v = v.astype(str) if data.draw(st.booleans(), label="as_str") else v
            a[key] = v
    return a


def _npz_bytes(arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # object arrays are pickled: the reader refuses them (allow_pickle=False)
    return buf.getvalue()


def _verl_table(arrays) -> pa.Table | None:
    """The arrays as a Parquet-able table (one row per sample), or None where they cannot be one."""
    cols = {}
    for k, v in arrays.items():
        try:
            cols[k] = pa.array(v.tolist()) if v.ndim <= 2 else pa.array([str(x) for x in v.tolist()])
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError):
            cols[k] = pa.array([json.dumps(x, default=str) for x in v.tolist()])
    try:
        return pa.table(cols)
    except (pa.ArrowInvalid, ValueError):  # columns of different lengths: no table
        return None


@pytest.fixture(scope="module")
def verl_seed():
    fn = getattr(_interop_samples(), "verl_arrays", None)
    if fn is None:
        pytest.skip("interop_samples.verl_arrays is gone")
    return fn(n_groups=2, samples=2)


@FUZZ
@given(data=st.data())
def test_fuzz_verl_batch(data, tmp_path_factory, verl_seed):
    folder = _workdir(tmp_path_factory)
    arrays = _mutate_arrays(data, verl_seed)
    npz = _npz_bytes(arrays)
    intact = [_write_file(data, folder / "batch.npz", npz) == npz]
    table = _verl_table(arrays)
    if table is not None and data.draw(st.booleans(), label="also parquet"):
        raw = _parquet_bytes(table)
        intact.append(_write_file(data, folder / "batch.parquet", raw) == raw)
    res = ingest("verl-batch", read_raw_sources([folder], (".npz", ".parquet")), tokenizer=BYTES)
    # a row per sample of each intact, unmutated batch; a damaged or mutated file holds at least one record
    rows = len(verl_seed["responses"])
    unchanged = arrays.keys() == verl_seed.keys() and all(
        np.array_equal(arrays[k], verl_seed[k]) for k in arrays
    )
    exact = unchanged and all(intact)
    _check(res, rows * len(intact) if exact else len(intact), exact)


@pytest.mark.parametrize(
    "fmt,text,records",
    [
        ("tau-bench", "[", 1),  # a file truncated inside its array: the missing rest is one record
        ("tau-bench", "[{}, ", 2),
        ("tau-bench", "[]x", 1),  # text after the array is one record, not silence
        ("tau-bench", "[{}] [{}]", 2),
        ("react", "{}x", 1),
        ("react", '{"a": {}} {"b": {}}', 2),
        ("tau2-bench", '{"simulations": []} x', 1),
    ],
)
def test_damaged_json_documents_are_counted(fmt, text, records):
    _check(ingest(fmt, [("f.json", text)], tokenizer=BYTES), records)
