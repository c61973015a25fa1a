"""Writing one method's training batch of a round as a file (flat Parquet, or a framework's padded layout as
.npz), atomically. The batch is the lake's `train_batch` table, read as of one lake version: the export stage
(pipeline/export.py) is its one producer; `creditflow export` and the trainer loop only read it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from warehouse.lake import Lake, write_options
from warehouse.runlog import flush_stage_runs

TABLE = "train_batch"


def _as_of(version: str) -> dict[str, Any]:
    """`Lake.read` keywords that read as of `version` (none for a hive-Parquet lake: it keeps no versions)."""
    return {"as_of": version} if version else {}


class ExportError(ValueError):
    """A user's export request that cannot be met (no batch for the method, unknown layout)."""


def method_parts(lake: Lake, round_: int, method: str) -> list:
    """The round's `train_batch` parts of one method: the export stage writes one per batch and method
    (`pipeline.stages.method_part`), so a reader opens only that method's, of the round's batches."""
    from pipeline.stages import method_part

    mine = {method_part(lake.part_name(p), method) for p in lake.parts("trajectories", round_)}
    return [p for p in lake.parts(TABLE, round_) if lake.part_name(p) in mine]


def _stale_batches(lake: Lake, round_: int, as_of: dict[str, Any]) -> list[str]:
    """Batches whose credit ran after their export (or without one): their `train_batch` parts, if any, hold
    older advantages (a run with flow.export off, or one stopped between the two stages). From the run log,
    which keeps one row per stage and batch, the run that made the parts on disk."""
    from pipeline.credit.process import CREDIT
    from pipeline.export import EXPORT

    if not as_of:  # rows a run left spooled (warehouse/runlog.py); as of a version: the log then
        flush_stage_runs(lake, round_, reading=True)
    runs = lake.read("stage_runs", round_, columns=["stage", "batch", "finished_at"], **as_of).to_pylist()
    done = {(r["stage"], r["batch"]): r["finished_at"] for r in runs}
    exported = {b: at for (stage, b), at in done.items() if stage == EXPORT}
    return sorted(
        b for (stage, b), at in done.items() if stage == CREDIT and (b not in exported or at > exported[b])
    )


def _in_trajectory_order(batch: pa.Table) -> pa.Table:
    """Rows by traj_id (the order of a round's layout; the parts hold each batch's rows in order)."""
    tid = batch.column("traj_id").combine_chunks()
    if len(tid) > 1 and pc.any(pc.greater(tid.slice(0, len(tid) - 1), tid.slice(1))).as_py():
        batch = batch.sort_by("traj_id")
    return batch


def _zero_values_where_missing(batch: pa.Table) -> pa.Table:
    """A round whose batches differ in having critic values: each batch is laid out alone, so a batch without
    them has null `values` beside returns; the round's layout holds 0s there (as for a step without values)."""
    values, returns = batch.column("values"), batch.column("returns")
    missing = pc.and_(pc.is_null(values), pc.is_valid(returns))
    if values.null_count in (0, batch.num_rows) or not pc.any(missing).as_py():
        return batch
    ids = batch.column("input_ids").combine_chunks()
    zeros = pa.ListArray.from_arrays(ids.offsets, pa.array(np.zeros(len(ids.values), np.float32)))
    filled = pc.if_else(missing, zeros, values)
    return batch.set_column(batch.schema.get_field_index("values"), batch.schema.field("values"), filled)


def read_train_batch(lake: Lake, round_: int, method: str, version: str = "") -> pa.Table:
    """One method's `train_batch` rows of a round, as of `version` (a Delta lake's `lake.version()`; empty:
    the files on disk), in traj_id order, each column nullable as the layout builds it. ExportError when the
    round has no current batch of the method."""
    from schemas.train_batch import SCHEMA

    as_of = _as_of(version)
    batch = lake.read(TABLE, round_, parts=method_parts(lake, round_, method), **as_of)
    batch = batch.filter(pc.equal(batch.column("method"), method))
    if batch.num_rows == 0:
        adv = lake.read("advantages", round_, columns=["method"], **as_of).column("method")
        if not pc.any(pc.equal(adv, method)).as_py():
            raise ExportError(
                f"no advantages for method {method!r} in round {round_}; run `creditflow process` first"
            )
        raise ExportError(
            f"no train_batch for method {method!r} in round {round_}: run `creditflow process` with "
            "flow.export on (the default)"
        )
    stale = _stale_batches(lake, round_, as_of)
    if stale:
        raise ExportError(
            f"train_batch of round {round_} is older than its advantages in batch(es) {', '.join(stale[:5])}"
            f"{' ...' if len(stale) > 5 else ''}: run `creditflow process` with flow.export on (the default)"
        )
    batch = _in_trajectory_order(batch.combine_chunks())
    return _zero_values_where_missing(batch.cast(pa.schema([f.with_nullable(True) for f in SCHEMA])))


def write_export(
    lake_dir: Path | str,
    round_: int,
    method: str,
    out: Path,
    layout: str = "flat",
    response_length: int | None = None,
    prompt_length: int | None = None,
    pad_token_id: int = 0,
    with_version: bool = False,
    max_len: int | None = None,
) -> int | tuple[int, str]:
    """Write the batch to `out` (temp file, then rename); returns the number of trajectories (and, with
    `with_version`, the lake version read: all tables are read as of one version taken first, and a flat
    file records it in its metadata as `creditflow.lake_version`; empty for a hive-Parquet lake).
    `response_length` (verl, skyrl) / `prompt_length` (verl) / `max_len` (openrlhf): the run's lengths, cut
    as the framework cuts (`pipeline.layouts.to_padded`); `pad_token_id`: what pads."""
    import pyarrow.parquet as pq

    from pipeline.layouts import LAYOUTS, check_lengths, to_padded

    if layout not in LAYOUTS:
        raise ExportError(f"unknown layout {layout!r}; one of {', '.join(LAYOUTS)}")
    try:
        check_lengths(layout, response_length=response_length, prompt_length=prompt_length, max_len=max_len)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    suffix = Path(out).suffix.lower()
    if layout == "flat" and suffix == ".npz":
        raise ExportError(f"{out}: the flat layout is a Parquet file; name it .parquet (or choose --layout)")
    if layout != "flat" and suffix != ".npz":
        raise ExportError(f"{out}: --layout {layout} writes NumPy arrays (.npz); name the output FILE.npz")
    lake = Lake(lake_dir)
    flush_stage_runs(lake, round_, reading=True)  # before the version: the run log's spooled rows are in it
    version = lake.version()
    batch = read_train_batch(lake, round_, method, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout == "flat":
        tmp = out.with_name(f".tmp-{out.name}")
        if version:
            batch = batch.replace_schema_metadata({b"creditflow.lake_version": version.encode()})
        pq.write_table(batch, tmp, **write_options(batch.schema))
    else:
        tmp = out.with_name(f".tmp-{out.stem}.npz")
        try:
            arrays = to_padded(batch, layout, pad_token_id, response_length, prompt_length, max_len)
        except ValueError as exc:  # a prompt longer than --prompt-length
            raise ExportError(str(exc)) from None
        if layout == "verl":  # what ingest -f verl-batch needs to get the trajectories back as they were
            from pipeline import step_records

            as_of = _as_of(version)
            trajectories, steps = (
                lake.read("trajectories", round_, **as_of),
                lake.read("steps", round_, **as_of),
            )
            arrays[step_records.NAME] = step_records.encode(trajectories, steps, arrays["traj_id"])
        save_padded(arrays, tmp)
    tmp.replace(out)
    return (batch.num_rows, version) if with_version else batch.num_rows


def save_padded(arrays: dict[str, np.ndarray], path) -> None:
    """Write the arrays as an uncompressed `.npz` (what `np.savez` writes: a zip of `.npy` members, no pickle),
    streaming each array's buffer straight into the zip (np.savez copies it in chunks first)."""
    import zipfile

    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, value in arrays.items():
            arr = np.ascontiguousarray(value)
            with zf.open(f"{name}.npy", "w", force_zip64=True) as fh:
                np.lib.format.write_array_header_1_0(fh, np.lib.format.header_data_from_array_1_0(arr))
                if arr.size:
                    fh.write(arr.reshape(-1).view(np.uint8).data)
