"""Processing a round: for each batch of whole groups, compute every method and write the advantages
parts. (Prefect wiring lives in flows/; this module is the plain sequence the flow tasks call.)"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.config import Config
from pipeline.credit.process import annotation_names, process_batch
from warehouse.lake import Lake, safe_part_name
from warehouse.rounds import batch_names, read_batch


def method_slug(method: str) -> str:
    return safe_part_name(method.replace("+", "-"))


def advantages_part(batch: str, method: str) -> str:
    return f"{batch}.{method_slug(method)}"


@dataclass
class BatchSummary:
    batch: str
    trajectories: int = 0
    steps: int = 0
    tokens: int = 0
    notes: dict[str, dict[str, float]] = field(default_factory=dict)


def run_annotation_stages(lake: Lake, round_: int, batch: str, needed: set[str], config: Config,
                          traj=None, steps=None, force: bool = False) -> dict[str, float]:
    """Run the stages that produce the needed tables for one batch; a stage whose parts exist is skipped."""
    from pipeline.stages import stages_for

    notes: dict[str, float] = {}
    for stage in stages_for(needed):
        if not force and all(lake.has_part(t, round_, batch) for t in stage.produces):
            continue
        if traj is None:
            traj = read_batch(lake, "trajectories", round_, batch)
            steps = read_batch(lake, "steps", round_, batch)
        inputs = {t: read_batch(lake, t, round_, batch) for t in stage.needs}
        out = stage.fn(traj, steps, config, inputs)
        for table in stage.produces:
            lake.write_part(table, round_, out.tables[table], part=batch)
        notes.update({f"{stage.name}.{k}": v for k, v in out.notes.items()})
    return notes


def process_credit_batch(lake: Lake, round_: int, batch: str, methods: list[str], config: Config) -> BatchSummary:
    traj = read_batch(lake, "trajectories", round_, batch)
    steps = read_batch(lake, "steps", round_, batch)
    needed = annotation_names(methods)
    stage_notes = run_annotation_stages(lake, round_, batch, needed, config, traj, steps) if needed else {}
    annotations = {name: read_batch(lake, name, round_, batch) for name in needed}
    tables, notes = process_batch(traj, steps, methods, config, annotations, round_=round_)
    tokens = 0
    for method, table in tables.items():
        lake.write_part("advantages", round_, table, part=advantages_part(batch, method))
    import pyarrow.compute as pc

    tokens = int(pc.sum(pc.list_value_length(steps.column("token_ids"))).as_py() or 0)
    if stage_notes:
        notes["stages"] = stage_notes
    return BatchSummary(batch, traj.num_rows, steps.num_rows, tokens, notes)


def round_batches(lake: Lake, round_: int) -> list[str]:
    names = batch_names(lake, round_)
    if not names:
        raise FileNotFoundError(f"round {round_} has no trajectories in {lake.root}")
    return names
