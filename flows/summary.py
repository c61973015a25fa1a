"""The round summary: what went in, what each stage made and how long it took, what degraded, where the
outputs are. Built from the lake alone (`stage_runs` + Parquet footers), so `creditflow stats` prints the
same table after the fact as `creditflow process` does at the end of a run."""

from __future__ import annotations

from collections.abc import Collection

from pipeline.credit.process import CREDIT
from pipeline.stages import BatchStage, load_stages
from warehouse.lake import Lake
from warehouse.runlog import count_rows, read_stage_runs, stage_seconds, total_notes


def declared_stages() -> list[BatchStage]:
    """Every batch stage, in run order (the declarations: pipeline.stages)."""
    return sorted(load_stages().values(), key=lambda s: s.order)


def output_tables() -> tuple[str, ...]:
    """The tables the stages write, in run order: the summary counts their rows."""
    return tuple(t for s in declared_stages() for t in s.tables())


def round_summary(lake: Lake, round_: int, ran: Collection[str] | None = None) -> dict:
    """The round from the lake. `ran`: the stages the run's config runs (`round_stages`): the run log's rows of
    another declared stage (an earlier run's, under other settings: the statistics pass before whitening was
    turned off) are left out of the stage table, tokens and notes, and named under `earlier`; the run's own
    rows (not a stage) stay. None (`creditflow stats`): every row the lake holds."""
    declared = declared_stages()
    runs = read_stage_runs(lake, round_)
    earlier: list[str] = []
    if ran is not None and runs.num_rows:
        import pyarrow as pa
        import pyarrow.compute as pc

        other = sorted({s.name for s in declared} - set(ran))
        held = set(runs.column("stage").to_pylist())
        earlier = [s for s in other if s in held]
        if earlier:
            runs = runs.filter(pc.invert(pc.is_in(runs.column("stage"), pa.array(earlier, pa.string()))))
    stages: dict[str, dict] = {}
    if runs.num_rows:
        seconds = stage_seconds(runs)
        for stage, batch_warnings in zip(
            runs.column("stage").to_pylist(), runs.column("warnings").to_pylist(), strict=True
        ):
            entry = stages.setdefault(
                stage, {"batches": 0, "seconds": round(seconds.get(stage, 0.0), 3), "warnings": 0}
            )
            entry["batches"] += 1
            entry["warnings"] += len(batch_warnings or [])
    order = {s.name: s.order for s in declared}
    stages = dict(sorted(stages.items(), key=lambda kv: (order.get(kv[0], 0), kv[0])))
    tokens = 0
    if runs.num_rows:
        import pyarrow.compute as pc

        credit = runs.filter(pc.equal(runs.column("stage"), CREDIT))
        tokens = int(pc.sum(credit.column("tokens")).as_py() or 0)
    # the notes of the annotation stages (LLM calls, fallbacks) and the run's own rows (preconditions): not of
    # the stages every round runs (credit, its statistics, export: their notes are per method)
    every_round = {s.name for s in declared if s.runs_if is not None}
    notes = total_notes(runs, [s for s in stages if s not in every_round])
    return {
        "round": int(round_),
        "lake": lake.uri,
        "batches": len(lake.parts("trajectories", round_)),
        "trajectories": count_rows(lake, "trajectories", round_),
        "steps": count_rows(lake, "steps", round_),
        "tokens": tokens,
        "rows": {t: count_rows(lake, t, round_) for t in output_tables()},
        "quarantined": count_rows(lake, "quarantine", round_),
        "stages": stages,
        "earlier": earlier,
        "notes": {k: round(v, 3) for k, v in sorted(notes.items())},
        "outputs": {
            t: str(lake.partition_dir(t, round_))
            for t in ("advantages", "train_batch")
            if lake.parts(t, round_)
        },
    }


def print_summary(summary: dict, title: str | None = None, console=None) -> None:
    """The summary as two rich tables: the round at a glance, then one row per stage."""
    from rich.table import Table

    from flows.display import console as default_console

    console = console or default_console
    fell_back = fallback_lines(summary)
    if fell_back:  # first, above the tables: the credit below is partly made of these fallbacks
        console.print("[bold yellow]degraded: what fell back[/bold yellow]")
        for line in fell_back:
            console.print(f"[yellow]  - {line}[/yellow]", soft_wrap=True)
    rows = summary.get("rows", {})
    notes = summary.get("notes", {})
    overview = {
        "trajectories": summary.get("trajectories"),
        "steps": summary.get("steps"),
        "tokens": summary.get("tokens"),
        "batches": summary.get("batches"),
        "spans": rows.get("spans"),
        "nodes / edges": f"{rows.get('nodes', 0)} / {rows.get('edges', 0)}",
        "counterfactuals": rows.get("counterfactuals"),
        "advantages rows": rows.get("advantages"),
        "train_batch rows": rows.get("train_batch"),
        "quarantined records": summary.get("quarantined"),
    }
    llm = {
        k: v for k, v in notes.items() if any(w in k for w in ("call", "cache", "fallback", "error", "retr"))
    }
    overview.update({k: (int(v) if float(v).is_integer() else v) for k, v in llm.items()})
    if "wall_seconds" in summary:
        overview["wall seconds"] = summary["wall_seconds"]
        if "fixed_cost_seconds" in summary:  # the flow's own cost besides the stages' work
            overview["fixed cost seconds"] = summary["fixed_cost_seconds"]
        overview["task runner"] = summary.get("task_runner")
    head = Table(title=title or f"round {summary.get('round')}", show_header=False)
    head.add_column("what", style="bold")
    head.add_column("value", overflow="fold")
    for k, v in overview.items():
        head.add_row(str(k), "" if v is None else str(v))
    console.print(head)
    # output paths whole, on lines of their own (a table cell folds them, and they are there to be copied)
    for t, p in summary.get("outputs", {}).items():
        console.print(f"[bold]out: {t}[/bold] {p}", soft_wrap=True, highlight=False)

    this_run = summary.get("this_run", {})
    table = Table(title="stages (seconds: summed over batches; done at: this run's clock)")
    for col in ("stage", "batches", "seconds", "warnings"):
        table.add_column(col, justify="left" if col == "stage" else "right", no_wrap=True)
    if this_run:
        table.add_column("cached", justify="right", no_wrap=True)
        table.add_column("done at s", justify="right", no_wrap=True)
    for stage, entry in summary.get("stages", {}).items():
        cells = [stage, str(entry["batches"]), f"{entry['seconds']:.2f}", str(entry["warnings"])]
        if this_run:
            r = this_run.get(stage, {})
            cells += [str(r.get("cached", "")), str(r.get("finished_after_s", ""))]
        table.add_row(*cells)
    console.print(table)
    if summary.get("earlier"):
        console.print(
            f"[dim]in the lake from an earlier run, not run under this config: {', '.join(summary['earlier'])} "
            "(`creditflow stats` lists every stage)[/dim]",
            soft_wrap=True,
        )


def fallback_lines(summary: dict, limit: int = 10) -> list[str]:
    """What fell back in this run, one line per LLM stage whose requests failed (count, share and the main
    cause) and then the stages' warnings (deduplicated over batches), at most `limit` lines."""
    lines = []
    for stage, r in (summary.get("this_run") or {}).items():
        failed, total = int(r.get("llm_failed", 0)), int(r.get("llm_requests", 0))
        if failed:
            causes = sorted((r.get("failures") or {}).items(), key=lambda kv: -kv[1])
            cause = f"; cause: {causes[0][0]}" if causes else ""
            lines.append(
                f"{stage}: {failed} of {total} LLM requests failed ({failed / max(total, 1):.0%}){cause}"
            )
    seen = set()
    for warning in summary.get("warnings", []):
        stage, _, rest = warning.partition(": ")
        _, _, text = rest.partition(": ")
        key = f"{stage}: {text or rest}"
        if key not in seen:
            seen.add(key)
            n = sum(1 for w in summary["warnings"] if w.startswith(stage + ": ") and w.endswith(text or rest))
            lines.append(key + (f" ({n} batches)" if n > 1 else ""))
    return lines[:limit]


def credit_by_method_sql(round_: int) -> str:
    """The round's credit by method, narrow enough for an 80-column terminal (view credit_summary)."""
    return (
        "SELECT method, trajectories AS trajs, round(mean_adv, 4) AS mean, "
        "round(mean_within_step_std, 3) AS step_sd, round(min_adv, 3) AS min, round(max_adv, 3) AS max, "
        'round(100.0 * positive_tokens / assistant_tokens, 1) AS "pos %", '
        'round(100.0 * negative_tokens / assistant_tokens, 1) AS "neg %" '
        f"FROM credit_summary WHERE round = {int(round_)} ORDER BY method"
    )


def credit_by_method(lake: Lake, round_: int):
    """`credit_by_method_sql` over the round's own advantages: its parts read in Arrow and the view
    credit_summary (warehouse.views, the same SQL) in a DuckDB connection of that one table, not a catalog
    of every table of the lake."""
    import duckdb

    from warehouse.views import VIEWS

    advantages = lake.read("advantages", round_, parts=lake.parts("advantages", round_))
    con = duckdb.connect(":memory:")
    try:
        con.register("advantages", advantages)
        con.execute(f"CREATE VIEW credit_summary AS {VIEWS['credit_summary'].sql}")
        return con.sql(credit_by_method_sql(round_)).to_arrow_table()
    finally:
        con.close()


def print_round(summary: dict, lake: Lake, title: str) -> None:
    """What `creditflow process` prints at the end: the summary, then the round's credit by method."""
    from flows.display import print_table

    print_summary(summary, title=title)
    print_table(credit_by_method(lake, summary["round"]), title="credit by method")
