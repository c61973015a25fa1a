"""TRL (1.16) trains on creditflow's export with a learning signal (issue 31.2): where the source has no behaviour
logprobs (tau-bench, chat JSONL, TRL completions) the export says so (`logprobs_known`) and
`trainer.trl_credit.CreditflowGRPOTrainer` takes the policy's own log-probabilities as the old ones, never the
export's 0s. Checked on gradients of a real `GRPOTrainer` step (captured before the optimizer step: Adam rescales
a tiny gradient into a visible weight change, so "the weights moved" proves nothing): negating every advantage
negates the gradient, negative advantages push the sampled tokens' log-probabilities down, and exported logprobs,
where known, are the ratio's denominator."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from credit_rounds import random_round
from hypothesis import given, settings
from hypothesis import strategies as st
from test_interop_export import processed  # noqa: F401  (the fixture: a synth round processed with grpo)

from pipeline.config import Config
from pipeline.credit.process import process_batch
from pipeline.export import TrainLayout
from pipeline.layouts import to_padded

VOCAB = 1024
PAD = VOCAB - 2


def _flat(seed: int, logprobs: bool):
    """A random round processed with grpo, as the flat export table; without `logprobs`, a text source's (no
    step carries behaviour logprobs)."""
    traj, steps = random_round(seed, max_groups=4, max_group_size=4, max_steps=8, max_tokens=6)
    if not logprobs:
        steps = steps.set_column(
            steps.column_names.index("logprobs"), "logprobs", pa.nulls(steps.num_rows, pa.list_(pa.float32()))
        )
    tables, _ = process_batch(traj, steps, ["grpo"], Config())
    return TrainLayout(traj, steps).table(tables["grpo"]), steps


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_the_export_says_which_rows_carry_behaviour_logprobs(seed):
    flat, steps = _flat(seed, logprobs=True)
    asst = steps.filter(pc.equal(steps.column("role"), "assistant"))
    unknown = set(asst.filter(pc.is_null(asst.column("logprobs"))).column("traj_id").to_pylist())
    want = [t not in unknown for t in flat.column("traj_id").to_pylist()]
    assert flat.column("logprobs_known").to_pylist() == want
    for layout in ("verl", "openrlhf", "skyrl"):
        assert to_padded(flat, layout)["logprobs_known"].tolist() == want
    text, _ = _flat(seed, logprobs=False)  # a text source: every row with an assistant step is unknown
    has_asst = set(asst.column("traj_id").to_pylist())
    assert text.column("logprobs_known").to_pylist() == [
        t not in has_asst for t in text.column("traj_id").to_pylist()
    ]


def test_an_export_without_the_flag_counts_0_filled_rows_as_unknown():
    """An export written before `logprobs_known`: rows whose trained tokens all have logprob 0 are unknown."""
    from trainer.trl_credit import logprobs_known

    flat, _ = _flat(3, logprobs=True)
    a = to_padded(flat, "verl")
    old = {k: v for k, v in a.items() if k != "logprobs_known"}
    assert np.array_equal(logprobs_known(old), a["logprobs_known"] & a["response_mask"].any(axis=1))


@pytest.mark.parametrize("bad", [lambda n: np.ones(n + 1, bool), lambda n: np.ones((n, 1), bool), np.ones])
def test_a_malformed_logprobs_known_is_one_line(bad):
    from trainer.trl_credit import logprobs_known

    a = to_padded(_flat(3, logprobs=True)[0], "verl")
    n = len(a["prompts"])
    a["logprobs_known"] = bad(n)
    with pytest.raises(
        ValueError,
        match=rf"^not a creditflow verl export: logprobs_known is \w+\[[\d, ]+\], expected bool\[{n}\]$",
    ):
        logprobs_known(a)


# ---- a real TRL step ----------------------------------------------------------------------------------------


def _need(module):
    try:
        return __import__(module)
    except ImportError as exc:
        pytest.skip(f"FRAMEWORK NOT INSTALLED: {module} ({exc}); run .ci/install-frameworks")


def _tiny_model():
    """A 1-layer Llama built from a config (random weights, no download) and a word-level tokenizer."""
    _need("transformers")
    from test_interop_export import _tiny_causal_lm

    return _tiny_causal_lm(VOCAB)


def _step(export, tmp_path, seed=0):
    """One real GRPOTrainer step from the same initial weights: the gradient before the optimizer step (flat),
    the trainer, and the model."""
    torch = _need("torch")
    trl = _need("trl")
    from transformers import TrainerCallback

    from trainer.trl_credit import CreditflowGRPOTrainer

    torch.manual_seed(seed)
    model, tok = _tiny_model()
    grads = []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kw):
            grads.append(
                torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
            )

    P = export["prompts"].shape[1]
    n = max(int(export["attention_mask"][:, :P].any(axis=1).sum()), 1)  # the rows it trains on
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2 * n,  # every row, twice (num_generations): one step sees them all
        num_generations=2,
        max_steps=1,
        learning_rate=1e-2,
        beta=0.0,
        max_grad_norm=0.0,  # no clipping: the raw gradient
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        bf16=False,
        seed=seed,
    )
    trainer = CreditflowGRPOTrainer(
        model=model, processing_class=tok, args=args, export=export, callbacks=[Grab()]
    )
    trainer.train()
    assert len(grads) == 1
    return grads[0], trainer


def _text_export(seed=17):
    flat, _ = _flat(seed, logprobs=False)
    a = to_padded(flat, "verl", pad_token_id=PAD)
    P = a["prompts"].shape[1]
    # rows with trained tokens and a prompt (a row whose first token is trained is refused, below)
    keep = np.flatnonzero(a["response_mask"].any(axis=1) & a["attention_mask"][:, :P].any(axis=1))
    a = {k: v[keep] for k, v in a.items()}
    assert not a["logprobs_known"].any() and not a["old_log_probs"].any()  # a text source: 0-filled
    assert len(keep) >= 3
    return a


def test_negating_every_advantage_negates_the_gradient(tmp_path):
    a = _text_export()
    adv = a["advantages"]
    assert (adv[a["response_mask"] == 1] < 0).any() and (adv[a["response_mask"] == 1] > 0).any()
    g, _ = _step(a, tmp_path / "a")
    g_neg, _ = _step({**a, "advantages": -adv}, tmp_path / "b")
    norm = float(g.norm())
    assert norm > 1e-2, norm  # on-policy: a real signal (the 0s as old logprobs gave ~8e-6)
    assert np.allclose(g_neg.numpy(), -g.numpy(), rtol=1e-4, atol=1e-6 * norm)


def test_negative_advantages_push_the_sampled_tokens_down(tmp_path):
    torch = _need("torch")
    a = _text_export()
    m = a["response_mask"] == 1
    neg = np.where(m, -np.abs(a["advantages"]) - 0.5, 0).astype(np.float32)
    g, trainer = _step({**a, "advantages": neg}, tmp_path)
    # the gradient of the trained tokens' summed log-probability at the same initial weights
    model = trainer.model
    torch.manual_seed(0)
    init, _ = _tiny_model()
    model.load_state_dict(init.state_dict())
    model.zero_grad()
    out = {
        "prompt_ids": torch.from_numpy(a["prompts"]),
        "completion_ids": torch.from_numpy(a["responses"]),
        "prompt_mask": torch.from_numpy(a["attention_mask"][:, : a["prompts"].shape[1]]),
        "completion_mask": torch.from_numpy(a["attention_mask"][:, a["prompts"].shape[1] :]),
    }
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        model, ids, attn, ids.shape[1] - a["prompts"].shape[1]
    )
    (logps * torch.from_numpy(m)).sum().backward()
    up = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    # a descent step -g changes the summed log-probability by about -g . up: it must go down
    assert float(g @ up) > 0


def test_known_logprobs_are_the_ratio_denominator(tmp_path):
    """Rows whose export carries the behaviour logprobs use them: old = own - 0.1 gives ratio e^0.1 (inside the
    clip range) and, with positive advantages, e^0.1 times the on-policy gradient."""
    torch = _need("torch")
    a = _text_export()
    m = a["response_mask"] == 1
    pos = np.where(m, np.abs(a["advantages"]) + 0.5, 0).astype(np.float32)
    on_policy, trainer = _step({**a, "advantages": pos}, tmp_path / "a")
    model = trainer.model  # TRL's (its forward scores labels), back at the initial weights
    torch.manual_seed(0)
    model.load_state_dict(_tiny_model()[0].state_dict())
    P = a["prompts"].shape[1]
    ids = torch.from_numpy(np.concatenate([a["prompts"], a["responses"]], 1))
    with torch.no_grad():
        own, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, torch.from_numpy(a["attention_mask"]), ids.shape[1] - P
        )
    known = {**a, "advantages": pos, "old_log_probs": (own.numpy() - 0.1).astype(np.float32)}
    known["logprobs_known"] = np.ones(len(pos), bool)
    g, _ = _step(known, tmp_path / "b")
    scale = np.exp(0.1)
    assert np.allclose(g.numpy(), scale * on_policy.numpy(), rtol=1e-3, atol=1e-6 * float(g.norm()))
    # the same export with the flag off: on-policy again (the exported values are not used)
    g_off, _ = _step({**known, "logprobs_known": np.zeros(len(pos), bool)}, tmp_path / "c")
    assert np.allclose(g_off.numpy(), on_policy.numpy(), rtol=1e-4, atol=1e-6 * float(g.norm()))


def test_rows_without_a_prompt_are_left_out_in_one_line(tmp_path):
    """A row whose first token is trained has nothing to condition it: left out with one warning line; an
    export of only such rows is refused in one line."""
    a = _text_export()
    P = a["prompts"].shape[1]
    bad = {**a, "attention_mask": a["attention_mask"].copy()}
    bad["attention_mask"][1, :P] = 0
    with pytest.warns(UserWarning, match=r"^1 of 5 rows have no prompt token \(first: t\d+\): left out"):
        _, trainer = _step(bad, tmp_path / "a")
    assert sorted(trainer.train_dataset["creditflow_row"]) == [0, 2, 3, 4]
    bad["attention_mask"][:, :P] = 0
    with pytest.raises(ValueError, match=r"^5 of 5 rows have no prompt token [^\n]*nothing to train on"):
        _step(bad, tmp_path / "b")


# ---- the README's "from a TRL run" blocks, as written ----------------------------------------------------------


def test_readme_trl_train_block_runs_on_policy(tmp_path, monkeypatch):
    """The README's trainer block on a text source's export: one step, the old log-probabilities the policy's own."""
    from test_interop_export import _run_readme

    from trainer import trl_credit

    a = _text_export()
    calls = []
    own = trl_credit.CreditflowGRPOTrainer._logps
    monkeypatch.setattr(
        trl_credit.CreditflowGRPOTrainer,
        "_logps",
        lambda self, model, out: calls.append(1) or own(self, model, out),
    )
    torch = _need("torch")
    torch.manual_seed(0)
    model, tok = _tiny_model()
    ns = _run_readme("trl_train", tmp_path, monkeypatch, a, model=model, tokenizer=tok)
    assert ns["trainer"].state.global_step == 1 and calls  # trained, on the policy's own log-probabilities


@pytest.mark.slow
def test_readme_trl_export_line_runs(processed, tmp_path):  # noqa: F811 (the imported fixture)
    """The README's `./dev export` line for TRL, as written (lake and output moved here): a verl-layout export
    that says which rows carry behaviour logprobs and holds the steps for the round trip."""
    import shlex

    from test_interop_export import _ok, _readme

    (line,) = [x for x in _readme("trl_export").splitlines() if x.startswith("./dev export")]
    args = shlex.split(line)[1:]
    args[args.index("--lake") + 1] = str(processed)
    args[args.index("--out") + 1] = str(tmp_path / "adv.npz")
    _ok(args)
    a = np.load(tmp_path / "adv.npz", allow_pickle=False)
    assert {"prompts", "responses", "advantages", "logprobs_known", "creditflow_steps"} <= set(a.files)
    assert a["logprobs_known"].dtype == bool and len(a["logprobs_known"]) == len(a["prompts"])


def test_the_own_trainer_takes_the_exports_flag(tmp_path):
    """trainer.train.load_batch: a row whose logprobs are only partly known (some steps 0-filled) is recomputed,
    not taken for the behaviour policy's (the 0s would be old logprobs)."""
    import pyarrow.parquet as pq

    from trainer.train import load_batch

    for seed in range(40):
        flat, _ = _flat(seed, logprobs=True)
        known = flat.column("logprobs_known").to_pylist()
        partly = [
            not k and any(m and lp != 0 for m, lp in zip(mask, lps, strict=True))
            for k, mask, lps in zip(
                known,
                flat.column("loss_mask").to_pylist(),
                flat.column("old_logprobs").to_pylist(),
                strict=True,
            )
        ]
        if any(partly):
            break
    assert any(partly)  # the case a "some logprob is not 0" test got wrong
    pq.write_table(flat, tmp_path / "b.parquet")
    seqs, _ = load_batch(tmp_path / "b.parquet", 10_000)
    assert [q.has_logprobs for q in seqs] == known


def test_readme_trl_ingest_line_runs(tmp_path):
    """The README's `./dev ingest` line for TRL completions, as written (TRL's folder: the fixture TRL 1.16.0's
    GRPOTrainer.log wrote; the lake moved here): 16 records -> 16 trajectories, 0 quarantined."""
    import shlex
    from pathlib import Path

    from test_interop_export import _ok, _readme

    from warehouse.lake import Lake

    (line,) = [x for x in _readme("trl_ingest").splitlines() if x.startswith("./dev ingest")]
    args = shlex.split(line.split("#")[0])[1:]
    args[args.index("out/completions")] = str(Path(__file__).parent / "fixtures" / "trl" / "completions")
    args[args.index("--lake") + 1] = str(tmp_path / "lake")
    assert "# 16 records -> 16 trajectories, 0 quarantined" in line
    _ok(args)
    lake = Lake(tmp_path / "lake")
    assert lake.read("trajectories", 0).num_rows == 16 and lake.read("quarantine", 0).num_rows == 0
