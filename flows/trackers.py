"""Experiment trackers: after a round, `--track mlflow|wandb|tensorboard` (config `track:`) sends the round's
credit statistics per method (step = round), the round summary, and the HTML report as an artifact.

Each lake keeps one run per tracker across rounds (ids in LAKE/_tracking.json, in the bucket of an object-store
lake: warehouse/side_files.py), so the trends over rounds are
one chart in the tracker. The tracker libraries are optional extras (`pip install 'creditflow[track]'`),
imported only here and only when asked for."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
import uuid
from decimal import Decimal
from pathlib import Path

from pipeline.config import Config
from warehouse.lake import Lake

log = logging.getLogger(__name__)

RUNS_FILE = "_tracking.json"
STAT_KEYS = ("mean_adv", "min_adv", "max_adv", "mean_within_step_std", "trajectories", "assistant_tokens")
SUMMARY_KEYS = ("trajectories", "steps", "tokens", "quarantined", "wall_seconds")
EXTRAS = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}


class TrackerMissing(ImportError):
    pass


def _require(name: str):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise TrackerMissing(
            f"--track {name}: the {name} package is not installed; pip install 'creditflow[track]' "
            f"(or pip install {EXTRAS[name]})"
        ) from None


def _number(v) -> float | None:
    """A finite number (DuckDB sums arrive as Decimal) or None."""
    if isinstance(v, bool) or not isinstance(v, int | float | Decimal):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def round_metrics(summary: dict, stats: list[dict]) -> dict[str, float]:
    """Flat metric names -> values: `credit/<method>/<stat>` per method, `round/<key>` for the summary, and
    each method's share of positive / negative assistant tokens."""
    out: dict[str, float] = {}
    for key in SUMMARY_KEYS:
        v = _number(summary.get(key))
        if v is not None:
            out[f"round/{key}"] = v
    for row in stats:
        m = row["method"]
        for key in STAT_KEYS:
            v = _number(row.get(key))
            if v is not None:
                out[f"credit/{m}/{key}"] = v
        tokens = _number(row.get("assistant_tokens")) or 0.0
        if tokens:
            out[f"credit/{m}/positive_share"] = (_number(row.get("positive_tokens")) or 0.0) / tokens
            out[f"credit/{m}/negative_share"] = (_number(row.get("negative_tokens")) or 0.0) / tokens
    return out


TRAIN_KEYS = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac")


def train_metrics(lake: Lake, round_: int) -> dict[str, float]:
    """The trainer's last optimizer step of the round per method (`train/<method>/<key>`), when it trained."""
    if not lake.parts("train_metrics", round_):
        return {}
    from warehouse.catalog import query

    rows = query(
        lake,
        f"SELECT coalesce(method, '') AS method, {', '.join(TRAIN_KEYS)} FROM train_metrics "
        f"WHERE round = {int(round_)} QUALIFY row_number() OVER (PARTITION BY method ORDER BY step DESC) = 1",
    ).to_pylist()
    out = {}
    for row in rows:
        for key in TRAIN_KEYS:
            v = _number(row.get(key))
            if v is not None:
                out[f"train/{row['method'] or 'policy'}/{key}"] = v
    return out


def _runs(lake: Lake) -> dict:
    """The lake's run per tracker, kept in the lake's own storage (the bucket of an s3:// lake), so every
    machine that tracks the lake continues the same runs."""
    from warehouse.side_files import read_json

    return read_json(lake, RUNS_FILE)


def _save_run(lake: Lake, tracker: str, run_id: str) -> str:
    from warehouse.side_files import write_json

    return write_json(lake, RUNS_FILE, {**_runs(lake), tracker: run_id})


def _lake_name(lake: Lake) -> str:
    """The lake's name in a tracker (its last path part; an object-store lake's, not its local state dir's)."""
    return lake.uri.rstrip("/").rsplit("/", 1)[-1]


def _json_safe(value):
    return json.loads(json.dumps(value, default=str))


def mlflow_name(metric: str) -> str:
    """MLflow allows only alphanumerics, _ - . space : / in a metric name: a chain's '+' becomes '-' (method
    names use underscores, so 'grpo-c3' is unambiguous), any other character '_'."""
    return re.sub(r"[^/\w.\- :]", "_", metric.replace("+", "-"))


def to_mlflow(cfg: Config, lake: Lake, round_: int, metrics: dict, summary: dict, report: Path | None) -> str:
    mlflow = _require("mlflow")
    from mlflow.tracking import MlflowClient

    uri = cfg.tracking.mlflow_uri or (lake.root / "_mlruns").as_uri()
    if uri.startswith("file:") or "://" not in uri:
        # a local file store (the offline default): MLflow 3 keeps it in maintenance mode behind this switch
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    run_id = _runs(lake).get("mlflow")
    if run_id is not None:
        try:
            client.get_run(run_id)
        except mlflow.exceptions.MlflowException:
            run_id = None
    if run_id is None:
        exp = client.get_experiment_by_name(cfg.tracking.mlflow_experiment)
        exp_id = exp.experiment_id if exp else client.create_experiment(cfg.tracking.mlflow_experiment)
        run = client.create_run(
            exp_id, run_name=f"creditflow {_lake_name(lake)}", tags={"creditflow.lake": lake.uri}
        )
        run_id = run.info.run_id
        client.log_param(run_id, "lake", lake.uri)
        client.log_param(run_id, "task_runner", cfg.task_runner)
        _save_run(lake, "mlflow", run_id)
    now = int(time.time() * 1000)
    from mlflow.entities import Metric

    client.log_batch(
        run_id, metrics=[Metric(mlflow_name(k), v, now, int(round_)) for k, v in metrics.items()]
    )
    client.set_tag(run_id, f"methods.round{round_}", ",".join(cfg.methods))
    client.log_dict(run_id, _json_safe(summary), f"rounds/round-{round_}-summary.json")
    if report is not None:
        client.log_artifact(run_id, str(report), artifact_path="reports")
    return run_id


def to_wandb(cfg: Config, lake: Lake, round_: int, metrics: dict, summary: dict, report: Path | None) -> str:
    wandb = _require("wandb")
    folder = Path(cfg.tracking.wandb_dir or lake.root / "_wandb")
    folder.mkdir(parents=True, exist_ok=True)
    run_id = _runs(lake).get("wandb") or uuid.uuid4().hex[:12]
    run = wandb.init(
        project=cfg.tracking.wandb_project,
        entity=cfg.tracking.wandb_entity,
        mode=cfg.tracking.wandb_mode,
        dir=str(folder),
        id=run_id,
        resume="allow",
        name=f"creditflow {_lake_name(lake)}",
        config={"lake": lake.uri, "task_runner": cfg.task_runner},
        settings=wandb.Settings(silent=True, console="off"),
        reinit="create_new",
    )
    try:
        run.log({**metrics, "round": int(round_)}, step=int(round_))
        run.summary.update(
            {f"round{round_}/{k}": v for k, v in _json_safe(summary).items() if k != "this_run"}
        )
        if report is not None:
            artifact = wandb.Artifact(f"report-{_lake_name(lake)}-round-{round_}", type="report")
            artifact.add_file(str(report))
            run.log_artifact(artifact)
    finally:
        run.finish()
    _save_run(lake, "wandb", run_id)
    return run_id


def to_tensorboard(
    cfg: Config, lake: Lake, round_: int, metrics: dict, summary: dict, report: Path | None
) -> str:
    """Scalars and the summary (text plugin) into an event file written with TensorBoard's own writer; the
    report is copied next to it (TensorBoard has no artifact store)."""
    _require("tensorboard")
    from tensorboard.compat.proto import types_pb2
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    logdir = Path(cfg.tracking.tensorboard_dir or lake.root / "_tensorboard")
    logdir.mkdir(parents=True, exist_ok=True)
    writer = EventFileWriter(str(logdir))
    try:
        now = time.time()
        values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        writer.add_event(Event(wall_time=now, step=int(round_), summary=Summary(value=values)))
        text = "```\n" + json.dumps(_json_safe(summary), indent=1, sort_keys=True) + "\n```"
        if report is not None:
            copy = logdir / "reports" / f"round-{round_}.html"
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_bytes(report.read_bytes())
            text += f"\n\nreport: {copy}"
        tensor = TensorProto(
            dtype=types_pb2.DT_STRING,
            string_val=[text.encode()],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(plugin_name="text"))
        writer.add_event(
            Event(
                wall_time=now,
                step=int(round_),
                summary=Summary(value=[Summary.Value(tag="round_summary", metadata=meta, tensor=tensor)]),
            )
        )
    finally:
        writer.close()
    return str(logdir)


SENDERS = {"mlflow": to_mlflow, "wandb": to_wandb, "tensorboard": to_tensorboard}


def check_trackers(trackers: list[str]) -> None:
    """Before a round starts: every requested tracker's package imports (one line naming the extra if not)."""
    import importlib.util

    for name in trackers:
        if importlib.util.find_spec(name) is None:
            _require(name)


def track_round(cfg: Config, round_: int, summary: dict) -> dict[str, str]:
    """Send one processed round to every tracker of `cfg.track`; returns tracker -> run id / log dir."""
    if not cfg.track:
        return {}
    from warehouse.catalog import query

    lake = Lake(cfg.lake)
    stats = query(lake, f"SELECT * FROM credit_summary WHERE round = {int(round_)}").to_pylist()
    metrics = round_metrics(summary, stats)
    metrics.update(train_metrics(lake, round_))
    report = None
    if cfg.tracking.report:
        from warehouse.report_file import write_report

        report, _, _ = write_report(lake, lake.root / "_reports" / f"round-{round_}.html", rounds=[round_])
    out = {}
    for name in cfg.track:
        out[name] = SENDERS[name](cfg, lake, round_, metrics, summary, report)
        log.info("round %s sent to %s (%s): %d metrics", round_, name, out[name], len(metrics))
    return out
