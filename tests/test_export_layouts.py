"""Export layouts (verl, OpenRLHF, SkyRL): read each back and check, token by token, that every advantage,
logprob and mask lands on the token it belongs to."""

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layouts import to_padded
from warehouse.exports import save_padded


def _batch(rows_spec, with_returns=False):
    """rows_spec: per trajectory, a list of (role_is_assistant, n_tokens, turn) segments."""
    rows = []
    tok = 1000
    for i, segs in enumerate(rows_spec):
        ids, mask, lp, adv, turns = [], [], [], [], []
        for is_asst, n, turn in segs:
            for _ in range(n):
                tok += 1
                ids.append(tok)  # unique ids: a token's identity tells where it came from
                mask.append(1 if is_asst else 0)
                lp.append(-(tok % 97) / 10.0 if is_asst else 0.0)
                adv.append((tok % 13 - 6) / 3.0 if is_asst else 0.0)
                turns.append(turn if is_asst else 0)
        rows.append(
            dict(
                round=0,
                method="m",
                traj_id=f"t{i}",
                group_id=f"g{i // 2}",
                reward=float(i % 3) - 0.5,
                input_ids=ids,
                loss_mask=mask,
                old_logprobs=lp,
                advantages=adv,
                values=[0.5 * a for a in adv] if with_returns else None,
                returns=[a + 1 for a in adv] if with_returns else None,
                turn_ids=turns,
            )
        )
    schema = pa.schema(
        [
            ("round", pa.int32()),
            ("method", pa.string()),
            ("traj_id", pa.string()),
            ("group_id", pa.string()),
            ("reward", pa.float64()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("old_logprobs", pa.list_(pa.float32())),
            ("advantages", pa.list_(pa.float32())),
            ("values", pa.list_(pa.float32())),
            ("returns", pa.list_(pa.float32())),
            ("turn_ids", pa.list_(pa.int16())),
        ]
    )
    return pa.Table.from_pylist(rows, schema=schema), rows


segments = st.lists(st.tuples(st.booleans(), st.integers(0, 6)), min_size=1, max_size=6)


def _with_turns(segs):
    out, turn = [], 0
    for is_asst, n in segs:
        if is_asst:
            turn += 1
        out.append((is_asst, n, turn))
    return out


def _prompt_len(mask):
    return next((j for j, m in enumerate(mask) if m == 1), len(mask))


def _check_response_side(rows, resp_ids, resp_adv, resp_lp, resp_mask, resp_offset_of):
    for r, row in enumerate(rows):
        p = _prompt_len(row["loss_mask"])
        for j in range(p, len(row["input_ids"])):
            col = resp_offset_of(r, j - p)
            assert resp_ids[r, col] == row["input_ids"][j]
            assert resp_mask[r, col] == row["loss_mask"][j]
            assert np.float32(resp_adv[r, col]) == np.float32(row["advantages"][j])
            assert np.float32(resp_lp[r, col]) == np.float32(row["old_logprobs"][j])


@settings(max_examples=60, deadline=None)
@given(st.lists(segments, min_size=1, max_size=5))
def test_verl_layout_alignment(spec):
    table, rows = _batch([_with_turns(s) for s in spec])
    a = to_padded(table, "verl")
    n, P = a["prompts"].shape
    R = a["responses"].shape[1]
    assert a["input_ids"].shape == (n, P + R) and a["input_ids"].flags["C_CONTIGUOUS"]
    for r, row in enumerate(rows):
        p = _prompt_len(row["loss_mask"])
        # left-padded prompt
        assert list(a["prompts"][r, P - p :]) == row["input_ids"][:p]
        assert a["attention_mask"][r, : P - p].sum() == 0
        assert a["attention_mask"][r].sum() == len(row["input_ids"])
        # position ids count real tokens from 0
        real = np.flatnonzero(a["attention_mask"][r])
        assert list(a["position_ids"][r, real]) == list(range(len(real)))
    _check_response_side(
        rows, a["responses"], a["advantages"], a["old_log_probs"], a["response_mask"], lambda r, j: j
    )
    assert list(a["uid"]) == [row["group_id"] for row in rows]
    for r, row in enumerate(rows):  # the reward on the last trained token (the GAE estimator's placement)
        p = _prompt_len(row["loss_mask"])
        if len(row["input_ids"]) > p:
            assert a["token_level_scores"][r, _reward_token(row) - p] == np.float32(row["reward"])
    # every advantage of the batch is somewhere, and nowhere else
    assert np.isclose(
        a["advantages"].sum(), sum(sum(np.float32(x) for x in row["advantages"]) for row in rows), atol=1e-3
    )


def _reward_token(row):
    """The shared placement: the last trained token, else the last token."""
    mask = row["loss_mask"]
    trained = [j for j, m in enumerate(mask) if m]
    return trained[-1] if trained else len(mask) - 1


@settings(max_examples=60, deadline=None)
@given(st.lists(segments, min_size=1, max_size=5), st.integers(0, 8))
def test_verl_layout_pads_and_cuts_to_the_runs_response_length(spec, extra):
    table, rows = _batch([_with_turns(s) for s in spec])
    full = to_padded(table, "verl")
    R0 = full["responses"].shape[1]
    for R in (R0 + extra, max(R0 - extra, 1)):
        a = to_padded(table, "verl", response_length=R, prompt_length=full["prompts"].shape[1] + extra)
        assert a["responses"].shape == (len(rows), R)
        assert a["prompts"].shape[1] == full["prompts"].shape[1] + extra
        k = min(R, R0)
        for key in ("responses", "response_mask", "advantages", "old_log_probs"):
            assert np.array_equal(a[key][:, :k], full[key][:, :k]) and not a[key][:, k:].any()
        assert list(a["key"]) == list(full["key"])  # the key names the sample, whatever the padding
        for r, row in enumerate(rows):
            p = _prompt_len(row["loss_mask"])
            kept = min(len(row["input_ids"]) - p, R)
            assert a["attention_mask"][r].sum() == p + kept
            # the reward on the last trained token that survived the cut, else the last kept token
            trained = np.flatnonzero(a["response_mask"][r])
            col = trained[-1] if len(trained) else max(kept - 1, 0)
            if p + kept:
                assert a["token_level_scores"][r, col] == np.float32(row["reward"])
            assert np.count_nonzero(a["token_level_scores"][r]) == (row["reward"] != 0 and p + kept > 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(segments, min_size=1, max_size=5))
def test_openrlhf_layout_alignment(spec):
    """OpenRLHF 0.11: whole sequences right-padded; (B, T-1) arrays shifted by one token."""
    table, rows = _batch([_with_turns(s) for s in spec])
    a = to_padded(table, "openrlhf")
    n, T = a["sequences"].shape
    assert (
        a["action_mask"].shape == a["advantages"].shape == a["rollout_log_probs"].shape == (n, max(T - 1, 0))
    )
    for r, row in enumerate(rows):
        L = len(row["input_ids"])
        assert a["sequences"][r, :L].tolist() == row["input_ids"] and a["attention_mask"][r].sum() == L
        assert a["attention_mask"][r, :L].all()
        for j in range(1, L):  # column j - 1 holds token j
            assert a["action_mask"][r, j - 1] == row["loss_mask"][j]
            assert np.float32(a["advantages"][r, j - 1]) == np.float32(row["advantages"][j])
            assert np.float32(a["rollout_log_probs"][r, j - 1]) == np.float32(row["old_logprobs"][j])
        assert not a["action_mask"][r, max(L - 1, 0) :].any()
        turns = row["turn_ids"]
        for k in sorted({t for t in turns if t}):
            cols = [j for j, t in enumerate(turns) if t == k]
            assert tuple(a["action_ranges"][r, k - 1]) == (cols[0], cols[-1] + 1)
    assert a["rewards"].shape == (n,) and a["total_length"].tolist() == [len(r["input_ids"]) for r in rows]


@settings(max_examples=40, deadline=None)
@given(st.lists(segments, min_size=1, max_size=5))
def test_skyrl_layout_alignment(spec):
    """SkyRL 0.3: whole sequences left-padded; response tensors right-aligned; loss_mask float32."""
    table, rows = _batch([_with_turns(s) for s in spec], with_returns=True)
    a = to_padded(table, "skyrl")
    n, T = a["sequences"].shape
    R = a["loss_mask"].shape[1]
    assert a["loss_mask"].dtype == np.float32 and a["response_mask"].dtype == np.int64
    for r, row in enumerate(rows):
        L = len(row["input_ids"])
        p = _prompt_len(row["loss_mask"])
        assert a["sequences"][r, T - L :].tolist() == row["input_ids"] and a["attention_mask"][r].sum() == L
        n_resp = L - p
        assert a["response_mask"][r].sum() == n_resp and a["response_mask"][r, R - n_resp :].all()
        for j in range(p, L):
            col = R - n_resp + (j - p)
            assert a["loss_mask"][r, col] == row["loss_mask"][j]
            assert np.float32(a["advantages"][r, col]) == np.float32(row["advantages"][j])
            assert np.float32(a["rollout_logprobs"][r, col]) == np.float32(row["old_logprobs"][j])
            assert np.float32(a["returns"][r, col]) == np.float32(row["returns"][j])
        if n_resp:
            col = R - n_resp + (_reward_token(row) - p)
            assert (
                a["rewards"][r, col] == np.float32(row["reward"]) and a["rewards"][r].sum() == row["reward"]
            )


def test_saved_npz_loads_without_copy(tmp_path):
    torch = __import__("pytest").importorskip("torch")
    table, rows = _batch(
        [[(False, 3, 0), (True, 4, 1), (False, 2, 0), (True, 3, 2)], [(False, 1, 0), (True, 2, 1)]]
    )
    save_padded(to_padded(table, "verl"), tmp_path / "b.npz")
    data = np.load(tmp_path / "b.npz")
    adv = data["advantages"]
    t = torch.from_numpy(adv)
    assert t.data_ptr() == adv.__array_interface__["data"][0]  # shares memory: no copy
    assert data["uid"].dtype.kind == "U"


def test_verl_credit_finds_rows_cut_to_the_runs_response_length():
    """An export cut to a shorter `--response-length` (verl's rollout cuts the same way) is found by
    trainer.verl_credit: a live batch holds the cut tokens, so the lookup keys them as laid out, and each row
    gets its exported (cut) advantages."""
    from trainer.verl_credit import CreditflowAdvantages

    spec = [[(False, 3, 0), (True, 5, 1), (False, 2, 0), (True, 4, 2)], [(False, 2, 0), (True, 3, 1)]]
    table, _ = _batch(spec)
    R0 = to_padded(table, "verl")["responses"].shape[1]
    for R in (R0 + 2, R0, R0 - 4, 1):
        a = to_padded(table, "verl", response_length=R)
        order = np.array([1, 0])  # a shuffled live batch
        adv, found = CreditflowAdvantages(a).lookup(
            a["prompts"][order], a["responses"][order], a["attention_mask"][order]
        )
        assert found.all(), R
        assert np.array_equal(adv, a["advantages"][order])


def test_verl_credit_says_when_rows_keep_verls_advantages(caplog):
    """missing="keep": a batch row the export lacks keeps verl's advantages, and the run's log says how many."""
    import logging
    from types import SimpleNamespace

    import torch

    from trainer.verl_credit import CreditflowAdvantages

    table, _ = _batch([[(False, 2, 0), (True, 3, 1)], [(False, 2, 0), (True, 4, 1)]])
    a = to_padded(table, "verl")
    other = a["responses"].copy()
    other[1, 0] += 1  # not a sample of the export
    verl_adv = torch.full(other.shape, 7.0)
    batch = SimpleNamespace(
        batch={
            "prompts": torch.from_numpy(a["prompts"]),
            "responses": torch.from_numpy(other),
            "attention_mask": torch.from_numpy(a["attention_mask"]),
            "advantages": verl_adv.clone(),
        }
    )
    with caplog.at_level(logging.WARNING, logger="trainer.verl_credit"):
        assert CreditflowAdvantages(a).apply(batch) == 1
    assert torch.equal(batch.batch["advantages"][1], verl_adv[1])
    assert np.array_equal(batch.batch["advantages"][0].numpy(), a["advantages"][0])
    assert "1 of 2 samples are not in the creditflow export" in caplog.text


def test_export_index_refuses_what_is_not_an_export_in_one_line():
    """Hostile or foreign .npz arrays given as an export: a ValueError of one line, never an IndexError."""
    import pytest

    from trainer.export_lookup import ExportIndex

    table, _ = _batch([[(False, 2, 0), (True, 3, 1)], [(False, 2, 0), (True, 4, 1)]])
    for layout in ("verl", "openrlhf", "skyrl"):
        a = to_padded(table, layout)
        assert ExportIndex(a).layout == layout
        cases = [
            {k: v for k, v in a.items() if k != "attention_mask"},
            {**a, "advantages": a["advantages"][:1]},
            {**a, "attention_mask": a["attention_mask"][:, :-1]},
            {"key": a["key"]},
        ]
        for bad in cases:
            with pytest.raises(ValueError, match="^not a creditflow") as err:
                ExportIndex(bad)
            assert "\n" not in str(err.value)
