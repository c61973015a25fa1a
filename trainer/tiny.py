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
