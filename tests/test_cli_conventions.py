"""CLI conventions (#26): `--version`; a user's mistake is one line on stderr and a non-zero exit (the
traceback with --debug); no command creates a lake it was not asked to create; CSV of nested columns."""

import csv
import io
import json
import os

import pyarrow as pa
import pytest

from flows.cli import app
from pipeline.config import ConfigError


def _run(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        app([str(a) for a in args])
    code = exc.value.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # SystemExit("message"): the interpreter prints it on stderr and exits 1
        return 1, out, err + code + "\n"
    return (0 if code is None else code), out, err


def _one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_version(capsys):
    from importlib.metadata import version

    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"creditflow {version('creditflow')}"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--set", "grpo.nonsense=1"], "nonsense"),
        (["--set", "grpo.eps=not-a-number"], "eps"),
        (["--set", "no_equals_sign"], "key=value"),
        (["--methods", "grpo,nosuch"], "nosuch"),
        (["--methods", "grpo+nosuchrefiner"], "nosuchrefiner"),
    ],
)
def test_bad_setting_or_method_is_one_line(capsys, tmp_path, args, needle):
    code, _, err = _run(capsys, "process", "--lake", tmp_path / "lake", "--round", 0, *args)
    assert code != 0
    line = _one_line(err)
    assert needle in line and line.startswith("error:")
    assert not (tmp_path / "lake").exists()


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(ConfigError, match="nosuch"):
        app(["--debug", "process", "--lake", str(tmp_path / "lake"), "--round", "0", "--methods", "nosuch"])


@pytest.mark.parametrize(
    "command",
    [
        ["query", "select 1"],
        ["report", "--out", "r.html"],
        ["stats", "--round", "0"],
        ["export", "--round", "0", "--method", "grpo", "--out", "b.parquet"],
    ],
)
def test_unknown_lake_is_one_line_and_not_created(capsys, tmp_path, command, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "mistyped"
    code, _, err = _run(capsys, *command[:1], "--lake", missing, *command[1:])
    assert code != 0
    assert str(missing) in _one_line(err) or "mistyped" in err
    assert not missing.exists()
    assert not (tmp_path / "r.html").exists()


def test_query_csv_of_nested_columns(capsys, lake):
    schema_rows = [{"traj_id": "t0", "group_id": "g0", "sample_idx": 0, "reward": 1.0, "source": "x"}]
    from warehouse.rounds import write_round

    steps = pa.Table.from_pylist(
        [
            dict(
                traj_id="t0",
                step_idx=0,
                role="assistant",
                turn=1,
                content="a b",
                is_error=False,
                token_ids=[1, 2],
                token_offsets=[0, 2],
                logprobs=[-0.1, -0.2],
            )
        ]
    )
    write_round(lake, 0, pa.Table.from_pylist(schema_rows), steps)
    code, out, err = _run(
        capsys,
        "query",
        "--lake",
        lake.root,
        "--format",
        "csv",
        "select traj_id, token_ids, {'a': 1, 'b': [2, 3]} AS s from steps",
    )
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert rows == [{"traj_id": "t0", "token_ids": "[1, 2]", "s": json.dumps({"a": 1, "b": [2, 3]})}]
    assert "token_ids, s" in _one_line(err)


def _small_lake(lake):
    from warehouse.rounds import write_round

    traj = pa.Table.from_pylist(
        [{"traj_id": "t0", "group_id": "g0", "sample_idx": 0, "reward": 1.0, "source": "x"}]
    )
    steps = pa.Table.from_pylist(
        [
            dict(
                traj_id="t0",
                step_idx=0,
                role="assistant",
                turn=1,
                content="a",
                is_error=False,
                token_ids=[1],
                token_offsets=[0],
            )
        ]
    )
    write_round(lake, 0, traj, steps)


def test_report_of_a_round_the_lake_lacks_is_one_line(capsys, lake, tmp_path):
    _small_lake(lake)
    code, _, err = _run(capsys, "report", "--lake", lake.root, "--round", 9, "--out", tmp_path / "r.html")
    assert code != 0 and "round 9" in _one_line(err) and "rounds there: 0" in err
    assert not (tmp_path / "r.html").exists()


@pytest.mark.parametrize("layout, name", [("verl", "b.parquet"), ("flat", "b.npz")])
def test_export_file_name_must_match_the_layout(capsys, lake, tmp_path, layout, name):
    _small_lake(lake)
    args = ["export", "--lake", lake.root, "--round", 0, "--method", "grpo", "--out", tmp_path / name]
    code, _, err = _run(capsys, *args, "--layout", layout)
    assert code != 0 and ".npz" in _one_line(err)
    assert not (tmp_path / name).exists()


def test_a_missing_tokenizer_is_named(capsys, tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"messages": [{"role": "user", "content": "hi"}], "reward": 1}\n')
    missing = tmp_path / "nope" / "tokenizer.json"
    code, _, err = _run(
        capsys,
        "ingest",
        src,
        "--format",
        "chat-jsonl",
        "--lake",
        tmp_path / "lake",
        "--round",
        0,
        "--tokenizer",
        missing,
    )
    assert code != 0 and str(missing) in _one_line(err)


def test_a_console_level_the_cli_set_for_one_command_does_not_stick(monkeypatch):
    """setup_logging puts the command's --log-level into PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL for Prefect; a
    second command in the same process (a test worker, a library caller) gets its own level, and a subprocess
    started after it inherits that, not the first command's. A level the user set stays theirs."""
    import logging

    import flows.cli as cli

    monkeypatch.delenv(cli.CONSOLE_LEVEL_ENV, raising=False)
    monkeypatch.setattr(cli, "_CONSOLE_LEVEL_SET", {})
    for name in cli.PACKAGES:  # setup_logging adds a handler and sets levels: restore them after the test
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", list(logger.handlers))
        monkeypatch.setattr(logger, "level", logger.level)
        monkeypatch.setattr(logger, "propagate", logger.propagate)
    cli.setup_logging("warning")
    assert os.environ[cli.CONSOLE_LEVEL_ENV] == "WARNING"
    cli.setup_logging("info")
    assert os.environ[cli.CONSOLE_LEVEL_ENV] == "INFO"
    monkeypatch.setenv(cli.CONSOLE_LEVEL_ENV, "ERROR")  # the user's own
    cli.setup_logging("debug")
    assert os.environ[cli.CONSOLE_LEVEL_ENV] == "ERROR"
