"""Trainer: the loss against hand-computed cases, and a real update on a tiny model that moves the
logprobs of positive-advantage tokens up (and negative ones down)."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from trainer.losses import aggregate, policy_loss, token_logprobs_and_entropy, value_loss  # noqa: E402
from trainer.train import TrainSettings, pack_micro_batches, train  # noqa: E402


def test_policy_loss_hand_computed():
    # two tokens: ratio e^0.5=1.6487 with A=+1 (clipped at 1.2), ratio e^-0.5=0.6065 with A=-1 (clipped at 0.8)
    logp = torch.tensor([[0.0, 0.5, -0.5]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    adv = torch.tensor([[0.0, 1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    loss, clip_frac, approx_kl = policy_loss(logp, old, adv, mask, 0.2, 0.2)
    # token 1: max(-1.6487, -1.2) = -1.2 ; token 2: max(0.6065, 0.8) = 0.8 ; token-mean = (-1.2 + 0.8)/2
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert clip_frac.item() == pytest.approx(1.0)
    assert approx_kl.item() == pytest.approx(0.5 * 0.25, abs=1e-6)
    # dual clip with c = 3: a negative-advantage token with ratio e^2 = 7.39 -> loss bounded by 3
    loss_dc, _, _ = policy_loss(
        torch.tensor([[2.0]]),
        torch.tensor([[0.0]]),
        torch.tensor([[-1.0]]),
        torch.tensor([[1.0]]),
        0.2,
        0.2,
        dual_clip=3.0,
    )
    assert loss_dc.item() == pytest.approx(3.0)
    loss_nodc, _, _ = policy_loss(
        torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[-1.0]]), torch.tensor([[1.0]]), 0.2, 0.2
    )
    assert loss_nodc.item() == pytest.approx(math.exp(2.0), rel=1e-5)


def test_aggregation_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError):
        aggregate(loss, mask, "nope")


def test_value_loss_clipped_hand_computed():
    v = torch.tensor([[2.0]])
    old = torch.tensor([[1.0]])
    ret = torch.tensor([[0.0]])
    # unclipped (2-0)^2=4, clipped v=1.5 -> 2.25; max = 4 -> 0.5*4
    assert value_loss(v, old, ret, torch.ones(1, 1), 0.5).item() == pytest.approx(2.0)


def test_token_logprobs_alignment():
    logits = torch.log(torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]]]))
    ids = torch.tensor([[0, 1, 0]])
    logp, ent = token_logprobs_and_entropy(logits, ids)
    assert logp[0, 0].item() == 0.0
    assert logp[0, 1].item() == pytest.approx(math.log(0.5))
    assert logp[0, 2].item() == pytest.approx(math.log(0.9))
    assert ent[0, 1].item() == pytest.approx(math.log(2))


def test_pack_micro_batches_respects_budget():
    lengths = [10, 50, 20, 40, 5, 30]
    batches = pack_micro_batches(lengths, 60)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 60 or len(b) == 1


def _batch(path, n=8, length=24, vocab=256, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = rng.integers(0, vocab, size=length).tolist()
        mask = [0] * 8 + [1] * (length - 8)
        sign = 1.0 if i % 2 == 0 else -1.0
        rows.append(
            dict(
                round=0,
                method="grpo",
                traj_id=f"t{i}",
                group_id="g",
                reward=float(sign > 0),
                input_ids=ids,
                loss_mask=mask,
                old_logprobs=[0.0] * length,
                advantages=[sign * m for m in mask],
                values=None,
                returns=None,
                turn_ids=[m for m in mask],
            )
        )
    pq.write_table(pa.Table.from_pylist(rows), path)
    return rows


def _seq_logprobs(model_dir, rows):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    ids = torch.tensor([r["input_ids"] for r in rows])
    with torch.no_grad():
        logp, _ = token_logprobs_and_entropy(model(input_ids=ids).logits, ids)
    mask = torch.tensor([r["loss_mask"] for r in rows], dtype=torch.float32)
    return ((logp * mask).sum(-1) / mask.sum(-1)).numpy()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_train_moves_positive_tokens_up(tmp_path, agg):
    from trainer.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m0", vocab_size=256, hidden=32, layers=1, heads=2)
    rows = _batch(tmp_path / "b.parquet")
    before = _seq_logprobs(model_dir, rows)
    settings = TrainSettings(lr=3e-3, epochs=4, mini_batch_seqs=8, token_budget=64, loss_agg=agg)
    metrics = train(tmp_path / "b.parquet", model_dir, tmp_path / "m1", settings)
    after = _seq_logprobs(tmp_path / "m1", rows)
    delta = after - before
    assert (delta[0::2] > 0).all(), delta  # positive advantage: up
    assert (delta[1::2] < 0).all(), delta  # negative advantage: down
    assert metrics.num_rows == 4 and metrics.column("micro_batches")[0].as_py() >= 2  # accumulation happened
    assert (tmp_path / "m1" / "model.safetensors").exists() or list((tmp_path / "m1").glob("*.safetensors"))


def test_train_with_value_head_and_kl(tmp_path):
    from trainer.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "m0", vocab_size=256, hidden=32, layers=1, heads=2)
    rows = _batch(tmp_path / "b.parquet", n=4)
    for r in rows:
        r["values"] = [0.0] * len(r["input_ids"])
        r["returns"] = [1.0] * len(r["input_ids"])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "b.parquet")
    metrics = train(
        tmp_path / "b.parquet",
        model_dir,
        tmp_path / "m1",
        TrainSettings(lr=1e-3, value_head=True, kl_coef=0.1, mini_batch_seqs=4),
    )
    row = metrics.to_pylist()[0]
    assert row["vf_loss"] == pytest.approx(0.5, abs=1e-6)  # zero-initialised head: 0.5*(0-1)^2
    assert row["kl"] == pytest.approx(0.0, abs=1e-6)  # first step: policy == reference
    assert (tmp_path / "m1" / "value_head.pt").exists()
