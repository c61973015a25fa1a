"""S3 errors of `query` (and of any command opening an S3 lake) say what failed, in one line (#33): the bucket,
the endpoint, the credentials, not delta-rs's "Generic S3 error". A real S3 API (moto's server, the fixtures
of tests/test_lake_s3.py) for a missing bucket and an endpoint that does not answer; the store's other codes
from the text delta-rs gives them in."""

from __future__ import annotations

import socket

import pytest
from test_lake_s3 import bucket, s3_endpoint, s3_env  # noqa: F401 - the fixtures of the moto server
from typer.testing import CliRunner

from flows.cli import app
from warehouse.delta_store import describe_store_error

runner = CliRunner()


def _query(uri: str):
    return runner.invoke(app, ["query", "SELECT count(*) FROM trajectories", "--lake", uri])


def test_missing_bucket_and_dead_endpoint_are_named(s3_env, monkeypatch):  # noqa: F811 - fixtures
    res = _query("s3://no-such-bucket-33/lake")
    assert res.exit_code != 0
    assert res.output.strip().splitlines() == [
        f"lake s3://no-such-bucket-33/lake: bucket 'no-such-bucket-33' does not exist at "
        f"{s3_env['AWS_ENDPOINT_URL']} (NoSuchBucket)"
    ]
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    res = _query("s3://no-such-bucket-33/lake")
    assert res.exit_code != 0
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"lake s3://no-such-bucket-33/lake: cannot reach the endpoint {dead} (")
    assert "Connection refused" in line and "AWS_ENDPOINT_URL" in line and "Generic S3 error" not in line


def _generic(code: str, message: str) -> OSError:
    """An error as delta-rs raises it for a refused request (its causes one per line, colored arrows)."""
    return OSError(
        "Generic S3 error\n   \x1b[31m↳\x1b[0m Error performing list request\n"
        "    \x1b[31m↳\x1b[0m Error performing GET http://h/b?list-type=2 in 5ms - Server returned non-2xx "
        f'status code\n     \x1b[31m↳\x1b[0m 403 Forbidden\n      \x1b[31m↳\x1b[0m <?xml version="1.0"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message></Error>"
    )


@pytest.mark.parametrize(
    "code, words",
    [
        ("InvalidAccessKeyId", "access key id (AWS_ACCESS_KEY_ID)"),
        ("SignatureDoesNotMatch", "secret key (AWS_SECRET_ACCESS_KEY)"),
        ("ExpiredToken", "session token (AWS_SESSION_TOKEN) has expired"),
        ("AccessDenied", "access denied to bucket 'b'"),
        ("SlowDown", "Please reduce your request rate"),
    ],
)
def test_store_codes_say_what_failed(code, words, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://h")
    line = describe_store_error("s3://b/lake", _generic(code, "Please reduce your request rate"))
    assert words in line and line.endswith(f"({code})") and "\n" not in line
