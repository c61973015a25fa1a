"""`creditflow export` (and the trainer loop, through `write_export`) read the lake's `train_batch` table, the
export stage's output, as of one lake version: the file equals the layout of the whole round built from its
advantages (`build_train_batch`, what export computed before), on Delta and hive-Parquet lakes; a round the
stage has not laid out (flow.export off) or laid out from older advantages is one clear error."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.batch import run_batch_plain
from flows.config import load_config
from pipeline.export import build_train_batch
from pipeline.layouts import to_padded
from pipeline.synth import SynthSettings, generate
from warehouse.exports import ExportError, _zero_values_where_missing, method_parts, write_export
from warehouse.lake import Lake
from warehouse.rounds import batch_names, write_round

METHODS = ["grpo", "gae", "grpo+c3"]


def _processed(
    root, monkeypatch, fmt: str = "delta", sets=(), methods=METHODS
) -> tuple[Lake, pa.Table, pa.Table]:
    monkeypatch.setenv("CREDITFLOW_LAKE_FORMAT", fmt)
    lake = Lake(root)
    traj, steps = generate(SynthSettings(groups=6, samples=4, turns=4, tokens=30, seed=1, kind="mixed"))
    write_round(lake, 0, traj, steps, batch_groups=2)
    _process(lake, sets, methods)
    return lake, traj, steps


def _process(lake: Lake, sets=(), methods=METHODS) -> None:
    cfg = load_config(None, ["flow.progress=false", *sets], lake=str(lake.root), methods=list(methods))
    for b in batch_names(lake, 0):
        run_batch_plain(lake, 0, b, cfg)


@pytest.mark.parametrize("fmt", ["delta", "parquet"])
def test_export_is_the_round_layout_of_its_advantages(tmp_path, monkeypatch, fmt):
    lake, _, _ = _processed(tmp_path / "lake", monkeypatch, fmt)
    assert lake.format == fmt and len(batch_names(lake, 0)) == 3
    traj, steps, adv = (lake.read(t, 0) for t in ("trajectories", "steps", "advantages"))
    for method in METHODS:
        out = tmp_path / f"{method}.parquet"
        rows, version = write_export(lake.root, 0, method, out, with_version=True)
        got = pq.read_table(out)
        want = build_train_batch(traj, steps, adv.filter(pc.equal(adv.column("method"), method)))
        assert rows == want.num_rows == 24 and bool(version) == (fmt == "delta")
        assert got.replace_schema_metadata(None).equals(want), method
        assert pc.max(pc.list_flatten(got.column("advantages"))).as_py() > 0  # not a table of zeros
        assert (got.column("returns").null_count == 0) == (method == "gae")
        for layout in ("verl", "openrlhf", "skyrl"):
            npz = tmp_path / f"{method}.{layout}.npz"
            write_export(lake.root, 0, method, npz, layout)
            with np.load(npz) as arrays:
                for name, value in to_padded(want, layout).items():
                    np.testing.assert_array_equal(arrays[name], value, err_msg=f"{method} {layout} {name}")


@pytest.mark.parametrize("fmt", ["delta", "parquet"])
def test_parts_of_one_method_are_the_parts_holding_its_rows(tmp_path, monkeypatch, fmt):
    lake, _, _ = _processed(tmp_path / "lake", monkeypatch, fmt)
    holding: dict[str, set[str]] = {}
    for p in lake.parts("train_batch", 0):
        (method,) = set(
            lake.read("train_batch", 0, columns=["method"], parts=[p]).column("method").to_pylist()
        )
        holding.setdefault(method, set()).add(lake.part_name(p))
    assert sorted(holding) == sorted(METHODS)
    for method in METHODS:
        assert {lake.part_name(p) for p in method_parts(lake, 0, method)} == holding[method]
        assert len(holding[method]) == len(batch_names(lake, 0))


def test_no_batch_of_the_method_is_one_line(tmp_path, monkeypatch):
    lake, _, _ = _processed(tmp_path / "lake", monkeypatch, sets=["flow.export=false"], methods=["grpo"])
    assert not lake.parts("train_batch", 0)
    with pytest.raises(ExportError, match=r"^no train_batch for method 'grpo' in round 0: .*flow\.export on"):
        write_export(lake.root, 0, "grpo", tmp_path / "b.parquet")
    with pytest.raises(
        ExportError, match=r"^no advantages for method 'gae' in round 0; run `creditflow process`"
    ):
        write_export(lake.root, 0, "gae", tmp_path / "b.parquet")
    assert not (tmp_path / "b.parquet").exists()


def test_a_batch_laid_out_from_older_advantages_is_refused(tmp_path, monkeypatch):
    lake, _, _ = _processed(tmp_path / "lake", monkeypatch, methods=["grpo"])
    write_export(lake.root, 0, "grpo", tmp_path / "ok.parquet")
    # credit again with other settings and the export stage off: the train_batch parts are the old ones
    _process(lake, ["flow.export=false", "grpo.norm_by_std=false"], methods=["grpo"])
    with pytest.raises(ExportError, match=r"older than its advantages in batch\(es\) b\d+, b\d+, b\d+:"):
        write_export(lake.root, 0, "grpo", tmp_path / "b.parquet")
    _process(lake, ["grpo.norm_by_std=false"], methods=["grpo"])  # laid out again: current
    write_export(lake.root, 0, "grpo", tmp_path / "b.parquet")
    assert (
        not pq.read_table(tmp_path / "b.parquet")
        .column("advantages")
        .equals(pq.read_table(tmp_path / "ok.parquet").column("advantages"))
    )


def _rows(values, returns, lengths):
    lists = pa.list_(pa.float32())
    return pa.table(
        {
            "input_ids": pa.array([list(range(n)) for n in lengths], pa.list_(pa.int32())),
            "values": pa.array(values, lists),
            "returns": pa.array(returns, lists),
        }
    )


def test_values_of_a_batch_without_them_are_zeros_beside_returns():
    # batch 1 had critic values, batch 2 none: the round's layout fills 0s where returns exist
    t = _rows([[0.5, 0.25], None, None], [[1.0, 1.0], [2.0, 2.0, 2.0], None], [2, 3, 1])
    assert _zero_values_where_missing(t).column("values").to_pylist() == [[0.5, 0.25], [0.0, 0.0, 0.0], None]
    # no values anywhere (stays null: no critic), or everywhere: unchanged
    none = _rows([None, None], [[1.0], [1.0, 2.0]], [1, 2])
    assert _zero_values_where_missing(none).equals(none)
    full = _rows([[0.5], [0.1, 0.2]], [[1.0], [1.0, 2.0]], [1, 2])
    assert _zero_values_where_missing(full).equals(full)
