"""delta-rs at the lake's edges (warehouse/delta_lake.py is the lake): the object store's options from the usual
environment, its errors as one line, the local folder of a remote lake's side state, the Parquet writer
properties, and Rust panic reports kept off the terminal."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import tempfile
import threading
from pathlib import Path

import pyarrow as pa

from warehouse.lake import write_options

STATE_ENV = "CREDITFLOW_STATE_DIR"  # local folder for a remote lake's locks, caches and flow results
PART = "_part"  # the partition column of a lake table's Delta table: the part's name (after `round`)
EMPTY_PARTS = (
    "_empty_parts"  # (tbl, round, part) of the parts written with no rows (Delta keeps no file for them)
)


def arrow_table(obj) -> pa.Table:
    """A table delta-rs returns as an Arrow table."""
    if isinstance(obj, pa.Table):
        return obj
    if hasattr(obj, "__arrow_c_stream__"):  # deltalake's arro3 tables: read through the C stream interface
        # (pa.table() would first import pandas, 0.4 s, only to ask whether obj is a DataFrame)
        return pa.RecordBatchReader.from_stream(obj).read_all()
    return pa.table(obj)


def storage_options(uri: str) -> dict[str, str]:
    """delta-rs storage options for `uri`, from the usual environment: AWS_ACCESS_KEY_ID /
    AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN / AWS_REGION (or AWS_DEFAULT_REGION) / AWS_PROFILE, and an
    S3-compatible endpoint from AWS_ENDPOINT_URL (or CREDITFLOW_S3_ENDPOINT). delta-rs reads the AWS_*
    variables itself; these are passed explicitly so the same lake URI works in a worker process."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    opts: dict[str, str] = {}
    if scheme in ("s3", "s3a"):
        for key in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_SESSION_TOKEN",
            "AWS_REGION",
            "AWS_PROFILE",
            "AWS_ALLOW_HTTP",
            "AWS_S3_ALLOW_UNSAFE_RENAME",
        ):
            if os.environ.get(key):
                opts[key] = os.environ[key]
        if "AWS_REGION" not in opts and os.environ.get("AWS_DEFAULT_REGION"):
            opts["AWS_REGION"] = os.environ["AWS_DEFAULT_REGION"]
        endpoint = os.environ.get("CREDITFLOW_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["AWS_ENDPOINT_URL"] = endpoint
            if endpoint.startswith("http://"):
                opts.setdefault("AWS_ALLOW_HTTP", "true")
        if opts.get("AWS_S3_ALLOW_UNSAFE_RENAME", "").lower() != "true":
            opts.setdefault("conditional_put", "etag")
    return opts


_S3_CODES = {
    "NoSuchBucket": "bucket {bucket!r} does not exist at {endpoint}",
    "NoSuchKey": "a key under {uri} is missing (a table written only in part, or removed)",
    "AccessDenied": "access denied to bucket {bucket!r}: the credentials may not read it",
    "AllAccessDisabled": "access denied to bucket {bucket!r}: the credentials may not read it",
    "InvalidAccessKeyId": "credentials: the access key id (AWS_ACCESS_KEY_ID) is not known to {endpoint}",
    "SignatureDoesNotMatch": "credentials: the secret key (AWS_SECRET_ACCESS_KEY) does not match the key id",
    "ExpiredToken": "credentials: the session token (AWS_SESSION_TOKEN) has expired",
    "InvalidToken": "credentials: the session token (AWS_SESSION_TOKEN) is not valid",
    "PermanentRedirect": "bucket {bucket!r} is in another region than AWS_REGION",
    "AuthorizationHeaderMalformed": "credentials or region: the request was refused ({message})",
}


def describe_store_error(uri: str, exc: BaseException) -> str:
    """One line saying what failed on object storage, for an error of delta-rs's object store (whose text is
    "Generic S3 error" and a chain of causes, one per line): the bucket, a key, the credentials or the
    endpoint, with the store's own code."""
    from urllib.parse import urlparse

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    flat = " ".join(line.strip().lstrip("↳").strip() for line in text.splitlines() if line.strip())
    url = urlparse(uri)
    endpoint = storage_options(uri).get("AWS_ENDPOINT_URL") or "AWS S3"
    code = re.search(r"<Code>([^<]+)</Code>", flat)
    message = re.search(r"<Message>([^<]+)</Message>", flat)
    lower = flat.lower()
    where = {"uri": uri, "bucket": url.netloc, "endpoint": endpoint, "message": message and message.group(1)}
    if code:
        name = code.group(1)
        what = _S3_CODES.get(name, "{message}").format(**where)
        return f"{what} ({name})"
    if any(k in lower for k in ("error sending request", "connection refused", "dns error", "tcp connect")):
        cause = flat.rsplit("↳", 1)[-1].strip()
        last = re.split(r"\s{2,}|(?<=[a-z)]) (?=[A-Z])", cause)[-1] if cause else ""
        return f"cannot reach the endpoint {endpoint} ({last or 'no answer'}): check AWS_ENDPOINT_URL"
    if "credential" in lower or "no valid" in lower:
        return (
            f"credentials: none found for {uri} (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE)"
        )
    status = re.search(r"\b([1-5]\d\d [A-Z][A-Za-z ]+?)(?= |$)", flat)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"{first}: {status.group(1)}" if status else first


def state_dir(uri: str) -> Path:
    """The local folder of a remote lake's side state (round locks, stage caches, Prefect results)."""
    base = Path(os.environ.get(STATE_ENV) or Path.home() / ".cache" / "creditflow" / "lakes")
    digest = hashlib.sha256(uri.encode()).hexdigest()[:12]
    name = uri.split("://", 1)[-1].strip("/").replace("/", "_")[:60]
    return base / f"{name}-{digest}"


def writer_properties(schema: pa.Schema):
    """The hive lake's Parquet options (`warehouse.lake.write_options`) for delta-rs: zstd (delta-rs defaults to
    snappy) and a dictionary only for the top-level string columns. delta-rs builds one for every column by
    default: a gae advantages part (10,752 rows of per-token lists, 29 MB in memory) took 0.60 s to write
    instead of 0.39 s, as long as pyarrow's write of the same part with the hive options."""
    from deltalake import ColumnProperties, WriterProperties

    opts = write_options(schema)
    return WriterProperties(
        compression=opts["compression"].upper(),
        default_column_properties=ColumnProperties(dictionary_enabled=False),
        column_properties={
            name: ColumnProperties(dictionary_enabled=True) for name in opts["use_dictionary"]
        },
    )


_QUIET = threading.Lock()
_quiet_state: dict = {"depth": 0}
_PANIC = re.compile(r"^thread '[^']*'( \(\d+\))? panicked at ")


@contextlib.contextmanager
def rust_panics_quiet():
    """Keep delta-rs's Rust panic reports off the terminal for the block: a write that fails midway (a full
    disk) makes its upload task panic on a worker thread, whose report (and, with RUST_BACKTRACE set, its
    backtrace) Rust's panic hook writes straight to file descriptor 2 while the write's own error reaches
    Python as an exception. The descriptor goes to a temporary file for the block (shared by the threads in
    one, restored by the last); afterwards everything but the panic reports is written back to it, and the
    reports go to this module's logger (debug)."""
    with _QUIET:
        if _quiet_state["depth"] == 0:
            sys.stderr.flush()
            capture = tempfile.TemporaryFile()
            _quiet_state.update(capture=capture, saved=os.dup(2))
            os.dup2(capture.fileno(), 2)
        _quiet_state["depth"] += 1
    try:
        yield
    finally:
        with _QUIET:
            _quiet_state["depth"] -= 1
            if _quiet_state["depth"] == 0:
                sys.stderr.flush()
                saved, capture = _quiet_state.pop("saved"), _quiet_state.pop("capture")
                os.dup2(saved, 2)
                os.close(saved)
                capture.seek(0)
                text = capture.read().decode("utf-8", "replace")
                capture.close()
                kept, panics = _split_panics(text)
                if kept:
                    os.write(2, kept.encode())
                if panics:
                    logging.getLogger(__name__).debug("delta-rs panicked on a worker thread:\n%s", panics)


def _split_panics(text: str) -> tuple[str, str]:
    """(the text without Rust panic reports, the reports): a report runs from its `thread '...' panicked at`
    line to its `note: ...` line (the end of the report) or, with no note, to the end."""
    kept: list[str] = []
    panics: list[str] = []
    in_panic = False
    for line in text.splitlines(keepends=True):
        if _PANIC.match(line):
            in_panic = True
            if kept and not kept[-1].strip():
                kept.pop()
        if in_panic:
            panics.append(line)
            if line.startswith("note: "):
                in_panic = False
        else:
            kept.append(line)
    return "".join(kept), "".join(panics)
