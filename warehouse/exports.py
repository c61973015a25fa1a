"""Writing one method's advantages of a round as a training batch file (flat Parquet, or a framework's padded
layout as .npz), atomically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from warehouse.lake import Lake, write_options


class ExportError(ValueError):
    """A user's export request that cannot be met (no advantages for the method, unknown layout)."""


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

    from pipeline.export import build_train_batch
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
    version = lake.version()
    as_of = {"as_of": version} if version else {}
    adv = lake.read("advantages", round_, **as_of)
    adv = adv.filter(pc.equal(adv.column("method"), method))
    if adv.num_rows == 0:
        raise ExportError(
            f"no advantages for method {method!r} in round {round_}; run `creditflow process` first"
        )
    trajectories, steps = lake.read("trajectories", round_, **as_of), lake.read("steps", round_, **as_of)
    batch = build_train_batch(trajectories, steps, adv)
    out.parent.mkdir(parents=True, exist_ok=True)
    if layout == "flat":
        tmp = out.with_name(f".tmp-{out.name}")
        if version:
            batch = batch.replace_schema_metadata(
                {**(batch.schema.metadata or {}), b"creditflow.lake_version": version.encode()}
            )
        pq.write_table(batch, tmp, **write_options(batch.schema))
    else:
        tmp = out.with_name(f".tmp-{out.stem}.npz")
        try:
            arrays = to_padded(batch, layout, pad_token_id, response_length, prompt_length, max_len)
        except ValueError as exc:  # a prompt longer than --prompt-length
            raise ExportError(str(exc)) from None
        if layout == "verl":  # what ingest -f verl-batch needs to get the trajectories back as they were
            from pipeline import step_records

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
