"""The RL frameworks' rollout dumps as the frameworks themselves wrote them: tests/fixtures/<framework>/, each
made by the framework's own writer code (`gen.py` beside it, the version in `VERSION`). Every writer copies a
framework's dump into `root` (tests then corrupt the copy, never the fixture) and returns its path.

- rLLM: `EpisodeLogger.log_episodes_batch` -> episodes/train_step_7_epoch_0/ (6 episode files: 3 tasks x 2
  rollouts, task 2 with a second agent role; 8 trajectories; batch_summary.json);
- AReaL: `WorkflowExecutor._dump_trajectory` -> rollout/<version>/<task_id>.jsonl (3 tasks x 4 samples);
- ROLL: `dump_rollout_trajectories` -> rollout_dump_data.step_5.jsonl (one column-oriented line, 6 rows);
- verl: `_log_rollout_data` -> rollout/3.jsonl; `DataProto.save_to_disk` -> batch.dataproto.pkl;
  `np.savez(**batch.batch, **batch.non_tensor_batch)` -> batch.npz (3 prompts x n=2);
- TRL: `GRPOTrainer.log` -> completions/completions_000{10,20}.parquet (2 x 8 rows).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _copy(src: Path, root: Path) -> Path:
    dst = root / src.name
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True)
    else:
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    return dst


def write_rllm(root: Path) -> Path:
    """rLLM's EpisodeLogger folder (`episodes/`)."""
    return _copy(FIXTURES / "rllm" / "episodes", root)


def write_areal(root: Path) -> Path:
    """AReaL's `rollout/` folder."""
    return _copy(FIXTURES / "areal" / "rollout", root)


def write_roll(root: Path) -> Path:
    """ROLL's step dump file."""
    return _copy(FIXTURES / "roll" / "rollout_dump_data.step_5.jsonl", root)


def write_trl(root: Path) -> Path:
    """TRL's `completions/` folder."""
    return _copy(FIXTURES / "trl" / "completions", root)


def write_verl_rollout(root: Path) -> Path:
    """verl's `rollout_data_dir` (`rollout/3.jsonl`)."""
    return _copy(FIXTURES / "verl" / "rollout", root)


def write_verl(root: Path) -> tuple[Path, Path, dict]:
    """verl's batch as `np.savez` wrote it and as `DataProto.save_to_disk` pickled it, and its arrays."""
    return (
        _copy(FIXTURES / "verl" / "batch.npz", root),
        _copy(FIXTURES / "verl" / "batch.dataproto.pkl", root),
        verl_arrays(n_groups=3, samples=2),
    )


def verl_arrays(n_groups: int = 3, samples: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """The first `n_groups * samples` rows of verl's batch (3 uids x 2 samples), as `np.savez` stored them."""
    from warehouse.interop_sources import read_npz

    arrays = read_npz(FIXTURES / "verl" / "batch.npz")
    rows = min(n_groups * samples, len(arrays["uid"]))
    return {k: v[:rows].copy() for k, v in arrays.items()}
