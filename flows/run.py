"""Entry points the CLI calls. They run the Prefect flows (ephemeral API unless PREFECT_API_URL is set)."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.compute as pc

from pipeline.config import Config
from pipeline.display import console, print_kv, print_table


def run_process(cfg: Config, round_: int) -> dict:
    from flows.process_round import process_credit_batch, round_batches
    from warehouse.lake import Lake

    lake = Lake(cfg.lake)
    t0 = time.perf_counter()
    batches = round_batches(lake, round_)
    summaries = []
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"credit round {round_}", total=len(batches))
        for b in batches:
            summaries.append(process_credit_batch(lake, round_, b, cfg.methods, cfg))
            progress.advance(task)
    summary = {
        "round": round_,
        "batches": len(batches),
        "trajectories": sum(s.trajectories for s in summaries),
        "tokens": sum(s.tokens for s in summaries),
        "methods": ", ".join(cfg.methods),
        "seconds": round(time.perf_counter() - t0, 2),
        "advantages": str(lake.table_dir("advantages") / f"round={round_}"),
    }
    print_kv(f"creditflow process: round {round_}", summary)
    from warehouse.catalog import query

    stats = query(lake, f"SELECT * FROM credit_summary WHERE round = {int(round_)}")
    print_table(stats, title="credit by method")
    return summary


def run_export(lake_dir: Path, round_: int, method: str, out: Path, layout: str = "flat") -> Path:
    from pipeline.export import build_train_batch
    from warehouse.lake import Lake

    lake = Lake(lake_dir)
    adv = lake.read("advantages", round_)
    adv = adv.filter(pc.equal(adv.column("method"), method))
    if adv.num_rows == 0:
        raise SystemExit(f"no advantages for method {method!r} in round {round_}; run `creditflow process` first")
    steps = lake.read("steps", round_)
    traj = lake.read("trajectories", round_)
    batch = build_train_batch(traj, steps, adv)
    if layout != "flat":
        raise SystemExit(f"unknown layout {layout!r}")
    import pyarrow.parquet as pq

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    pq.write_table(batch, tmp, compression="zstd")
    tmp.replace(out)
    print_kv("creditflow export", {"method": method, "round": round_, "trajectories": batch.num_rows, "out": str(out)})
    return out


def run_report(lake_dir: Path, out: Path, rounds: list[int] | None = None, n_traj: int = 8) -> Path:
    from pipeline.report import build_report
    from warehouse.lake import Lake
    from warehouse.report_data import gather

    data = gather(Lake(lake_dir), rounds, n_traj=n_traj)
    html = build_report(data)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    print_kv("creditflow report", {"rounds": data["rounds"], "trajectories shown": len(data["trajectories"]),
                                   "size": f"{out.stat().st_size / 1e6:.2f} MB", "out": str(out.resolve())})
    return out
