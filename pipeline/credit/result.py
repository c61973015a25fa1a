"""The one result type of every estimator and refiner: token advantages, the returns (critic targets) where the
method has them, and the per-step components, laid out as the method computes them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pipeline.credit.batch import CreditBatch


@dataclass(frozen=True, slots=True)
class TokenLayout:
    """What lays a per-step or on-mask result over a batch's tokens: which steps are the assistant's and their
    token counts (the token mask is built from them only where an on-mask result is laid out)."""

    step_is_assistant: np.ndarray
    step_tokens: np.ndarray

    @classmethod
    def of(cls, batch: CreditBatch) -> TokenLayout:
        return cls(batch.step_is_assistant, batch.step_tokens)

    def per_token(self, per_step: np.ndarray | None, on_mask: np.ndarray | None) -> np.ndarray:
        if per_step is not None:
            return np.repeat(per_step, self.step_tokens)
        assert on_mask is not None
        out = np.zeros(int(self.step_tokens.sum()))
        out[np.repeat(self.step_is_assistant, self.step_tokens)] = on_mask
        return out


@dataclass(frozen=True, slots=True)
class CreditResult:
    """Token advantages, the returns (critic targets) where the method has them, and the per-step components.
    One type, laid out three ways by what the estimator computes (exactly one advantage field is set):

    - `CreditResult.per_step(batch, step_adv, ...)`: an advantage constant over each step's tokens (GRPO, RLOO,
      GDPO, MT-GRPO, GiGPO, turn PPO, ...), `step_returns` likewise;
    - `CreditResult.on_mask(batch, mask_adv, ...)`: values on the assistant tokens only, in token order (GAE);
    - `CreditResult.per_token(tok_adv, ...)`: a per-token array (the refiners).

    The advantages table lays each layout straight into its float32 list columns; `adv_per_token()` /
    `returns_per_token()` build the per-token arrays when a refiner needs them."""

    components: dict[str, np.ndarray] = field(default_factory=dict)  # per step row; NaN = null
    notes: dict[str, float] = field(default_factory=dict)  # counts for the summary (fallbacks, ...)
    # per step row (0 on non-assistant steps): the advantage on each of the step's tokens
    step_adv: np.ndarray | None = None
    # on the assistant tokens (the batch's tok_mask order), 0 elsewhere
    mask_adv: np.ndarray | None = None
    tok_adv: np.ndarray | None = None  # per token
    step_returns: np.ndarray | None = None  # the returns, laid out likewise (at most one; none: no returns)
    mask_returns: np.ndarray | None = None
    tok_returns: np.ndarray | None = None
    layout: TokenLayout | None = None  # the batch's tokens, for the per-step and on-mask layouts

    @classmethod
    def per_step(
        cls,
        batch: CreditBatch,
        step_adv: np.ndarray,
        components: Mapping[str, np.ndarray] | None = None,
        notes: Mapping[str, float] | None = None,
        step_returns: np.ndarray | None = None,
    ) -> CreditResult:
        """A per-step advantage (and return) on every assistant token of the step (0 elsewhere)."""
        is_asst = batch.step_is_assistant
        per_step = np.where(is_asst, np.asarray(step_adv, dtype=np.float64), 0.0)
        step_ret = None
        if step_returns is not None:
            step_ret = np.where(is_asst, np.asarray(step_returns, dtype=np.float64), 0.0)
        return cls(
            dict(components or {}),
            dict(notes or {}),
            step_adv=per_step,
            step_returns=step_ret,
            layout=TokenLayout.of(batch),
        )

    @classmethod
    def on_mask(
        cls,
        batch: CreditBatch,
        mask_adv: np.ndarray,
        components: Mapping[str, np.ndarray] | None = None,
        notes: Mapping[str, float] | None = None,
        mask_returns: np.ndarray | None = None,
    ) -> CreditResult:
        """Values on the assistant tokens (the batch's tok_mask order), 0 on the others."""
        return cls(
            dict(components or {}),
            dict(notes or {}),
            mask_adv=np.asarray(mask_adv, dtype=np.float64),
            mask_returns=None if mask_returns is None else np.asarray(mask_returns, dtype=np.float64),
            layout=TokenLayout.of(batch),
        )

    @classmethod
    def per_token(
        cls,
        tok_adv: np.ndarray,
        components: Mapping[str, np.ndarray] | None = None,
        notes: Mapping[str, float] | None = None,
        tok_returns: np.ndarray | None = None,
    ) -> CreditResult:
        """A per-token advantage array (0 off the assistant tokens once checked)."""
        return cls(dict(components or {}), dict(notes or {}), tok_adv=tok_adv, tok_returns=tok_returns)

    def refined(
        self, tok_adv: np.ndarray, components: Mapping[str, np.ndarray], notes: Mapping[str, float]
    ) -> CreditResult:
        """A refiner's result: new per-token advantages, components and notes; this result's returns, in their
        layout."""
        return replace(
            self,
            components=dict(components),
            notes=dict(notes),
            step_adv=None,
            mask_adv=None,
            tok_adv=tok_adv,
        )

    def adv_per_token(self) -> np.ndarray:
        """The per-token advantage array (0 off the assistant tokens): O(tokens), built on each call for the
        per-step and on-mask layouts."""
        if self.tok_adv is not None:
            return self.tok_adv
        assert self.layout is not None, "a per-step or on-mask result carries its batch's layout"
        return self.layout.per_token(self.step_adv, self.mask_adv)

    def returns_per_token(self) -> np.ndarray | None:
        """The per-token returns (None: the method has none), built like `adv_per_token`."""
        if self.tok_returns is not None or (self.step_returns is None and self.mask_returns is None):
            return self.tok_returns
        assert self.layout is not None, "a per-step or on-mask result carries its batch's layout"
        return self.layout.per_token(self.step_returns, self.mask_returns)
