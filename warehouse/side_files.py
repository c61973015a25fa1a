"""Small files a lake keeps beside its tables (the trackers' run ids), in the lake's own storage: the lake's
folder for a local lake, the bucket for an object-store lake (`s3://`, `gs://`), so every machine that works
on the lake sees the same file. (Side state that is per machine, such as round locks and caches, lives in the
local state dir instead: `warehouse.delta_store.state_dir`.)

A local write is atomic (temp file, rename); an object-store PUT replaces the object whole."""

from __future__ import annotations

import json
import os
from urllib.parse import urlparse

import pyarrow.fs as pafs

from warehouse.lake import Lake
from warehouse.tempfiles import temp_token


def _storage(lake: Lake) -> tuple[pafs.FileSystem, str]:
    """The filesystem of the lake's storage and the lake's path in it."""
    if not getattr(lake, "remote", False):
        return pafs.LocalFileSystem(), str(lake.root)
    from warehouse.delta_store import storage_options

    url = urlparse(lake.uri)
    path = f"{url.netloc}{url.path}".rstrip("/")
    if url.scheme not in ("s3", "s3a"):
        fs, _ = pafs.FileSystem.from_uri(lake.uri)
        return fs, path
    opts = storage_options(lake.uri)
    endpoint = urlparse(opts["AWS_ENDPOINT_URL"]) if opts.get("AWS_ENDPOINT_URL") else None
    fs = pafs.S3FileSystem(
        access_key=opts.get("AWS_ACCESS_KEY_ID"),
        secret_key=opts.get("AWS_SECRET_ACCESS_KEY"),
        session_token=opts.get("AWS_SESSION_TOKEN"),
        region=opts.get("AWS_REGION"),
        endpoint_override=endpoint.netloc if endpoint else None,
        scheme=endpoint.scheme if endpoint else "https",
    )
    return fs, path


def read_json(lake: Lake, name: str) -> dict:
    """The JSON object in the lake's file `name`; {} when there is none."""
    fs, base = _storage(lake)
    try:
        with fs.open_input_stream(f"{base}/{name}") as fh:
            return json.loads(fh.read())
    except FileNotFoundError:
        return {}


def write_json(lake: Lake, name: str, data: dict) -> str:
    """Write (replace) the lake's file `name`; returns where it went."""
    fs, base = _storage(lake)
    body = json.dumps(data, indent=1, sort_keys=True).encode()
    if isinstance(fs, pafs.LocalFileSystem):
        os.makedirs(base, exist_ok=True)
        tmp = f"{base}/.tmp-{temp_token()}-{name}"
        with open(tmp, "wb") as fh:
            fh.write(body)
        os.replace(tmp, f"{base}/{name}")
        return f"{base}/{name}"
    with fs.open_output_stream(f"{base}/{name}") as fh:
        fh.write(body)
    return f"{lake.uri}/{name}"
