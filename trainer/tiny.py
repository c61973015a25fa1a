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
