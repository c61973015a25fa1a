"""What the collect stage samples with (trainer/collect.py runs the episodes): the model folder's tokenizer
(`Codec`), one generation's result (`Generation`: token ids, logprobs, text) and the two backends that make
them from token-id contexts: `LocalGenerator` (transformers, KV-cached batched sampling, the raw-distribution
logprobs; also the loop's policy server's sampler) and `ServerGenerator` (the shared LLM client against an
OpenAI-compatible server)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------------------
# tokenizer of the model folder


class Codec:
    """Encode/decode with the model folder's tokenizer.json, or bytes (ids 0..255) when it has none."""

    def __init__(self, model_dir: str | Path | None):
        path = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
        self._tok = None
        self.eos_ids: list[int] = []
        if path is not None and path.exists():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))
            for name in ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>"):
                tid = self._tok.token_to_id(name)
                if tid is not None:
                    self.eos_ids.append(int(tid))
            self.name = "hf"
        else:
            self.name = "bytes"
        self.pad_id = self.eos_ids[0] if self.eos_ids else 0

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size() if self._tok is not None else 256

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        if self._tok is None:
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            starts = (raw & 0xC0) != 0x80
            return raw.astype(np.int32).tolist(), (np.cumsum(starts) - 1).astype(np.int32).tolist()
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [o[0] for o in enc.offsets]

    def decode(self, ids: list[int]) -> str:
        if self._tok is None:
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def prefix_lengths(self, ids: list[int]) -> list[int]:
        """len(decode(ids[:k])) for k = 0..n (made non-decreasing: partial UTF-8 sequences)."""
        lens = [len(self.decode(ids[:k])) for k in range(len(ids) + 1)]
        return np.maximum.accumulate(np.asarray(lens, dtype=np.int64)).tolist()


# ---------------------------------------------------------------------------------------------------------
# generation results and the cut at the action's end


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float] | None
    text: str
    token_texts: list[str] | None = None  # per-token text pieces (server), for the cut and the offsets
    finish: str | None = None
    error: str | None = None


# ---------------------------------------------------------------------------------------------------------
# backends


class LocalGenerator:
    """transformers from the model folder: batched KV-cached sampling with the raw-distribution logprobs."""

    def __init__(self, model_dir: str | Path, codec: Codec, device: str = "auto", threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = torch.device(
            "cuda" if (device == "auto" and torch.cuda.is_available()) or device == "cuda" else "cpu"
        )
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        # transformers types PreTrainedModel.to as functools.wraps(nn.Module.to) of its own (self, *args)
        # method: a _Wrapped that mypy does not bind, so the device reads as `self`
        self.model = (
            AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
            .to(self.device)  # type: ignore[arg-type]
            .eval()
        )
        import inspect

        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.x: `cache`
        self.keep_kw = "logits_to_keep" if "logits_to_keep" in params else None
        n_params = sum(p.numel() for p in self.model.parameters())
        self.threads = threads or (1 if n_params < 20_000_000 and self.device.type == "cpu" else None)
        self.codec = codec
        self.eos = set(codec.eos_ids)

    def generate(
        self, contexts: list[list[int]], max_new: list[int], temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        torch = self.torch
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            return self._generate(contexts, max_new, temperature, top_p, seed)
        finally:
            torch.set_num_threads(before)

    def _generate(
        self, contexts: list[list[int]], max_new: list[int], temperature: float, top_p: float, seed: int
    ) -> list[Generation]:
        torch = self.torch
        B = len(contexts)
        L = max(len(c) for c in contexts)
        ids = torch.full((B, L), self.codec.pad_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        for r, c in enumerate(contexts):
            ids[r, L - len(c) :] = torch.tensor(c, dtype=torch.long)
            attn[r, L - len(c) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        gen = torch.Generator(device=self.device).manual_seed(int(seed))
        steps = max(max_new)
        limit = torch.tensor(max_new, device=self.device)
        out_ids = torch.zeros((B, steps), dtype=torch.long, device=self.device)
        out_lp = torch.zeros((B, steps), dtype=torch.float32, device=self.device)
        alive = torch.ones(B, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        eos = torch.tensor(sorted(self.eos), dtype=torch.long, device=self.device) if self.eos else None
        past = None
        cur = ids
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            for t in range(steps):
                kw: dict[str, Any] = {self.cache_kw: past}
                if self.keep_kw:
                    kw[self.keep_kw] = 1  # the LM head on the last position only
                out = self.model(input_ids=cur, attention_mask=attn, position_ids=pos, use_cache=True, **kw)
                past = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
                logits = out.logits[:, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                if temperature <= 0:
                    tok = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    if top_p < 1.0:
                        sp, si = probs.sort(dim=-1, descending=True)
                        keep = (sp.cumsum(-1) - sp) < top_p
                        sp = sp * keep
                        probs = torch.zeros_like(probs).scatter(-1, si, sp)
                    tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                out_ids[:, t] = tok
                out_lp[:, t] = logp.gather(-1, tok[:, None]).squeeze(-1)
                lengths += alive.long()
                stop = t + 1 >= limit
                if eos is not None:
                    stop |= torch.isin(tok, eos)
                alive &= ~stop
                if not bool(alive.any()):
                    break
                cur = tok[:, None]
                attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)
                pos = pos[:, -1:] + 1
        res = []
        for r in range(B):
            n = int(lengths[r])
            tids = out_ids[r, :n].tolist()
            res.append(
                Generation(
                    tids,
                    out_lp[r, :n].tolist(),
                    self.codec.decode(tids),
                    finish="stop" if n < max_new[r] else "length",
                )
            )
        return res


class ServerGenerator:
    """The shared LLM client against an OpenAI-compatible server (vLLM)."""

    def __init__(self, client):
        self.client = client

    def generate(
        self,
        contexts: list[list[int]],
        max_new: list[int],
        temperature: float,
        top_p: float,
        seeds: list[int],
        stop: list[str],
    ) -> list[Generation]:
        from pipeline.llm.types import LLMError, LLMRequest

        extra = {"include_stop_str_in_output": True, "skip_special_tokens": False}
        reqs = [
            LLMRequest.complete(
                list(c),
                max_tokens=int(m),
                temperature=temperature,
                top_p=top_p,
                logprobs=1,
                seed=int(s),
                stop=list(stop) or None,
                purpose="collect",
                cache=False,
                extra_body=extra,
            )
            for c, m, s in zip(contexts, max_new, seeds, strict=True)
        ]
        out = []
        for res in self.client.run_batch(reqs):
            if isinstance(res, LLMError) or not getattr(res, "choices", None):
                out.append(Generation([], None, "", error=str(res)))
                continue
            ch = res.choices[0]
            lps = ch.token_logprobs
            out.append(
                Generation(
                    list(ch.token_ids or []),
                    list(lps) if lps is not None else None,
                    ch.text,
                    token_texts=list(ch.tokens) if ch.tokens else None,
                    finish=ch.finish_reason,
                )
            )
        return out


# ---------------------------------------------------------------------------------------------------------
# the stage
