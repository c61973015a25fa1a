"""`creditflow annotators run|compare`: IAPO annotators side by side in one lake.

Each annotator's output is written as extra `nodes`/`edges` parts named `<batch>.ann-<id>` (rows keyed by the
`annotator` column), so several annotators coexist next to the part the credit flow reads (`<batch>`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

annotators_app = typer.Typer(
    help="IAPO annotators: run one into the lake, compare two (paper Table 4)", no_args_is_help=True
)


def _spec(spec: str) -> tuple[str, str | None]:
    """`rules` | `llm` | `llm=MODEL` -> (kind, model)."""
    kind, _, model = spec.partition("=")
    return kind.strip(), (model.strip() or None)


def _config(lake: str | Path, config: Path | None, sets: list[str], model: str | None):
    from flows.config import load_config

    extra = [f"annotate_llm.model={model}"] if model else []
    return load_config(config, [*sets, *extra], lake=str(lake))


def annotate_into_lake(
    lake_dir: str | Path,
    round_: int,
    spec: str,
    config: Path | None = None,
    sets: list[str] | None = None,
    annotator_id: str | None = None,
    force: bool = False,
) -> str:
    """Annotate every batch of a round with one annotator; returns the annotator id written."""
    from flows.batch import stage_io
    from pipeline.annotate import run_annotator
    from warehouse.lake import Lake, safe_part_name
    from warehouse.rounds import batch_names, read_batch

    kind, model = _spec(spec)
    cfg = _config(lake_dir, config, sets or [], model)
    lake = Lake(lake_dir)
    ann_id = annotator_id or ("rules" if kind == "rules" else None)
    names = batch_names(lake, round_)
    if not names:
        raise FileNotFoundError(f"round {round_} has no trajectories in {lake.root}")
    for batch in names:
        if ann_id is not None:
            part = f"{batch}.ann-{safe_part_name(ann_id)}"
            if not force and lake.has_part("edges", round_, part) and lake.has_part("nodes", round_, part):
                continue
        steps = read_batch(lake, "steps", round_, batch)
        out = run_annotator(steps, cfg, kind, annotator_id=ann_id, io=stage_io(cfg))
        ids = set(out.tables["nodes"].column("annotator").to_pylist())
        ann_id = ann_id or (ids.pop() if ids else kind)
        part = f"{batch}.ann-{safe_part_name(ann_id)}"
        lake.write_part("nodes", round_, out.tables["nodes"], part=part)
        lake.write_part("edges", round_, out.tables["edges"], part=part)
    return ann_id or kind


def _read_annotator(lake, table: str, round_: int, ann_id: str):
    import pyarrow.compute as pc

    t = lake.read(table, round_)
    return t.filter(pc.equal(t.column("annotator"), ann_id))


def compare_in_lake(
    lake_dir: str | Path,
    round_: int,
    a: str,
    b: str,
    config: Path | None = None,
    sets: list[str] | None = None,
    id_a: str | None = None,
    id_b: str | None = None,
    force: bool = False,
    sets_b: list[str] | None = None,
) -> dict[str, str | float]:
    from pipeline.annotate.compare import compare
    from warehouse.lake import Lake

    ida = annotate_into_lake(lake_dir, round_, a, config, sets, id_a, force)
    idb = annotate_into_lake(lake_dir, round_, b, config, [*(sets or []), *(sets_b or [])], id_b, force)
    if ida == idb:
        raise typer.BadParameter(f"both annotators write id {ida!r}; give --id-a / --id-b")
    lake = Lake(lake_dir)
    res = compare(
        lake.read("trajectories", round_),
        lake.read("steps", round_),
        _read_annotator(lake, "nodes", round_, ida),
        _read_annotator(lake, "edges", round_, ida),
        _read_annotator(lake, "nodes", round_, idb),
        _read_annotator(lake, "edges", round_, idb),
    )
    return {"annotator_a": ida, "annotator_b": idb, **res}


ENDPOINT_HELP = (
    "an OpenAI-compatible base URL for the llm annotator (repeatable; = --set llm.endpoints=[...]); default: "
    "the service of `creditflow llm serve`. Name its model as llm=MODEL unless it serves one; an API key: "
    "--set llm.api_key=KEY"
)


def _endpoint_sets(endpoints: list[str]) -> list[str]:
    return [f"llm.endpoints=[{','.join(endpoints)}]"] if endpoints else []


def register(app: typer.Typer) -> None:
    @annotators_app.command("run")
    def run_cmd(
        annotator: str = typer.Argument(..., help="rules | llm | llm=MODEL"),
        lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
        round_: int = typer.Option(..., "--round", help="round"),
        annotator_id: str | None = typer.Option(None, "--annotator-id", help="id written to nodes/edges"),
        config: Path | None = typer.Option(None, "--config", help="YAML config file"),
        sets: list[str] = typer.Option([], "--set", help="override: stage.key=value (repeatable)"),
        force: bool = typer.Option(False, "--force", help="re-annotate parts that exist"),
        endpoint: list[str] = typer.Option([], "--endpoint", help=ENDPOINT_HELP),
    ) -> None:
        """Annotate a round with one annotator into parts `<batch>.ann-<id>`."""
        sets = [*sets, *_endpoint_sets(endpoint)]
        ann = annotate_into_lake(lake, round_, annotator, config, sets, annotator_id, force)
        typer.echo(f"annotated round {round_} as {ann!r}")

    @annotators_app.command("compare")
    def compare_cmd(
        a: str = typer.Argument(..., help="annotator A: rules | llm | llm=MODEL (the reference)"),
        b: str = typer.Argument(..., help="annotator B"),
        lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
        round_: int = typer.Option(..., "--round", help="round"),
        id_a: str | None = typer.Option(
            None, "--id-a", help="annotator id for A (default: rules / llm:<model>)"
        ),
        id_b: str | None = typer.Option(None, "--id-b", help="annotator id for B"),
        config: Path | None = typer.Option(None, "--config", help="YAML config file"),
        sets: list[str] = typer.Option([], "--set", help="override: stage.key=value (repeatable)"),
        sets_b: list[str] = typer.Option([], "--set-b", help="override for annotator B only (repeatable)"),
        as_json: bool = typer.Option(False, "--json", help="print JSON"),
        force: bool = typer.Option(False, "--force", help="re-annotate parts that exist"),
        endpoint: list[str] = typer.Option([], "--endpoint", help=ENDPOINT_HELP),
    ) -> None:
        """Annotate a round with two annotators and print their agreement (edge F1, source Jaccard, Cohen's
        kappa on errors, Spearman of m+ and m-, sign agreement of routed advantages)."""
        sets = [*sets, *_endpoint_sets(endpoint)]
        res = compare_in_lake(lake, round_, a, b, config, sets, id_a, id_b, force, sets_b)
        if as_json:
            typer.echo(json.dumps(res))
            return
        from flows.display import print_kv

        print_kv(
            f"annotator agreement, round {round_}",
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()},
        )

    app.add_typer(annotators_app, name="annotators")
