"""The trackers' run ids of an object-store lake live in the lake's bucket (a real S3 API: moto's server, the
fixtures of tests/test_lake_s3.py), so a second machine (another local state dir) continues the same runs;
nothing is written into the local state dir. A local lake keeps them in its folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("deltalake")
pytest.importorskip("moto.server")
boto3 = pytest.importorskip("boto3")

from test_lake_s3 import bucket, s3_endpoint, s3_env  # noqa: E402, F401 - the fixtures

from flows.trackers import RUNS_FILE, _lake_name, _runs, _save_run  # noqa: E402
from warehouse.lake import Lake  # noqa: E402


def test_run_ids_go_to_the_lakes_bucket(bucket, s3_env, tmp_path, monkeypatch):  # noqa: F811 - fixtures
    uri = f"s3://{bucket}/lakes/exp1"
    lake = Lake(uri)
    assert _runs(lake) == {}
    assert _save_run(lake, "mlflow", "run-a") == f"{uri}/{RUNS_FILE}"
    _save_run(lake, "wandb", "run-b")
    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1")
    body = client.get_object(Bucket=bucket, Key=f"lakes/exp1/{RUNS_FILE}")["Body"].read()
    assert json.loads(body) == {"mlflow": "run-a", "wandb": "run-b"}
    assert not any(p.name == RUNS_FILE for p in (tmp_path / "state").rglob("*"))  # not the local state dir
    monkeypatch.setenv("CREDITFLOW_STATE_DIR", str(tmp_path / "other-machine"))
    assert _runs(Lake(uri)) == {"mlflow": "run-a", "wandb": "run-b"}
    assert _lake_name(lake) == "exp1"


def test_run_ids_of_a_local_lake(tmp_path):
    lake = Lake(tmp_path / "lake")
    _save_run(lake, "tensorboard", "tb")
    assert json.loads((tmp_path / "lake" / RUNS_FILE).read_text()) == {"tensorboard": "tb"}
    assert _runs(lake) == {"tensorboard": "tb"} and not list((tmp_path / "lake").glob(".tmp-*"))
