"""Experiment trackers (#26): `--track mlflow|wandb|tensorboard` sends each round's credit statistics (step =
round), the round summary and the report; read back with each tracker's own code (MLflow's client on a local
file store, W&B's protobuf records of an offline run, TensorBoard's event accumulator)."""

from __future__ import annotations

import glob
import json
import struct

import pytest
from test_report import _round

from flows.trackers import TrackerMissing, check_trackers, round_metrics, track_round
from pipeline.config import ConfigError, build_config
from warehouse.catalog import query


def _cfg(lake, tracker, tmp_path, *sets):
    return build_config(
        {"lake": str(lake.root), "methods": ["grpo", "dr_grpo"], "track": [tracker]},
        [f"tracking.wandb_dir={tmp_path / 'wandb'}", "tracking.wandb_mode=offline", *sets],
    )


def _two_rounds(lake, cfg):
    _round(lake, 0)
    _round(lake, 1)
    out = {}
    for r in (0, 1):
        summary = {"round": r, "trajectories": 12, "tokens": 100 + r, "quarantined": 0, "wall_seconds": 1.5}
        out[r] = track_round(cfg, r, summary)
    stats = {
        r: {
            row["method"]: row
            for row in query(lake, f"SELECT * FROM credit_summary WHERE round = {r}").to_pylist()
        }
        for r in (0, 1)
    }
    return out, stats


def test_round_metrics_by_hand():
    m = round_metrics(
        {"trajectories": 4, "tokens": 10, "wall_seconds": float("nan"), "lake": "x"},
        [
            {
                "method": "grpo",
                "mean_adv": 0.5,
                "min_adv": -1.0,
                "assistant_tokens": 8,
                "positive_tokens": 6,
                "negative_tokens": 2,
                "max_adv": None,
            }
        ],
    )
    assert m == {
        "round/trajectories": 4.0,
        "round/tokens": 10.0,
        "credit/grpo/mean_adv": 0.5,
        "credit/grpo/min_adv": -1.0,
        "credit/grpo/assistant_tokens": 8.0,
        "credit/grpo/positive_share": 0.75,
        "credit/grpo/negative_share": 0.25,
    }


def test_mlflow_file_store(lake, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    cfg = _cfg(lake, "mlflow", tmp_path, f"tracking.mlflow_uri={uri}")
    out, stats = _two_rounds(lake, cfg)
    assert out[0]["mlflow"] == out[1]["mlflow"]  # one run per lake, a point per round
    client = MlflowClient(tracking_uri=uri)
    run_id = out[0]["mlflow"]
    history = client.get_metric_history(run_id, "credit/grpo/max_adv")
    assert [(h.step, h.value) for h in sorted(history, key=lambda h: h.step)] == [
        (r, pytest.approx(stats[r]["grpo"]["max_adv"])) for r in (0, 1)
    ]
    assert [h.value for h in client.get_metric_history(run_id, "round/tokens")] == [100.0, 101.0]
    reports = [a.path for a in client.list_artifacts(run_id, "reports")]
    assert reports == ["reports/round-0.html", "reports/round-1.html"]
    local = client.download_artifacts(run_id, "rounds/round-1-summary.json", str(tmp_path / "dl"))
    assert json.loads(open(local).read())["tokens"] == 101


def _wandb_records(path):
    """The records of a W&B transaction log (LevelDB log framing), decoded with wandb's own protobuf."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf, out = 7, b"", []
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk = data[pos : pos + length]
        pos += length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def test_wandb_offline(lake, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(lake, "wandb", tmp_path)
    out, stats = _two_rounds(lake, cfg)
    assert out[0]["wandb"] == out[1]["wandb"]
    files = sorted(glob.glob(str(tmp_path / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(out[0]["wandb"] in f for f in files)  # the same run id, resumed
    history, artifacts = {}, []
    for f in files:
        for rec in _wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                history[items["_step"]] = items
            elif kind == "artifact":
                artifacts.append((rec.artifact.name, rec.artifact.type))
    assert sorted(history) == [0, 1]
    for r in (0, 1):
        assert history[r]["credit/dr_grpo/min_adv"] == pytest.approx(stats[r]["dr_grpo"]["min_adv"])
        assert history[r]["round/tokens"] == 100 + r
    assert sorted(artifacts) == [(f"report-lake-round-{r}", "report") for r in (0, 1)]


def test_tensorboard_event_file(lake, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _cfg(lake, "tensorboard", tmp_path, f"tracking.tensorboard_dir={tmp_path / 'tb'}")
    _, stats = _two_rounds(lake, cfg)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    points = acc.Scalars("credit/grpo/mean_adv")
    assert [p.step for p in points] == [0, 1]
    assert [p.value for p in points] == [
        pytest.approx(stats[r]["grpo"]["mean_adv"], abs=1e-6) for r in (0, 1)
    ]
    texts = acc.Tensors("round_summary")
    summary = texts[-1].tensor_proto.string_val[0].decode()
    assert '"tokens": 101' in summary and "round-1.html" in summary
    assert (tmp_path / "tb" / "reports" / "round-1.html").stat().st_size > 100_000


def test_unknown_or_missing_tracker_is_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="unknown tracker.*nosuch"):
        build_config({"track": ["nosuch"]})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import fails as if not installed
    with pytest.raises(TrackerMissing, match=r"creditflow\[track\]"):
        check_trackers(["wandb"])


def test_training_metrics_reach_the_tracker(lake, tmp_path):
    """A round the loop trained sends the trainer's last step per method (train/<method>/<key>)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_report import _train_metrics

    _train_metrics(lake)
    cfg = _cfg(
        lake, "tensorboard", tmp_path, f"tracking.tensorboard_dir={tmp_path / 'tb'}", "tracking.report=false"
    )
    _two_rounds(lake, cfg)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    loss = acc.Scalars("train/grpo/loss")
    # the last of 3 steps per round: loss = 1 / (1 + step + 3 * round)
    assert [(p.step, p.value) for p in loss] == [(0, pytest.approx(1 / 3)), (1, pytest.approx(1 / 6))]
    assert [p.value for p in acc.Scalars("train/grpo/entropy")] == [pytest.approx(1.8)] * 2


def test_mlflow_takes_method_chain_metrics(lake, tmp_path):
    """MLflow refuses '+' in a metric name ('credit/grpo+c3/mean_adv'): a chain's metrics go as 'grpo-c3'."""
    from mlflow.tracking import MlflowClient

    from flows.trackers import to_mlflow

    uri = (tmp_path / "mlruns").as_uri()
    cfg = _cfg(lake, "mlflow", tmp_path, f"tracking.mlflow_uri={uri}")
    _round(lake, 0)
    metrics = {"credit/grpo+c3/mean_adv": 0.25, "credit/grpo/mean_adv": 0.5}
    run_id = to_mlflow(cfg, lake, 0, metrics, {"round": 0}, None)
    client = MlflowClient(tracking_uri=uri)
    assert [h.value for h in client.get_metric_history(run_id, "credit/grpo-c3/mean_adv")] == [0.25]
    assert [h.value for h in client.get_metric_history(run_id, "credit/grpo/mean_adv")] == [0.5]
