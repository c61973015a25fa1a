"""The lake as Delta tables (delta-rs), the same on a local folder and on object storage (s3://, gs://, ...).

Each lake table is one Delta table `LAKE/<table>`, partitioned by `round` and `_part` (the part name, the unit
the flow writes and caches on). Writes are Delta commits, atomic and idempotent:
- `write_part` is an overwrite with the predicate `round = r AND _part = 'p'` (one commit);
- `write_parts` is one overwrite with `round = r AND _part IN ('p', 'q', ...)` for parts that together are small
  (a stage's parts of a batch, one per method), a commit of its own for a big one;
- `replace_partition` is an overwrite with `round = r` holding all the parts (one commit).
A reader sees the table at its last committed version; a writer killed mid-write leaves uncommitted files only
(never read). Concurrent writers: a commit that loses a race is retried (the writes are idempotent overwrites),
so two runs writing the same part both finish with the same result. On S3, commits need a conditional put:
`conditional_put=etag` (S3 and S3-compatible servers that support `If-Match`) is set by default; set
`AWS_S3_ALLOW_UNSAFE_RENAME=true` for a store without it and only one writer.

The lake version is one token naming every table's Delta version (`trajectories=3,steps=3,advantages=12`);
`read(..., as_of=...)` and `warehouse.catalog.connect(as_of=...)` read the lake as of such a token or an ISO
timestamp. Credentials and endpoints: see `storage_options`.

The class delegates its read side (versions, datasets, `read`) to `warehouse.delta_read` and the generations of
a round's ingest to `warehouse.delta_generations`; `warehouse.delta_migrate` converts a hive lake to Delta."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import pyarrow as pa

from warehouse import delta_generations, delta_read
from warehouse.delta_store import (
    EMPTY_PARTS,
    PART,
    arrow_table,
    describe_store_error,
    rust_panics_quiet,
    state_dir,
    storage_options,
    writer_properties,
)
from warehouse.lake import (
    BACKENDS,
    GEN_SEP,
    INGEST_TABLES,
    Lake,
    LakeError,
    is_remote,
    lake_path,
    safe_part_name,
    split_generation,
    tag_generation,
)
from warehouse.tempfiles import temp_token

PARTITION_BY = ["round", PART]
COMMIT_RETRIES = 20


_LOADED = threading.local()  # per thread: {lake URI: {table: DeltaTable kept up to date}} (`_open_tables`)
KEPT_LAKES = 8  # lakes whose tables a thread keeps loaded (a test session opens hundreds)


def _checkpointed_since(t) -> bool:
    """Whether a kept table's log passed a checkpoint (a multiple of CHECKPOINT_EVERY) since it was loaded: its
    snapshot, grown by a record batch per commit, is then better loaded again from the checkpoint."""
    loaded = getattr(t, "_creditflow_loaded", None)
    return loaded is not None and t.version() // CHECKPOINT_EVERY > loaded // CHECKPOINT_EVERY


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class VirtualPart(PurePosixPath):
    """A part of a Delta lake named like a hive part file (`.../round=<n>/part-<name>.parquet`); it is not a
    file: read it with `Lake.read(..., parts=[p])`."""


# a table's log is checkpointed every CHECKPOINT_EVERY commits; a kept table is loaded afresh once a checkpoint was
# written since it was loaded (`_latest`): delta-rs brings a kept table up to date by appending each new commit's
# files to its snapshot as one more record batch, never merged, so every commit through it scanned all of them
# (15 -> 137 ms per commit over 1,200 single-part commits; loaded from the checkpoint: 26 ms; the same behaviour
# as delta-io/kafka-delta-ingest#227)
CHECKPOINT_EVERY = 50
WRITE_GROUP_BYTES = 32 * 2**20  # write_parts: the most Arrow data one commit of several parts takes


class DeltaLake(Lake):
    format = "delta"

    def __init__(self, root: str | os.PathLike):
        text = os.fspath(root)
        if is_remote(text):
            self.uri = text.rstrip("/")
            self.remote = True
            self.root = state_dir(self.uri)
        else:
            self.root = lake_path(text)
            self.uri = str(self.root)
            self.remote = False
        self.storage_options = storage_options(self.uri)
        self.last_versions: dict[str, int] = {}

    # ---- tables ----------------------------------------------------------------------------------
    def table_uri(self, table: str) -> str:
        return f"{self.uri}/{table}"

    def table_dir(self, table: str) -> Path:
        return PurePosixPath(self.table_uri(table)) if self.remote else self.root / table  # type: ignore[return-value]

    def partition_dir(self, table: str, round_: int):
        return PurePosixPath(self.table_uri(table)) / f"round={int(round_)}"

    def _open_tables(self) -> dict:
        """This thread's loaded tables of this lake (a DeltaTable is not shared between threads), kept for the
        process by the lake's URI: the flow opens a `Lake` per task and per cache key, and each new one loaded
        every table's log again (~5 ms a load, ~18 loads per batch of `creditflow process`)."""
        lakes = _LOADED.__dict__.setdefault("lakes", {})
        tables = lakes.pop(self.uri, None)
        if tables is None:
            tables = {}
            while len(lakes) >= KEPT_LAKES:  # the least recently used lake's tables go
                lakes.pop(next(iter(lakes)))
        lakes[self.uri] = tables  # most recently used last
        return tables

    def _log_id(self, table: str) -> tuple[int, int]:
        """The identity of a local table's first commit file (inode, modification time; written once): a table
        deleted and made again at the same path (a fresh lake in the same process) has another, so a kept table
        of the old one is not reused."""
        try:
            st = os.stat(self.root / table / "_delta_log" / f"{0:020d}.json")
        except OSError:
            return (-1, -1)
        return (st.st_ino, st.st_mtime_ns)

    def _latest(self, table: str):
        """The table at its latest version: loaded once, then brought up to date by reading only the commits
        made since (`update_incremental`, ~0.3 ms) instead of loading the log again (2-20 ms per call, dozens of
        calls per batch). None: not loaded yet, or the kept one may not serve (`_serves`): dropped."""
        cached = self._open_tables().get(table)
        if cached is not None and self._serves(table, cached):
            return cached
        self._open_tables().pop(table, None)
        return None

    def _serves(self, table: str, cached) -> bool:
        """Whether the kept table can serve, brought up to date: not when its folder was replaced, nor when its
        log passed a checkpoint since it was loaded (by its own commits or other writers'; `_checkpointed_since`),
        nor when it cannot be brought up to date."""
        if not self.remote and (
            getattr(cached, "_creditflow_log_id", None) != self._log_id(table)
            or not (self.root / table / "_delta_log" / f"{cached.version():020d}.json").exists()
        ):  # the folder was replaced (an in-place migration, a lake made again): its log is another one
            return False
        # no commit since (commits are numbered in order): one stat, not a listing of the log
        if (
            not self.remote
            and not (self.root / table / "_delta_log" / f"{cached.version() + 1:020d}.json").exists()
        ):
            return not _checkpointed_since(cached)
        try:
            cached.update_incremental()
        except Exception:  # noqa: BLE001 - the table was replaced or removed under us: load it afresh
            return False
        return not _checkpointed_since(cached)

    def _table(self, table: str, version: int | str | dt.datetime | None = None, fresh: bool = False):
        """The Delta table `table` (None when absent) at its latest version, or at `version` (a new object;
        `fresh`: a new one too, for a caller that moves it to another version)."""
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        if not self.remote and not (self.root / table / "_delta_log").is_dir():
            self._open_tables().pop(table, None)
            return None
        if version is None and not fresh and (t := self._latest(table)) is not None:
            return t
        try:
            t = DeltaTable(self.table_uri(table), storage_options=self.storage_options)
        except TableNotFoundError:
            return None
        if version is None and not fresh:
            if not self.remote:
                t._creditflow_log_id = self._log_id(table)  # type: ignore[attr-defined]
            t._creditflow_loaded = t.version()  # type: ignore[attr-defined]
            self._open_tables()[table] = t
        if version is not None:
            try:
                t.load_as_version(version)
            except Exception as exc:  # noqa: BLE001 - delta-rs raises several kinds; one line for the user
                raise LakeError(
                    f"table {table!r} has no version {version!r}: {str(exc).splitlines()[0]}"
                ) from None
        return t

    def _actions(self, table: str) -> pa.Table | None:
        return delta_generations.visible_actions(self, table)

    def generations(self, as_of=None) -> dict[int, str]:
        """Round -> the generation of the round's ingest that readers see (`warehouse.delta_generations`)."""
        return delta_generations.generations(self, as_of)

    def _raw_actions(self, table: str) -> pa.Table | None:
        """The table's live files (its log's add actions) at its latest version, as Arrow; kept with the loaded
        table until its version changes (several calls per batch stage)."""
        t = self._table(table)
        if t is None:
            return None
        version = t.version()
        kept = getattr(t, "_creditflow_actions", None)
        if kept is not None and kept[0] == version:
            return kept[1]
        acts = arrow_table(t.get_add_actions(flatten=True))
        t._creditflow_actions = (version, acts)
        return acts

    def exists(self) -> bool:
        from schemas import TABLES

        if not self.remote:
            return any((self.root / table / "_delta_log").is_dir() for table in TABLES)
        from deltalake import DeltaTable

        for table in ("trajectories", *TABLES):
            try:
                if DeltaTable.is_deltatable(self.table_uri(table), storage_options=self.storage_options):
                    return True
            except OSError as exc:
                raise LakeError(f"lake {self.uri}: {describe_store_error(self.uri, exc)}") from None
        return False

    def tables(self) -> dict[str, int]:
        """Every table present and its current Delta version."""
        from schemas import TABLES

        out = {}
        for table in TABLES:
            t = self._table(table)
            if t is not None:
                out[table] = t.version()
        return out

    def version(self) -> str:
        return ",".join(f"{t}={v}" for t, v in sorted(self.tables().items()))

    parse_version = staticmethod(delta_read.parse_version)

    def table_at(self, table: str, as_of: str | dict | dt.datetime | None):
        """The Delta table as of a lake version (None: absent then)."""
        return delta_read.table_at(self, table, as_of)

    # ---- reads -----------------------------------------------------------------------------------
    def rounds(self, table: str) -> list[int]:
        acts = self._actions(table)
        if acts is None or acts.num_rows == 0:
            return []
        return sorted({int(r) for r in acts.column("partition.round").to_pylist()})

    def _data_names(self, table: str, round_: int) -> set[str]:
        acts = self._actions(table)
        if acts is None or acts.num_rows == 0:
            return set()
        rounds = acts.column("partition.round").to_pylist()
        names = acts.column(f"partition.{PART}").to_pylist()
        return {n for r, n in zip(rounds, names, strict=True) if int(r) == int(round_)}

    def _empty_names(self, table: str, round_: int) -> set[str]:
        """Parts written with no rows: a part is there (its stage ran) even though Delta keeps no file."""
        stored = {name for r, name in self._raw_empty(table) if r == int(round_)}
        if table not in INGEST_TABLES:
            return stored
        gen = self.generations().get(int(round_), "")
        return {base for base, g in map(split_generation, stored) if g == gen}

    def _raw_empty(self, table: str) -> list[tuple[int, str]]:
        """(round, stored part name) of the table's empty parts; kept until `_empty_parts` changes."""
        t = self._table(EMPTY_PARTS)
        if t is None:
            return []
        kept = getattr(t, "_creditflow_empty", None)
        if kept is None or kept[0] != t.version():
            rows = t.to_pyarrow_dataset().to_table(columns=["tbl", "round", "part"])
            by_table: dict[str, list[tuple[int, str]]] = {}
            for tbl, r, name in zip(
                *(rows.column(c).to_pylist() for c in ("tbl", "round", "part")), strict=True
            ):
                by_table.setdefault(tbl, []).append((int(r), name))
            kept = (t.version(), by_table)
            t._creditflow_empty = kept
        return kept[1].get(table, [])

    def _set_empty(self, table: str, round_: int, names: list[str], predicate: str) -> None:
        """Replace the empty-part records matching `predicate` (within this table and round) with `names`."""
        if not names and self._table(EMPTY_PARTS) is None:
            return
        rows = pa.table(
            {
                "tbl": pa.array([table] * len(names), pa.string()),
                "round": pa.array([int(round_)] * len(names), pa.int32()),
                "part": pa.array(names, pa.string()),
            }
        )
        self._commit(
            EMPTY_PARTS, rows, f"tbl = '{table}' AND round = {int(round_)}{predicate}", partition_by=None
        )

    def part_names(self, table: str, round_: int) -> list[str]:
        names = self._data_names(table, round_) | self._empty_names(table, round_)
        return sorted(names, key=lambda n: f"part-{n}.parquet")  # the order of hive's part files

    def parts(self, table: str, round_: int) -> list[Path]:
        d = self.partition_dir(table, round_)
        return [VirtualPart(d / f"part-{n}.parquet") for n in self.part_names(table, round_)]  # type: ignore[misc]

    def has_part(self, table: str, round_: int, part: str) -> bool:
        return safe_part_name(part) in self.part_names(table, round_)

    def part_stat(self, table: str, round_: int, part: str) -> tuple[str, int, int]:
        return delta_read.part_stat(self, table, round_, part)

    def count_rows(self, table: str, round_: int) -> int:
        return delta_read.count_rows(self, table, round_)

    def native_fs(self, table: str):
        """A local table's folder as Arrow's native file system. delta-rs's default is a Python file system
        (`DeltaStorageHandler` through `pyarrow.fs.PyFileSystem`): Arrow's scanner threads called back into
        Python, and a process that exited right after reading (a script reading 8 tables) was aborted in about
        1 run in 20 ("terminate called without an active exception", SIGABRT) by such a thread still running
        while the interpreter shut down."""
        import pyarrow.fs as pafs

        return pafs.SubTreeFileSystem(str(self.root / table), pafs.LocalFileSystem())

    def dataset(self, table: str, as_of=None):
        """The table as a pyarrow dataset of the visible generation (None when absent): what DuckDB scans."""
        return delta_read.dataset(self, table, as_of)

    read = delta_read.read  # Lake.read: a method of this class, defined there

    def columns(self, table_name: str, round_: int, parts: list[Path] | None = None) -> list[str]:
        """Lake.columns: the Delta table's schema from its log (no data file opened); a column that a part of
        another round brought is there too (`read` gives this round's parts nulls of it)."""
        from schemas import TABLES

        t = self._table(table_name)
        if t is None:
            return Lake.columns(self, table_name, round_, [])
        names = [f.name for f in t.schema().fields if f.name != PART]
        spec = TABLES.get(table_name)
        return spec.readable(names) if spec is not None else names

    # ---- writes ----------------------------------------------------------------------------------
    def _frame(self, table_name: str, round_: int, part: str, table: pa.Table) -> pa.Table:
        table = self._prepare(table_name, table)
        n = table.num_rows
        table = table.append_column("round", pa.array([int(round_)] * n, pa.int32()))
        return table.append_column(PART, pa.array([safe_part_name(part)] * n, pa.string()))

    def check_writable(self, table_name: str, rounds: Iterable[int] = ()) -> None:
        """A local table's folders this process cannot write (a read-only lake): LakeError, one line, before
        delta-rs starts (its writer, refused a folder midway, panics on a worker thread and prints a Rust
        backtrace)."""
        if self.remote:
            return
        table_dir = self.root / table_name
        for path in (table_dir, table_dir / "_delta_log", *(table_dir / f"round={int(r)}" for r in rounds)):
            probe = path
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            if not os.access(probe, os.W_OK | os.X_OK):
                why = "a read-only file system" if _read_only_fs(probe) else "no write permission"
                raise LakeError(f"lake {self.uri}: cannot write {probe} ({why})")

    def _commit(self, table_name: str, data: pa.Table, predicate: str, partition_by=PARTITION_BY) -> int:
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError

        rounds = set(data.column("round").unique().to_pylist()) if "round" in data.column_names else set()
        self.check_writable(table_name, rounds)

        uri = self.table_uri(table_name)
        props = writer_properties(data.schema)
        for attempt in range(COMMIT_RETRIES):
            target = self._table(table_name)  # written through: its version is the commit's afterwards
            if target is None:
                target = self._create(table_name, data.schema, partition_by)
            try:
                with rust_panics_quiet():
                    write_deltalake(
                        target if target is not None else uri,
                        data,
                        mode="overwrite",
                        predicate=predicate,
                        partition_by=partition_by,
                        schema_mode="merge",  # a part may bring a column the earlier parts lack (read as nulls)
                        storage_options=self.storage_options,
                        configuration={"delta.checkpointInterval": str(CHECKPOINT_EVERY)},
                        writer_properties=props,
                    )
                break
            except CommitFailedError:  # another writer committed first: our overwrite is idempotent, retry
                if attempt == COMMIT_RETRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
        version = (target if target is not None else self._table(table_name)).version()
        self.last_versions[table_name] = version
        return version

    def _create(self, table_name: str, schema: pa.Schema, partition_by):
        """A new table, created empty before its first write. delta-rs writing a table that does not exist yet
        commits its data with the table's creation; two writers doing that at once (two processes' first
        advantages part) both commit, the second as the next version without removing the first's files, so
        the part's rows were there twice. An empty creation that loses that race adds no rows, and the data
        then goes through the overwrite's conflict check like every later commit."""
        from deltalake import DeltaTable
        from deltalake.exceptions import CommitFailedError

        if not self.remote:
            self._mark()
        with contextlib.suppress(CommitFailedError), rust_panics_quiet():  # another writer created it first
            DeltaTable.create(
                self.table_uri(table_name),
                schema,
                mode="ignore",
                partition_by=partition_by,
                storage_options=self.storage_options,
                configuration={"delta.checkpointInterval": str(CHECKPOINT_EVERY)},
            )
        return self._table(table_name)

    def _mark(self) -> None:
        """`LAKE/_format` says delta before a table's first commit: delta-rs writes the data files before the
        log, and a table folder without a `_delta_log` (a reader in between, a killed first write) would
        otherwise read as a hive lake (`warehouse.lake.lake_format`)."""
        marker = self.root / "_format"
        if not marker.is_file():
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".tmp-{temp_token()}-_format"
            tmp.write_text("delta\n", encoding="utf-8")
            os.replace(tmp, marker)

    def _stored(self, table_name: str, round_: int, gen: str | None = None) -> str:
        """The generation a part of this table and round is stored with ("": untagged)."""
        if table_name not in INGEST_TABLES:
            return ""
        return self.generations().get(int(round_), "") if gen is None else gen

    def write_part(self, table_name: str, round_: int, table: pa.Table, part: str = "0") -> Path:
        """Atomically write (or replace) one part of a (table, round) partition: one Delta commit."""
        self._write_group(table_name, round_, {part: table})
        return VirtualPart(self.part_path(table_name, round_, part))  # type: ignore[return-value]

    def write_parts(self, table_name: str, round_: int, parts: dict[str, pa.Table]) -> None:
        """Write (or replace) several parts of a (table, round) partition, the others left as they are, in as
        few Delta commits as keep the writer's memory bounded: parts in order, together while their Arrow sizes
        add up to at most WRITE_GROUP_BYTES (a credit batch's advantages of every method: one commit, not one
        per method; a commit costs more the more files the table holds). Each commit is atomic; delta-rs
        buffers a commit's data whole, so export's train_batch parts (~20 MB each at 64 groups) stay one per
        commit: four together cost ~200 MB more in each process."""
        group: dict[str, pa.Table] = {}
        size = 0
        for part, table in parts.items():
            if group and size + table.nbytes > WRITE_GROUP_BYTES:
                self._write_group(table_name, round_, group)
                group, size = {}, 0
            group[part] = table
            size += table.nbytes
        if group:
            self._write_group(table_name, round_, group)

    def _write_group(self, table_name: str, round_: int, parts: dict[str, pa.Table]) -> None:
        """Parts of one (table, round) in one commit: an overwrite with round = r AND _part = 'p' (one part) or
        _part IN ('p', 'q', ...), and the empty-part records of those parts brought up to date."""
        gen = self._stored(table_name, round_)
        logical = {tag_generation(safe_part_name(n), gen): safe_part_name(n) for n in parts}
        stored = dict(zip(logical, parts.values(), strict=True))
        frames = [self._frame(table_name, round_, name, tbl) for name, tbl in stored.items()]
        names = ", ".join(f"'{n}'" for n in stored)  # (safe_part_name: no quotes in a part's name)
        match = f"= {names}" if len(stored) == 1 else f"IN ({names})"
        data = frames[0] if len(frames) == 1 else pa.concat_tables(frames, promote_options="permissive")
        self._commit(table_name, data, f"round = {int(round_)} AND {PART} {match}")
        empty = [n for n, f in zip(stored, frames, strict=True) if f.num_rows == 0]
        was_empty = set(logical.values()) & self._empty_names(table_name, round_)
        if empty or was_empty:
            self._set_empty(table_name, round_, empty, f" AND part {match}")

    def replace_partition(
        self,
        table_name: str,
        round_: int,
        parts: dict[str, pa.Table] | pa.Table,
        gen: str | None = None,
        staged: bool = False,
    ) -> Path:
        """Atomically replace the whole (table, round) partition: one Delta commit. The tables of a round's
        ingest store their parts with a generation (`generations`): the round's visible one, or `gen`; with
        `staged` the parts of other generations stay (a follower table's new parts, not yet published)."""
        if isinstance(parts, pa.Table):
            parts = {"0": parts}
        gen = self._stored(table_name, round_, gen)
        stored = {tag_generation(safe_part_name(n), gen): tbl for n, tbl in parts.items()}
        where = f"round = {int(round_)}"
        if staged and gen:
            where += f" AND {PART} LIKE '%{GEN_SEP}{gen}'"
        frames = [self._frame(table_name, round_, name, tbl) for name, tbl in stored.items()]
        if frames:
            self._commit(table_name, pa.concat_tables(frames, promote_options="permissive"), where)
        elif (t := self._table(table_name)) is not None:  # no parts at all: the round is emptied
            self.check_writable(table_name)
            with rust_panics_quiet():
                t.delete(where)
            self.last_versions[table_name] = t.version()
        empty = [n for n, f in zip(stored, frames, strict=True) if f.num_rows == 0]
        self._set_empty(
            table_name, round_, empty, f" AND part LIKE '%{GEN_SEP}{gen}'" if staged and gen else ""
        )
        return self.partition_dir(table_name, round_)

    def drop_generations(self, round_: int, keep: str) -> None:
        """Remove the follower tables' parts of the round of other generations than `keep` (no reader sees them)."""
        delta_generations.drop_generations(self, round_, keep)

    def delete_parts(self, table_name: str, round_: int, prefix: str = "") -> int:
        names = [n for n in self.part_names(table_name, round_) if n.startswith(prefix)]
        return self.delete_part_names(table_name, round_, names)

    def delete_part_names(self, table_name: str, round_: int, names: list[str]) -> int:
        present = set(self.part_names(table_name, round_))
        gen = self._stored(table_name, round_)
        names = [tag_generation(safe_part_name(n), gen) for n in names if safe_part_name(n) in present]
        if not names:
            return 0
        quoted = ", ".join("'" + n.replace("'", "''") + "'" for n in names)
        t = self._table(table_name)
        if t is not None:
            self.check_writable(table_name)
            with rust_panics_quiet():
                t.delete(f"round = {int(round_)} AND {PART} IN ({quoted})")
            self.last_versions[table_name] = t.version()
        if {n for r, n in self._raw_empty(table_name) if r == int(round_)} & set(names):
            self._set_empty(table_name, round_, [], f" AND part IN ({quoted})")
        return len(names)

    def cleanup(self) -> None:
        """Uncommitted files of killed writers are invisible to readers; `vacuum` removes them (and old
        versions) when the user asks: nothing to do per run."""
        if not self.remote and self.root.exists():
            super().cleanup()


BACKENDS["delta"] = DeltaLake
