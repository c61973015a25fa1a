"""creditflow's advantages for a live training batch, matched by sample key (a hash of the sample's token ids,
`pipeline.layouts.sample_key`), whatever the batch's order, ids or padding. verl has its own hook
(`trainer.verl_credit`, built on `ExportIndex`), TRL a trainer subclass (`trainer.trl_credit`).

    index = ExportIndex.load("adv.npz")   # creditflow export --layout openrlhf (or skyrl, or verl)
    # OpenRLHF 0.11, after RemoteExperienceMaker.compute_advantages_and_returns, per Experience:
    exp.advantages, found = openrlhf_advantages(index, exp.sequences, exp.attention_mask, exp.action_mask,
                                                max_len=args.data.max_len)
    # SkyRL 0.3, on the generator output, before the policy update:
    batch["advantages"], found = skyrl_advantages(index, prompt_token_ids, response_ids,
                                                  max_generate_length=cfg.generator.sampling_params.max_generate_length)

Lengths (one rule for every layout): a framework that cuts a sample (verl and SkyRL cut the response at their
response length, OpenRLHF the whole sequence at `max_len`) holds a prefix of the exported sample; that prefix
is found and gets the exported advantages of its tokens. A sample the run holds with more tokens than the
export kept (the export was cut shorter than the run cuts) stops with `LengthMismatch`: one line naming both
lengths and the export flag to change. Rows the export lacks get zeros and `found` False (keep the framework's
own there, or stop)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, Self

import numpy as np
import torch

from pipeline.layouts import sample_key

# per layout: what the framework cuts ("response": the response at a length, the prompt kept; "total": the
# whole sequence), the export flag that sets the cut, and the framework's own setting
CUTS = {
    "verl": ("response", "--response-length", "actor_rollout_ref.rollout.response_length"),
    "openrlhf": ("total", "--max-len", "--data.max_len"),
    "skyrl": ("response", "--response-length", "generator.sampling_params.max_generate_length"),
}


# per layout: the array that tells it apart first, then every array the index reads
LAYOUT_ARRAYS = {
    "verl": ("prompts", "responses", "response_mask", "attention_mask", "advantages", "key"),
    "openrlhf": ("action_mask", "sequences", "attention_mask", "advantages", "key"),
    "skyrl": ("loss_mask", "sequences", "attention_mask", "advantages", "key"),
}


class NamedArrays(Protocol):
    """An open .npz file (np.load's NpzFile) or the like: its array names in `files`, each read by name."""

    files: list[str]

    def __getitem__(self, name: str) -> np.ndarray: ...


class LengthMismatch(ValueError):
    """The run holds samples with more tokens than the export kept: the export was cut shorter than the run
    cuts. The message is one line naming both lengths and the flag to export again with."""


def _key(tokens: np.ndarray) -> str:
    return sample_key(tokens, ())  # the key hashes prompt and response ids back to back: the whole sequence


class ExportIndex:
    """An export (`creditflow export --layout verl|openrlhf|skyrl`) as whole token sequences: each row's real
    tokens (prompt and response as laid out), each token's advantage, and its prompt length (tokens before
    the first trained one), found by the key of the whole sample (`key`) or of the tokens as laid out (a row
    the export cut)."""

    def __init__(self, arrays: Mapping[str, np.ndarray] | NamedArrays):
        names = set(arrays.keys()) if hasattr(arrays, "keys") else set(arrays.files)
        layout = next((name for name, need in LAYOUT_ARRAYS.items() if need[0] in names), None)
        if layout is None:
            raise ValueError(
                "not a creditflow verl / openrlhf / skyrl export (creditflow export --layout ...)"
            )
        lacking = [k for k in LAYOUT_ARRAYS[layout] if k not in names]
        if lacking:
            raise ValueError(f"not a creditflow {layout} export: no {', '.join(map(repr, lacking))} array")
        adv = np.asarray(arrays["advantages"], dtype=np.float32)
        attn = np.asarray(arrays["attention_mask"]) != 0
        B = len(attn)
        if adv.ndim != 2 or attn.ndim != 2 or len(adv) != B or len(np.asarray(arrays["key"])) != B:
            raise ValueError(f"not a creditflow {layout} export: its arrays disagree on the number of rows")
        self.layout = layout
        if layout == "verl":  # [prompts | responses], the response right-padded
            seq = np.concatenate([np.asarray(arrays["prompts"]), np.asarray(arrays["responses"])], axis=1)
            P = seq.shape[1] - adv.shape[1]
            per_tok = np.concatenate([np.zeros((B, P), np.float32), adv], axis=1)
            trained = np.concatenate(
                [np.zeros((B, P), bool), np.asarray(arrays["response_mask"]) != 0], axis=1
            )
        elif layout == "openrlhf":  # right-padded, column j of the action arrays is token j + 1
            seq = np.asarray(arrays["sequences"])
            per_tok = np.concatenate([np.zeros((B, 1), np.float32), adv], axis=1)
            trained = np.concatenate([np.zeros((B, 1), bool), np.asarray(arrays["action_mask"]) != 0], axis=1)
        else:  # skyrl: left-padded, the response tensors right-aligned
            seq = np.asarray(arrays["sequences"])
            T, R = seq.shape[1], adv.shape[1]
            per_tok = np.concatenate([np.zeros((B, T - R), np.float32), adv], axis=1)
            trained = np.concatenate(
                [np.zeros((B, T - R), bool), np.asarray(arrays["loss_mask"]) != 0], axis=1
            )
        if not (seq.shape == per_tok.shape == trained.shape == attn.shape):
            raise ValueError(f"not a creditflow {layout} export: its arrays' shapes disagree")
        self.kind, self.flag, self.setting = CUTS[self.layout]
        # the real tokens of a row are one contiguous block (left- or right-padded): row-major selection
        self.tokens = np.ascontiguousarray(seq[attn], dtype=np.int64)
        self.adv = np.ascontiguousarray(per_tok[attn])
        self.lengths = attn.sum(axis=1).astype(np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths
        first = np.where(trained.any(axis=1), np.argmax(trained, axis=1), seq.shape[1])
        lead = np.argmax(attn, axis=1)  # columns of padding before a row's first real token
        self.prompt_len = np.clip(first - lead, 0, self.lengths)
        self.keys = [str(k) for k in np.asarray(arrays["key"])]
        self.row_of = {k: i for i, k in enumerate(self.keys)}
        laid_out = [_key(self.row(i)) for i in range(B)]
        self.cut = np.array([a != k for a, k in zip(laid_out, self.keys, strict=True)], dtype=bool)
        for i in np.flatnonzero(
            self.cut
        ):  # a row the export cut: a run that cuts the same holds these tokens
            self.row_of.setdefault(laid_out[i], int(i))
        self.cut_key = {laid_out[i]: int(i) for i in np.flatnonzero(self.cut)}
        # the length the export was cut at (the laid-out length of its cut rows), None when it cut nothing
        measure = self.lengths - self.prompt_len if self.kind == "response" else self.lengths
        self.cut_at = int(measure[self.cut].max()) if self.cut.any() else None
        self._prefix: dict[int, dict[str, int]] = {}

    @classmethod
    def load(cls, path: str | Path) -> Self:
        with np.load(path, allow_pickle=False) as data:
            return cls({k: data[k] for k in data.files})

    def row(self, i: int) -> np.ndarray:
        return self.tokens[self.starts[i] : self.starts[i] + self.lengths[i]]

    def advantages(self, i: int, n: int) -> np.ndarray:
        """The advantages of the first `n` tokens of export row `i`."""
        return self.adv[self.starts[i] : self.starts[i] + n]

    def _cut_keys(self, cap: int) -> dict[str, int]:
        """Keys of the export rows as the framework holds them when it cuts at `cap` (only rows longer)."""
        if cap not in self._prefix:
            out: dict[str, int] = {}
            for i in range(len(self.lengths)):
                end = int(self.prompt_len[i]) + cap if self.kind == "response" else cap
                if end < self.lengths[i]:
                    out.setdefault(_key(self.row(i)[:end]), i)
            self._prefix[cap] = out
        return self._prefix[cap]

    def match(
        self,
        seqs: Sequence[np.ndarray],
        response_lengths: Sequence[int] | np.ndarray,
        cap: int | None = None,
        skip: np.ndarray | None = None,
    ) -> np.ndarray:
        """The export row of each live sample (its real tokens; `response_lengths`: how many of them are its
        response), -1 where the export lacks it. `cap`: the run's cut (response length for verl / SkyRL, whole
        length for OpenRLHF; default the longest in the batch, which every cut sample reaches). `skip`: rows not
        to look up (a framework's padding rows). Raises `LengthMismatch` (one line) where the run holds a
        sample with more tokens than the export kept, ValueError where a key matches other tokens."""
        B = len(seqs)
        resp = np.asarray(response_lengths, dtype=np.int64).reshape(B)
        n = np.array([len(s) for s in seqs], dtype=np.int64)
        measure = resp if self.kind == "response" else n
        if cap is None:
            cap = int(measure.max()) if B else 0
        rows = np.full(B, -1, dtype=np.int64)
        short = []
        for b in range(B):
            if skip is not None and skip[b]:
                continue
            s = np.asarray(seqs[b], dtype=np.int64)
            j = self.row_of.get(_key(s), -1)
            if j < 0 and measure[b] == cap:  # the run may have cut it: the export row's prefix
                j = self._cut_keys(int(cap)).get(_key(s), -1)
            if j < 0 and self.cut_at is not None and measure[b] > self.cut_at:
                end = len(s) - int(resp[b]) + self.cut_at if self.kind == "response" else self.cut_at
                if _key(s[:end]) in self.cut_key:  # a sample the export cut shorter than the run holds it
                    short.append(int(measure[b]))
                continue
            if j < 0:
                continue
            if len(s) > self.lengths[j]:  # its whole key: the export cut it
                short.append(int(measure[b]))
                continue
            if not np.array_equal(s, self.row(j)[: len(s)]):
                raise ValueError("a batch row's key matches an exported row with other tokens")
            rows[b] = j
        if short:
            raise LengthMismatch(
                f"{len(short)} of {B} samples are longer than the creditflow export holds: it was cut at "
                f"{self.flag} {self.cut_at}, this run's are up to {max(short)} tokens ({self.setting} {cap}); "
                f"export again with {self.flag} {cap}"
            )
        return rows


def as_index(export) -> ExportIndex:
    """An `ExportIndex` from an index, a path or the arrays of `np.load` (built once: pass an index to reuse)."""
    if isinstance(export, ExportIndex):
        return export
    if isinstance(export, (str, Path)):
        return ExportIndex.load(export)
    return ExportIndex(export)


def openrlhf_advantages(
    export, sequences, attention_mask, action_mask, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T-1) advantages on OpenRLHF's action positions (right-padded whole sequences, cut at `max_len` as
    `SamplesGenerator._process_response_into_experience` does; action j is token j + 1), float32 on the
    batch's device, and which rows were found. `max_len`: the run's `--data.max_len` (default: the longest
    sequence in the batch)."""
    index = as_index(export)
    seq, attn, act = (x.detach().cpu().numpy() for x in (sequences, attention_mask, action_mask))
    seqs = [seq[i][attn[i] != 0] for i in range(len(seq))]
    n_act = [len(s) - _first_action(act[i], len(s)) for i, s in enumerate(seqs)]
    rows = index.match(seqs, n_act, cap=max_len)
    out = np.zeros(act.shape, dtype=np.float32)
    for i in np.flatnonzero(rows >= 0):
        n = len(seqs[i])
        out[i, : n - 1] = index.advantages(int(rows[i]), n)[1:]
    return torch.from_numpy(out).to(sequences.device), torch.from_numpy(rows >= 0)


def _first_action(mask: np.ndarray, n: int) -> int:
    on = np.flatnonzero(mask[: max(n - 1, 0)])
    return int(on[0]) + 1 if len(on) else n


def skyrl_advantages(
    export,
    prompts: list[list[int]],
    responses: list[list[int]],
    max_generate_length: int | None = None,
):
    """(B, max response length) advantages right-aligned as SkyRL's convert_prompts_responses_to_batch_tensors
    lays out response tensors, float32, and which rows were found. `max_generate_length`: where the run cuts
    responses (`generator.sampling_params.max_generate_length`; default: the longest response in the batch)."""
    index = as_index(export)
    seqs = [np.asarray(list(p) + list(r), dtype=np.int64) for p, r in zip(prompts, responses, strict=True)]
    resp = [len(r) for r in responses]
    rows = index.match(seqs, resp, cap=max_generate_length)
    R = max(resp, default=0)
    out = np.zeros((len(responses), R), dtype=np.float32)
    for i in np.flatnonzero(rows >= 0):  # one row copy per sample (right-aligned)
        n, r = len(seqs[i]), resp[i]
        out[i, R - r :] = index.advantages(int(rows[i]), n)[n - r :]
    return torch.from_numpy(out), torch.from_numpy(rows >= 0)
