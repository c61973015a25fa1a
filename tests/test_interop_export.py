"""End to end through the CLI: a lake -> `creditflow process` -> `creditflow export --layout verl|openrlhf|skyrl`
-> np.load, each advantage / logprob / mask checked token by token against the advantages table; and a verl
export read back with `creditflow ingest -f verl-batch`, processed again: the advantages land on the same tokens."""

import numpy as np
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from flows.cli import app
from warehouse.lake import Lake

runner = CliRunner()


def _ok(args):
    out = runner.invoke(app, [str(a) for a in args])
    assert out.exit_code == 0, out.output
    return out


def _per_traj(lake, round_, method="grpo"):
    """traj_id -> (token ids, loss mask, advantages, logprobs) from the steps and advantages tables."""
    store = Lake(lake)
    steps = store.read("steps", round_).sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    adv = store.read("advantages", round_)
    adv = adv.filter(pc.equal(adv.column("method"), method)).sort_by(
        [("traj_id", "ascending"), ("step_idx", "ascending")]
    )
    out = {}
    for s, a in zip(steps.to_pylist(), adv.to_pylist(), strict=True):
        assert (s["traj_id"], s["step_idx"]) == (a["traj_id"], a["step_idx"])
        ids, mask, av, lp = out.setdefault(s["traj_id"], ([], [], [], []))
        n = len(s["token_ids"])
        ids += s["token_ids"]
        mask += [int(s["role"] == "assistant")] * n
        av += a["token_adv"]
        lp += s["logprobs"] if s["logprobs"] is not None else [0.0] * n
    return out


pytestmark = pytest.mark.slow  # each `creditflow process` starts a temporary Prefect server (~20 s)


@pytest.fixture(scope="module")
def processed(tmp_path_factory):
    """A synth round (seed 1: rewards differ within a group) processed with grpo."""
    lake = tmp_path_factory.mktemp("interop") / "lake"
    _ok(
        [
            "synth",
            "--groups",
            3,
            "--samples",
            4,
            "--turns",
            3,
            "--tokens",
            12,
            "--seed",
            1,
            "--out",
            lake,
            "--round",
            0,
        ]
    )
    _ok(["process", "--lake", lake, "--round", 0, "--methods", "grpo"])
    return lake


def _response_start(mask):
    return next((j for j, m in enumerate(mask) if m == 1), len(mask))


def test_export_layouts_align_with_the_advantages_table(processed, tmp_path):
    lake = processed
    ref = _per_traj(lake, 0)
    assert any(any(a != 0 for a in v[2]) for v in ref.values())
    for layout in ("verl", "openrlhf", "skyrl"):
        out = tmp_path / f"{layout}.npz"
        _ok(["export", "--lake", lake, "--round", 0, "--method", "grpo", "--out", out, "--layout", layout])
        a = np.load(out, allow_pickle=False)
        seq = a["input_ids"] if layout == "verl" else a["sequences"]
        mask_key = {"verl": "response_mask", "openrlhf": "action_mask", "skyrl": "loss_mask"}[layout]
        lp_key = "old_log_probs" if layout == "verl" else "action_log_probs"
        R = a["advantages"].shape[1]
        assert seq.shape[1] - R >= 0 and a[mask_key].shape == a[lp_key].shape == (len(ref), R)
        assert sorted(a["traj_id"].tolist()) == sorted(ref)
        for r, traj_id in enumerate(a["traj_id"].tolist()):
            ids, mask, adv, lp = ref[traj_id]
            p = _response_start(mask)
            n_resp = len(ids) - p
            real = np.flatnonzero(a["attention_mask"][r])
            assert seq[r, real].tolist() == ids  # every real token, in order
            P = seq.shape[1] - R
            assert real[0] == P - p and (p == 0 or real[p - 1] == P - 1)  # left-padded prompt, response at P
            assert a[mask_key][r, :n_resp].tolist() == mask[p:] and a[mask_key][r, n_resp:].sum() == 0
            assert np.array_equal(a["advantages"][r, :n_resp], np.float32(adv[p:]))
            assert np.array_equal(a[lp_key][r, :n_resp], np.float32(lp[p:]))
        if layout == "verl":
            assert np.array_equal(a["input_ids"], np.concatenate([a["prompts"], a["responses"]], axis=1))
            real = a["attention_mask"] == 1
            assert (a["position_ids"][real] == (np.cumsum(a["attention_mask"], 1) - 1)[real]).all()
        if layout == "skyrl":
            assert (a["loss_mask"] <= a["response_mask"]).all()


def test_verl_export_round_trips_through_ingest(processed, tmp_path):
    lake = processed
    ref = _per_traj(lake, 0)
    out = tmp_path / "verl.npz"
    _ok(["export", "--lake", lake, "--round", 0, "--method", "grpo", "--out", out, "--layout", "verl"])
    back = tmp_path / "back"
    _ok(["ingest", out, "-f", "verl-batch", "--lake", back, "--round", 1, "--tokenizer", "bytes", "--strict"])
    _ok(["process", "--lake", back, "--round", 1, "--methods", "grpo"])
    got = _per_traj(back, 1)
    assert sorted(got) == sorted(ref)
    trajs = {t["traj_id"]: t for t in Lake(back).read("trajectories", 1).to_pylist()}
    orig = {t["traj_id"]: t for t in Lake(lake).read("trajectories", 0).to_pylist()}
    for traj_id, (ids, mask, adv, lp) in ref.items():
        g_ids, g_mask, g_adv, g_lp = got[traj_id]
        assert g_ids == ids and g_mask == mask
        assert np.allclose(g_adv, adv, atol=1e-6)  # same advantage on the same token
        assert np.array_equal(np.float32(g_lp), np.float32(lp))
        assert trajs[traj_id]["group_id"] == orig[traj_id]["group_id"]
        assert trajs[traj_id]["reward"] == np.float32(orig[traj_id]["reward"])
