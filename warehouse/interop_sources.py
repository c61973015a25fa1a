"""Reading the RL frameworks' binary dumps for ingest: TRL's `completions_*.parquet`, verl batches saved as
Parquet or NumPy `.npz`, and verl's pickled `DataProto` (`DataProto.save_to_disk`, what `RolloutSkip` dumps).
Each file becomes `(file name, columns)`, where columns is a `pyarrow.Table` (Parquet) or a dict of NumPy arrays
(`.npz`, a `DataProto`). The adapters never open a file.

`.npz` object arrays (verl's `uid`, `reward_model`, ... from `np.savez(**batch.batch, **batch.non_tensor_batch)`)
are stored pickled inside the archive; they are read with an unpickler that can only rebuild NumPy arrays,
dtypes and scalars of plain Python values (str, int, float, list, dict, ...), never call anything else, so no
`--allow-pickle` is needed for them. A whole pickle (`DataProto`) can name any function to call while it
loads: it is read only when the caller passes `allow_pickle=True` (`creditflow ingest --allow-pickle`), else
`PickleRefused` says so.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.ingest.core import Unreadable
from warehouse.sources import source_files, unreadable

PICKLE_SUFFIXES = (".pkl", ".pickle", ".pt")


class PickleRefused(ValueError):
    """A pickle given without `allow_pickle`: one line for the user."""


class MissingPackage(RuntimeError):
    """A dump that needs a package this environment lacks (a pickled DataProto needs torch and tensordict):
    one line for the user naming what to install."""


# what provides a module a pickled DataProto loads (torch: creditflow's [torch] extra)
INSTALL_HINT = {"torch": "pip install 'creditflow[torch]'", "tensordict": "pip install tensordict"}


class _ArrayUnpickler(pickle.Unpickler):
    """Rebuilds NumPy arrays of plain Python objects and nothing else."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or (module == "numpy" and name.startswith("dtypes")):
            return super().find_class(module, name)
        if module == "numpy.dtypes" or module == "builtins" and name in ("complex", "set", "frozenset"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a NumPy array part: refused")


def _npy_member(f) -> np.ndarray:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    if not dtype.hasobject:
        count = int(np.prod(shape)) if shape else 1
        data = np.frombuffer(f.read(count * dtype.itemsize), dtype=dtype, count=count)
        return data.reshape(shape, order="F" if fortran else "C")
    arr = _ArrayUnpickler(f).load()
    if not isinstance(arr, np.ndarray) or arr.shape != tuple(shape):
        raise ValueError(f"object array does not have the shape {tuple(shape)} its header says")
    return arr


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of an `.npz`, object arrays included (safe unpickler, see the module doc)."""
    out = {}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            if not name.endswith(".npy"):
                continue
            with zf.open(name) as f:
                out[name.removesuffix(".npy")] = _npy_member(io.BufferedReader(f))
    return out


def _is_pickle(path: Path) -> bool:
    if path.suffix in PICKLE_SUFFIXES:
        return True
    if path.suffix in (".npz", ".parquet", ".json", ".jsonl"):
        return False
    with path.open("rb") as f:
        return f.read(1) == b"\x80"  # pickle protocol 2+


class _DataProtoStandIn:
    """What a pickled `verl.protocol.DataProto` loads into when verl is not installed: its state is
    (torch.save bytes of the TensorDict batch, non_tensor_batch, meta_info)."""

    def __setstate__(self, state):
        import torch  # the batch is a torch.save'd TensorDict (needs tensordict installed)

        raw, self.non_tensor_batch, self.meta_info = state
        self.batch = (
            None if raw is None else torch.load(io.BytesIO(raw), weights_only=False, map_location="cpu")
        )


class _DataProtoUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "verl.protocol" and name in ("DataProto", "DataProtoItem"):
            try:
                return super().find_class(module, name)
            except ImportError:
                return _DataProtoStandIn
        return super().find_class(module, name)


def read_dataproto(path: Path) -> dict[str, np.ndarray]:
    """A pickled verl `DataProto`: its batch tensors and non-tensor arrays as one dict of NumPy arrays."""
    with path.open("rb") as f:
        obj = _DataProtoUnpickler(f).load()
    batch = getattr(obj, "batch", None)
    non_tensor = getattr(obj, "non_tensor_batch", None)
    if batch is None and non_tensor is None:
        raise ValueError(f"the pickle holds a {type(obj).__name__}, not a verl DataProto")
    out = {k: v.detach().cpu().numpy() for k, v in (batch.items() if batch is not None else ())}
    out.update({k: np.asarray(v) for k, v in (non_tensor or {}).items()})
    return out


def read_raw_source(path: Path, allow_pickle: bool = False) -> pa.Table | dict[str, np.ndarray] | Unreadable:
    """The file's columns, or `Unreadable` (a corrupt file, an array the safe unpickler refuses, ...).
    Raises `PickleRefused` for a pickle without `allow_pickle`, `MissingPackage` where loading it needs a
    package this environment lacks."""
    if _is_pickle(path) and not allow_pickle:
        raise PickleRefused(
            f"{path} is a pickle (verl DataProto.save_to_disk): loading a pickle can run any code it names; "
            "pass --allow-pickle only for a file you trust"
        )
    try:
        if path.suffix == ".npz":
            return read_npz(path)
        if path.suffix == ".parquet":
            return pq.read_table(path)
        return read_dataproto(path)
    except ModuleNotFoundError as exc:  # the dump is fine, this environment lacks what loads it
        name = (exc.name or "").split(".")[0]
        hint = INSTALL_HINT.get(name, f"pip install {name}")
        raise MissingPackage(
            f"{path}: a pickled verl DataProto needs the package {name!r} to load ({hint})"
        ) from None
    except Exception as exc:  # noqa: BLE001 -- zipfile, pickle, Arrow and OS errors alike: this file only
        return unreadable(path, exc)


def read_raw_sources(
    paths: Iterable[str | Path], extensions: Iterable[str], allow_pickle: bool = False
) -> list[tuple[str, object]]:
    """(file name, Arrow table or dict of arrays) of every source file with one of `extensions` (a file named
    directly is read whatever its suffix: a DataProto dump often has none)."""
    return [(str(p), read_raw_source(p, allow_pickle)) for p in source_files(paths, extensions)]
