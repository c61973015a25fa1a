"""A tiny causal LM built from a config (no download): for tests and the CPU loop."""

from __future__ import annotations

from pathlib import Path


def build_tiny_model(
    out_dir: str | Path,
    vocab_size: int = 49152,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    max_positions: int = 4096,
    seed: int = 0,
    tokenizer_json: str | Path | None = None,
) -> Path:
    """A Llama-architecture model with random weights, saved in Hugging Face format (+ tokenizer if given)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_json is not None:
        from transformers import PreTrainedTokenizerFast

        tok = PreTrainedTokenizerFast(
            tokenizer_file=str(tokenizer_json), eos_token="<|im_end|>", pad_token="<|im_end|>"
        )
        tok.save_pretrained(str(out))
    return out


def word_tokenizer_json(words: list[str], path: str | Path) -> Path:
    """A word-level tokenizer over a closed vocabulary (`words[i]` gets id i; text splits on whitespace; an
    unknown word is `[UNK]`), written as tokenizer.json. `<|im_end|>` and `[UNK]` must be in `words`; they
    are special tokens (`<|im_end|>` ends a generation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if "<|im_end|>" not in words or "[UNK]" not in words:
        raise ValueError("word vocabulary needs <|im_end|> and [UNK]")
    if len(set(words)) != len(words) or any(not w or any(c.isspace() for c in w) for w in words):
        raise ValueError("word vocabulary: words must be unique, non-empty and without whitespace")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|im_end|>", "[UNK]"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def format_prior(
    model_dir: str | Path,
    env_name: str,
    steps: int = 150,
    episodes: int = 512,
    lr: float = 3e-3,
    seed: int = 0,
) -> dict:
    """Teach a tiny model an env's action FORMAT, not its task: supervised steps on random episodes of the env
    (uniformly random actions, laid out token for token as `collect` lays them out) whose target at every action
    position is the uniform distribution over the env's action words (cross-entropy to uniform). The policy
    then starts like an instruct model does RL: it answers with valid actions, all equally likely whatever the
    context, so what it learns next about the task comes from the RL loop. Saves the model in place; returns
    {"steps", "action_mass"}: the mean probability on action words at action positions before and after."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.envs import make_env, make_toy_env
    from trainer.generation import Codec

    codec = Codec(model_dir)
    probe = make_toy_env(env_name)
    tasks = probe.tasks()
    action_ids = torch.tensor([codec.encode(a)[0][0] for a in probe.actions])
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    where: list[list[int]] = []
    for _ in range(episodes):
        env = make_env(env_name)
        meta = {**tasks[int(rng.integers(len(tasks)))], "max_turns": env.default_turns}
        ids = codec.encode(env.system_prompt(meta))[0] + codec.encode(env.reset(meta))[0]
        at = []
        while True:
            action = probe.actions[int(rng.integers(len(probe.actions)))]
            at.append(len(ids) - 1)  # the position whose next-token prediction is the action
            ids += codec.encode(action)[0]
            res = env.step(action)
            if res.done:
                break
            ids += codec.encode(res.observation)[0]
        seqs.append(ids)
        where.append(at)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    optim = torch.optim.Adam(model.parameters(), lr=lr)

    def batch(idx):
        L = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), L), codec.pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), L), dtype=torch.long)
        rows, cols = [], []
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            attn[r, : len(seqs[i])] = 1
            rows += [r] * len(where[i])
            cols += where[i]
        return ids, attn, torch.tensor(rows), torch.tensor(cols)

    def action_logp(idx):
        ids, attn, rows, cols = batch(idx)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[rows, cols].float(), dim=-1)
        return logp[:, action_ids]

    with torch.no_grad():
        before = float(action_logp(list(range(min(64, episodes)))).exp().sum(-1).mean())
    model.train()
    for _ in range(steps):
        lp = action_logp([int(i) for i in rng.choice(episodes, size=min(32, episodes), replace=False)])
        loss = -lp.mean()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
    model.eval()
    with torch.no_grad():
        after = float(action_logp(list(range(min(64, episodes)))).exp().sum(-1).mean())
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return {"steps": steps, "action_mass_before": before, "action_mass_after": after}
