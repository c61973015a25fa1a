"""`schemas.strictly_increasing` (the sorted fast path of the unique-key check and of the credit batch's
order check) against a plain Python reading of the same rows, and the unique check it shortcuts."""

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.credit.batch import CreditBatch
from schemas import TABLES, SchemaError, strictly_increasing
from schemas._base import check_unique

# short ids from a small alphabet (repeats likely), with multi-byte characters: compared by their UTF-8 bytes
ids = st.text(alphabet="ab\u00e9\u4e2dZ", max_size=3)
rows = st.lists(st.tuples(ids, st.integers(-3, 3)), max_size=12)


def _reference(pairs: list[tuple]) -> bool:
    if len(pairs) < 2:
        return True
    if any(v is None for pair in pairs for v in pair):
        return False  # a null key: the general path decides
    keys = [(a.encode(), b) for a, b in pairs]
    return all(x < y for x, y in zip(keys, keys[1:], strict=False))


@settings(max_examples=300, deadline=None)
@given(rows, st.booleans(), st.none() | st.tuples(st.integers(0, 11), st.integers(0, 1)))
def test_strictly_increasing_matches_python_order(pairs, sort_them, null_at):
    if sort_them:  # sorted inputs are the common case: make them likely
        pairs = sorted(pairs, key=lambda p: (p[0].encode(), p[1]))
    if null_at is not None and pairs:  # one key null (row, key)
        row, key = null_at[0] % len(pairs), null_at[1]
        pairs[row] = tuple(None if k == key else v for k, v in enumerate(pairs[row]))
    table = pa.table(
        {"k": pa.array([a for a, _ in pairs], pa.string()), "i": pa.array([b for _, b in pairs], pa.int32())}
    )
    assert strictly_increasing(table, ("k", "i")) == _reference(pairs)
    for cut in range(len(pairs) + 1):  # the same rows in two chunks, cut anywhere
        chunked = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
        assert strictly_increasing(chunked, ("k", "i")) == _reference(pairs)


def test_strictly_increasing_by_hand():
    t = pa.table({"k": ["a", "a", "b"], "i": [1, 2, 0]})
    assert strictly_increasing(t, ("k", "i"))
    assert not strictly_increasing(t, ("i",))  # 1, 2, 0
    assert not strictly_increasing(pa.table({"k": ["a", "a"], "i": [1, 1]}), ("k", "i"))  # a repeat
    assert strictly_increasing(pa.table({"k": ["b", "a"], "i": [0, 1]}), ("i",))
    assert not strictly_increasing(pa.table({"x": [1.0, float("nan")]}), ("x",))  # NaN: not ordered
    # a type without an ordering kernel: the general path
    assert not strictly_increasing(pa.table({"l": pa.array([[1], [2]])}), ("l",))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(ids, st.integers(0, 3)), min_size=1, max_size=12), st.booleans())
def test_unique_check_finds_every_duplicate_sorted_or_not(pairs, sort_them):
    if sort_them:
        pairs = sorted(pairs, key=lambda p: (p[0].encode(), p[1]))
    steps = pa.table(
        {
            "traj_id": pa.array([a for a, _ in pairs], pa.string()),
            "step_idx": pa.array([b for _, b in pairs], pa.int32()),
        }
    )
    err = check_unique("steps", "traj_id", "step_idx")(steps)
    assert (err is not None) == (len(set(pairs)) < len(pairs))
    if err is not None:  # the first repeat of an earlier key, named
        first = next(i for i, p in enumerate(pairs) if p in pairs[:i])
        assert (err.row, err.field) == (first, "step_idx")


def test_credit_batch_sorts_unsorted_steps_and_trajectories():
    traj = pa.table(
        {
            "round": pa.array([0, 0], pa.int32()),
            "traj_id": ["t2", "t1"],
            "group_id": ["g", "g"],
            "sample_idx": [1, 0],
            "reward": [1.0, 0.0],
        }
    )
    steps = pa.table(
        {
            "traj_id": ["t2", "t1", "t1"],
            "step_idx": pa.array([0, 1, 0], pa.int32()),
            "role": ["assistant", "assistant", "user"],
            "token_ids": pa.array([[1, 2], [3], [4, 5, 6]], pa.list_(pa.int32())),
        }
    )
    batch = CreditBatch.from_arrow(traj, steps)
    assert batch.trajectories["traj_id"].to_list() == ["t1", "t2"]
    assert batch.steps.select("traj_id", "step_idx", "traj_index", "n_tokens").rows() == [
        ("t1", 0, 0, 3),
        ("t1", 1, 0, 1),
        ("t2", 0, 1, 2),
    ]
    # ids typed as other string types (an in-memory table's: polars gives large strings or string views)
    for typ in (pa.large_string(), pa.string_view()):
        typed = traj.set_column(1, "traj_id", traj.column("traj_id").cast(typ))
        for s in (steps, steps.set_column(0, "traj_id", steps.column("traj_id").cast(typ))):  # mixed, same
            other = CreditBatch.from_arrow(typed, s)
            assert other.steps.select("traj_id", "step_idx", "traj_index").rows() == [
                ("t1", 0, 0),
                ("t1", 1, 0),
                ("t2", 0, 1),
            ]
    with pytest.raises(ValueError, match="traj_id 't3' has no row in trajectories"):
        CreditBatch.from_arrow(traj, steps.set_column(0, "traj_id", pa.array(["t1", "t1", "t3"])))


def test_advantages_validation_names_a_duplicate():
    adv = TABLES["advantages"]
    base = {
        "round": pa.array([0, 0], pa.int32()),
        "method": ["grpo", "grpo"],
        "traj_id": ["t1", "t1"],
        "group_id": ["g", "g"],
        "step_idx": pa.array([0, 0], pa.int32()),
        "role": ["assistant", "assistant"],
        "token_adv": pa.array([[1.0], [2.0]], pa.list_(pa.float32())),
    }
    with pytest.raises(SchemaError, match="duplicate key"):
        adv.validate(pa.table(base))
    adv.validate(pa.table(base | {"step_idx": pa.array([0, 1], pa.int32())}))
