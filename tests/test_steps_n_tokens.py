"""`steps.n_tokens`: the lake computes it on every write (credit reads it instead of the token ids), and a read
of a part written before the column derives it: hive and Delta, the batch read, the dataset read, the whole
table, DuckDB's views, and credit of an older lake equal to credit of a new one."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_credit_scope import assert_close, synth_round, token_advantages

from pipeline.config import Config
from schemas import TABLES
from warehouse.catalog import connect
from warehouse.lake import FORMAT_ENV, Lake
from warehouse.rounds import read_batch, write_round

STEPS = TABLES["steps"]


def lengths(steps: pa.Table) -> list[int]:
    return pc.list_value_length(steps.column("token_ids")).to_pylist()


def by_step(steps: pa.Table, values: list) -> dict[tuple[str, int], object]:
    keys = zip(steps["traj_id"].to_pylist(), steps["step_idx"].to_pylist(), strict=True)
    return dict(zip(keys, values, strict=True))


def test_the_lake_computes_n_tokens_and_replaces_an_inputs_own():
    _, steps = synth_round(groups=2)
    wrong = steps.set_column(
        steps.schema.get_field_index("n_tokens"), "n_tokens", pa.array([7] * steps.num_rows, pa.int32())
    )
    out = STEPS.validate(wrong)
    assert out.column("n_tokens").to_pylist() == lengths(steps) != [7] * steps.num_rows
    assert STEPS.validate(steps.drop(["n_tokens"])).column("n_tokens").to_pylist() == lengths(steps)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.lists(st.integers(0, 50), max_size=6), st.one_of(st.none(), st.integers(0, 9))),
        max_size=12,
    )
)
def test_complete_derives_only_where_null(rows):
    """A read's nulls (older parts) become the token ids' lengths; values a part holds stay as they are."""
    table = pa.table(
        {
            "token_ids": pa.array([ids for ids, _ in rows], pa.list_(pa.int32())),
            "n_tokens": pa.array([n for _, n in rows], pa.int32()),
        }
    )
    got = STEPS.complete(table, ["n_tokens"])
    assert got.column_names == ["n_tokens"]
    assert got.column("n_tokens").to_pylist() == [len(ids) if n is None else n for ids, n in rows]
    absent = STEPS.complete(table.select(["token_ids"]), ["n_tokens"])
    assert absent.column("n_tokens").to_pylist() == [len(ids) for ids, _ in rows]


def _write_old(monkeypatch, lake: Lake, traj: pa.Table, steps: pa.Table) -> None:
    """The round as an older creditflow wrote it: steps parts without the derived columns."""
    prepare = Lake._prepare

    def old(self, table_name, table):
        out = prepare(self, table_name, table)
        return out.drop(list(STEPS.derived)) if table_name == "steps" else out

    with monkeypatch.context() as m:
        m.setattr(Lake, "_prepare", old)
        write_round(lake, 0, traj, steps, batch_groups=2)


def value_moments(steps: pa.Table) -> list[tuple[float, float]]:
    """Per step, (mean, sum of squared deviations) of its values, one step at a time (None: no values)."""
    out: list[tuple[float | None, float | None]] = []
    for v in steps["values"].to_pylist():
        x = np.asarray(v if v else [], dtype=np.float64)
        ok = len(x) and np.isfinite(x).all()
        out.append((float(x.mean()), float(((x - x.mean()) ** 2).sum())) if ok else (None, None))
    return out


def same_moments(got: tuple, want: tuple, tol: float) -> bool:
    return got == want if want[0] is None else got == pytest.approx(want, rel=tol, abs=tol)


def _check_reads(lake: Lake, steps: pa.Table) -> None:
    """Every read path gives each step's token count and value moments."""
    want = by_step(steps, lengths(steps))
    moments = by_step(steps, value_moments(steps))

    def same(t: pa.Table) -> None:
        assert t.column("n_tokens").null_count == 0
        got = by_step(t, t["n_tokens"].to_pylist())
        assert got == {k: want[k] for k in got}
        got_m = by_step(t, list(zip(t["values_mean"].to_pylist(), t["values_m2"].to_pylist(), strict=True)))
        for k, m in got_m.items():
            assert same_moments(m, moments[k], 1e-9), (k, m, moments[k])

    assert {"n_tokens", "values_mean", "values_m2"} <= set(lake.columns("steps", 0))
    cols = ["traj_id", "step_idx", "n_tokens", "values_mean", "values_m2"]
    batches = sorted({p.name.removeprefix("part-").removesuffix(".parquet") for p in lake.parts("steps", 0)})
    seen = 0
    for b in batches:  # the flow's batch read (Delta: the data files one by one)
        t = read_batch(lake, "steps", 0, b, columns=cols)
        assert t.column_names == cols
        same(t)
        seen += t.num_rows
    assert seen == steps.num_rows
    whole = lake.read("steps", 0, columns=cols)  # Delta: the dataset
    assert whole.column_names == cols and whole.num_rows == steps.num_rows
    same(whole)
    same(lake.read("steps", 0))  # every column
    with connect(lake) as con:
        bad, n = con.execute(
            "SELECT count(*) FILTER (WHERE n_tokens IS DISTINCT FROM len(token_ids)), count(*) FROM steps"
        ).fetchone()
        assert (bad, n) == (0, steps.num_rows)
        rows = con.execute("SELECT traj_id, step_idx, values_mean, values_m2 FROM steps").fetchall()
        assert len(rows) == steps.num_rows
        for t, s, mean, m2 in rows:
            assert same_moments((mean, m2), moments[(t, s)], 1e-6), (t, s, mean, m2)
        assert con.execute("SELECT typeof(n_tokens) FROM steps LIMIT 1").fetchone() == ("INTEGER",)


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_reads_derive_n_tokens_of_older_parts(tmp_path, monkeypatch, fmt):
    monkeypatch.setenv(FORMAT_ENV, fmt)
    traj, steps = synth_round(groups=6)
    lake = Lake(tmp_path / "lake")
    _write_old(monkeypatch, lake, traj, steps)
    assert all(not set(STEPS.derived) & set(t) for t in _stored_columns(lake))
    _check_reads(lake, steps)  # no part holds it
    first = sorted(p.name for p in lake.parts("steps", 0))[0].removeprefix("part-").removesuffix(".parquet")
    lake.write_part("steps", 0, read_batch(lake, "steps", 0, first), part=first)  # written again, now with it
    stored = _stored_columns(lake)
    assert any("n_tokens" in t for t in stored) and not all("n_tokens" in t for t in stored)
    _check_reads(lake, steps)  # some parts hold it, the others not (Delta: nulls)
    if fmt == "parquet":  # the view derives (and reads token_ids) while a part lacks the column
        assert "token_ids" in _sql_reads(lake, "SELECT sum(n_tokens) FROM steps")
    for b in sorted(p.name.removeprefix("part-").removesuffix(".parquet") for p in lake.parts("steps", 0)):
        lake.write_part("steps", 0, read_batch(lake, "steps", 0, b), part=b)  # every part written again
    _check_reads(lake, steps)  # every part holds it
    if fmt == "parquet":  # the parts' own columns: no derivation, so no token_ids read for a token count
        assert all(set(STEPS.derived) <= set(t) for t in _stored_columns(lake))
        assert "token_ids" not in _sql_reads(lake, "SELECT sum(n_tokens) FROM steps")
        assert "values" not in _sql_reads(lake, "SELECT sum(values_m2) FROM steps")
        assert "token_ids" in _sql_reads(lake, "SELECT sum(len(token_ids)) FROM steps")  # the check can fail


def _sql_reads(lake: Lake, sql: str) -> set[str]:
    """The columns the hive view's Parquet scans read for `sql` (DuckDB's plan as JSON: each scan's projections)."""
    with connect(lake) as con:
        plan = json.loads(con.execute(f"EXPLAIN (FORMAT json) {sql}").fetchall()[0][1])
    out: set[str] = set()
    nodes = list(plan)
    while nodes:
        node = nodes.pop()
        nodes += node.get("children", [])
        if node.get("name") == "READ_PARQUET":
            cols = node.get("extra_info", {}).get("Projections", [])
            out |= {cols} if isinstance(cols, str) else set(cols)
    return out


def _stored_columns(lake: Lake) -> list[list[str]]:
    """The columns of the steps table's data files as written."""
    files = [p for p in (lake.root / "steps").rglob("*.parquet") if not p.name.startswith(".")]
    assert files
    return [pq.read_schema(f).names for f in files]


@pytest.mark.parametrize("fmt", ["parquet", "delta"])
def test_credit_of_an_older_lake(tmp_path, monkeypatch, fmt):
    """Credit (gae: a statistics pass and credit, both reading the steps' tokens) of a lake whose steps parts lack
    `n_tokens` equals that of a lake written now."""
    from flows.batch import round_batches, run_stage
    from pipeline.stages import get_stage

    monkeypatch.setenv(FORMAT_ENV, fmt)
    traj, steps = synth_round(groups=6)
    old, new = Lake(tmp_path / "old"), Lake(tmp_path / "new")
    _write_old(monkeypatch, old, traj, steps)
    write_round(new, 0, traj, steps, batch_groups=2)
    for target in (old, new):
        cfg = Config(lake=str(target.root), methods=["gae", "grpo"])
        for b in round_batches(target, 0):
            run_stage(target, 0, b, get_stage("credit"), cfg)
    got, want = token_advantages(old), token_advantages(new)
    assert_close(got, want)
    n = by_step(steps, lengths(steps))
    assert got["gae"] and all(len(a) == n[k] for k, a in got["gae"].items())  # a value per token of each step
    assert any(np.any(a != 0) for a in got["gae"].values())


def test_a_part_whose_footer_cannot_be_read_keeps_the_derivation(tmp_path):
    """A hostile or cut-short part file: the view derives as before (the query then reads it and fails or not as
    it would have); building the view does not fail on it."""
    from warehouse.catalog import _hold_all

    derived = {name: STEPS.schema.field(name).type for name in STEPS.derived}
    good = tmp_path / "part-a.parquet"
    pq.write_table(pa.table({name: pa.array([1.0], typ) for name, typ in derived.items()}), good)
    lacking = tmp_path / "part-l.parquet"  # written before values_mean and values_m2
    pq.write_table(pa.table({"n_tokens": pa.array([1], derived["n_tokens"])}), lacking)
    bad = tmp_path / "part-b.parquet"
    bad.write_bytes(b"PAR1 not a footer PAR1")
    other = (
        tmp_path / "part-c.parquet"
    )  # the columns, n_tokens of another type: a file the lake did not write
    pq.write_table(
        pa.table({**{n: pa.array([1.0], t) for n, t in derived.items()}, "n_tokens": pa.array(["1"])}), other
    )
    assert _hold_all(STEPS, [good]) is True
    assert _hold_all(STEPS, [good, lacking]) is False
    assert _hold_all(STEPS, [good, bad]) is False
    assert _hold_all(STEPS, [good, other]) is False
    assert _hold_all(STEPS, [good, tmp_path / "part-gone.parquet"]) is False  # removed meanwhile
