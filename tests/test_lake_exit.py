"""A process that reads a Delta lake and exits at once exits cleanly (#33): reading 8 tables and exiting was
aborted (SIGABRT, "terminate called without an active exception") in about 4 runs of 20, by Arrow scanner
threads calling back into delta-rs's Python file system while the interpreter shut down; local tables are now
scanned through Arrow's native file system (`DeltaLake.native_fs`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pyarrow as pa
import pytest

from warehouse.lake import FORMAT_ENV, Lake

TABLES = [f"t{i}" for i in range(8)]
SCRIPT = textwrap.dedent(
    """
    import sys
    from warehouse.lake import Lake
    lake = Lake(sys.argv[1])
    rows = sum(lake.read(name).num_rows for name in sys.argv[2:])
    assert rows == 8 * 3 * 2 * 50, rows
    """
)


@pytest.mark.slow
def test_reading_eight_tables_then_exiting_never_aborts(tmp_path, monkeypatch):
    monkeypatch.setenv(FORMAT_ENV, "delta")
    lake = Lake(tmp_path / "lake")
    assert lake.format == "delta"
    for name in TABLES:
        for r in range(3):
            for part in ("a", "b"):
                lake.write_part(
                    name, r, pa.table({"x": list(range(50)), "s": [f"{name}{r}{part}"] * 50}), part
                )
    script = tmp_path / "read8.py"
    script.write_text(SCRIPT)
    codes = []
    for _ in range(20):
        res = subprocess.run(
            [sys.executable, str(script), str(lake.root), *TABLES],
            capture_output=True,
            text=True,
            timeout=120,
        )
        codes.append((res.returncode, res.stderr.strip()[-300:]))
    assert codes == [(0, "")] * 20
