"""Synthetic rollouts at scale: seeded, canonical `trajectories` + `steps` tables for demos, tests and benchmarks.

Two environments, chosen per group (a group is all samples of one prompt):

- **search** (`action_format="search_r1"`): assistant turns `<think>...</think>\\n<search> q </search>` or
  `<answer> a </answer>`; observations are user steps `\\n\\n<information>{docs}</information>\\n\\n` (an answer
  gets an acknowledgement, an invalid action the Search-R1 "My previous action is invalid ..." message).
- **tool** (`action_format="openai_tools"`): a retail customer-service task (find user -> user details -> order
  details -> cancel -> tell the user). Assistant steps carry one OpenAI tool call, rendered into `content` exactly
  as `pipeline.render.render_assistant` does; tool steps answer with JSON whose ids and amounts (user id, order
  id, payment method, refund amount) are reused by later calls' arguments, which is what IAPO's annotator finds.
  Some turns talk to the user instead (clarifying question, final confirmation) and get a user reply.

Every trajectory has a system and a user prompt step, then exactly K assistant turns (a fixed budget: turns after
the first success are still played and scored) interleaved with K-1 observation steps.

**Per-turn verifier score** r_k in [0,1] (rounded to 2 decimals):
- search: an answer turn scores 1.0 if it is the gold answer, else the evidence found (partial credit); a search
  turn scores max(evidence found, score of the last answer); evidence grows only on new (non-repeated) queries.
- tool: milestones done / 5 (success = 1.0).
- an invalid turn scores the previous score minus 0.1 (clipped at 0), so scores are mostly non-decreasing with
  regressions at invalid turns and (search) at a wrong answer given after a right one.

**Outcome reward**: search = strict EM of the *last* valid `<answer>` (the Search-R1 env rule), i.e. 1.0 iff the
last answer turn scored 1.0; tool = 1.0 iff the task was completed (best score == 1.0; a cancellation cannot be
undone). `reward_components` (GDPO) = {"correct": reward, "format": 1 - invalid turns / K}.

**Rates** (per assistant turn, measured on the generated text in tests/test_synth.py):
- `invalid_rate`: malformed actions. search: unclosed `<search>`, both `<search>` and `<answer>`, or no action
  tag at all; tool: unknown tool name, arguments that are not JSON, or a missing required argument (the tool step
  returns an `{"error": ...}` with `is_error` true). Tool calls also fail at `error_rate` with a runtime error.
- `repeat_rate`: among valid action turns that have an earlier valid query/call in the trajectory, the fraction
  that repeats one: exact (same query / same call) or, with probability `near_share`, a near repeat (search: the
  query with an "s" appended, char-trigram Jaccard >= 0.9 after Search-R1 normalisation; tool: the same call with
  an extra `"verbose": true` argument).

**Tokens**: one token per UTF-8 byte (ids 0..255), i.e. `pipeline.tokenize.ByteTokenizer` semantics, computed
for the whole batch at once over the concatenated UTF-8 bytes of all contents; `token_offsets` is the char index
of each byte within its content. A BPE tokenizer would be ~100x slower at 16M tokens. `tokens` (T) is the mean
number of bytes of an assistant turn; observations are shorter (search docs ~T/2, tool JSON and user replies are
short). Logprobs (float32, `logprob_source="synthetic"`) are mostly near 0 with a heavy tail; `values` are critic
values (float32) near 0.2 + 0.6 x the score before the turn. Both are on assistant steps only (null elsewhere).

**Speed**: texts are built without per-token Python: each step is a row of up to `MAXSEG` segments (byte ranges
into one pool of template pieces and a filler corpus), chosen with NumPy over (trajectory, step); one gather
produces every content's bytes; list columns are built from flat arrays + offsets.

Limits: one tool call per assistant turn; a search group has 24 distinct queries, so beyond 24 fresh queries a
trajectory starts repeating them (exact repeats on top of `repeat_rate`); the whole-batch offsets are int32, so a
batch (batch_groups x samples x bytes) must stay under 2 GiB of text.

Same settings -> bit-identical tables. Batches of whole groups are generated independently (the RNG of a batch
is seeded with (seed, round, first group)), so memory is bounded by `batch_groups`.

Modules: `common` (settings, pool, shared helpers), `search` and `tool` (the environments), `tables` (a batch's
arrays -> tables); this package holds the batch and round functions.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from pipeline.synth.common import KINDS, Pool, SynthSettings, corpus
from pipeline.synth.search import build_search
from pipeline.synth.tables import tables
from pipeline.synth.tool import TOOL_SPECS, build_tool

__all__ = ["KINDS", "TOOL_SPECS", "SynthSettings", "generate", "generate_batch", "iter_batches"]


def generate_batch(settings: SynthSettings, first_group: int, n_groups: int) -> tuple[pa.Table, pa.Table]:
    """Groups [first_group, first_group + n_groups) of the round: (trajectories, steps), sorted by traj_id
    (mixed: the search groups take the lower ids, the tool groups the rest, so the two pieces concatenate in
    order and readers never sort)."""
    s = settings
    rng = np.random.default_rng([s.seed, s.round, first_group])
    text, word_starts = corpus(max(8 * s.tokens, 1))
    if s.kind == "mixed":
        n_search = int((rng.random(n_groups) >= 0.5).sum())
        is_tool = np.arange(n_groups) >= n_search
    else:
        is_tool = np.full(n_groups, s.kind == "tool")
    group_ids = np.arange(first_group, first_group + n_groups)
    pieces = []
    for kind_is_tool, builder in ((False, build_search), (True, build_tool)):
        chosen = group_ids[is_tool == kind_is_tool]
        if len(chosen) == 0:
            continue
        pool = Pool(text)
        built = builder(rng, s, len(chosen), pool, word_starts)
        pool.finish()
        pieces.append(tables(built, s, chosen, pool, rng))
    if len(pieces) == 1:
        return pieces[0]
    # search groups (lower ids) first, then tool groups: in traj_id order
    return (
        pa.concat_tables([p[0] for p in pieces]).combine_chunks(),
        pa.concat_tables([p[1] for p in pieces]).combine_chunks(),
    )


def iter_batches(settings: SynthSettings) -> Iterator[tuple[pa.Table, pa.Table]]:
    """The round as batches of `batch_groups` whole groups (the unit a lake part holds). A writer may generate
    the next batch while it writes this one (`warehouse.rounds.prefetched`)."""
    for first in range(0, settings.groups, settings.batch_groups):
        yield generate_batch(settings, first, min(settings.batch_groups, settings.groups - first))


def generate(settings: SynthSettings) -> tuple[pa.Table, pa.Table]:
    """The whole round in memory (small rounds: tests, demos)."""
    batches = list(iter_batches(settings))
    return (
        pa.concat_tables([b[0] for b in batches]).combine_chunks(),
        pa.concat_tables([b[1] for b in batches]).combine_chunks(),
    )
