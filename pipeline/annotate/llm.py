"""The `llm` IAPO annotator: a frozen model (temperature 0) labels each trajectory's dependency graph through
the shared LLM client (pipeline/llm), with a versioned prompt and every answer validated (the prompt, the
transcript and the answer checks: pipeline/annotate/llm_prompt.py; this module runs the stage).

* The prompt states the paper's three acceptance conditions (necessity, explicit binding, source priority),
  the error definition and the spec section 4 output schema; the request carries the schema as
  `response_format` (json_schema; the client falls back to a prompted schema where the server lacks it).
* The transcript is untrusted data: it is one JSON document (each message's text a JSON string, `<` escaped)
  inside a delimited block of the user message; the instructions say that nothing inside it is an instruction.
  The system prompt and the schema never contain trajectory text.
* Validation: an answer that is not JSON, or not the schema's shape, is re-asked (`retries`), then recorded as
  a parse failure (nodes with `parse_failed = true`, no edges: the refiner's uniform fallback). Inside a
  well-formed answer, invalid items are dropped one by one: actions that do not exist, sources that do not
  resolve, edges that do not point backwards (i < j), unknown types; duplicate (i, j, type) edges count once.
  `user:u` resolves to the assistant action right before user message u (its elicitor; with none, the
  citation adds one to the consumer's `u_dir`), `tool:c` to the action that made the call.
* Caching: the client's on-disk cache is keyed by model, the whole request (the prompt, which carries
  PROMPT_VERSION, and the transcript) and the sampling parameters, so a re-run makes no call twice.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pyarrow as pa

from pipeline.annotate.llm_prompt import (
    PROMPT_VERSION,
    RESPONSE_FORMAT,
    MalformedAnswer,
    TranscriptIndex,
    build_messages,
    build_transcript,
    parse_answer,
    validate_answer,
)
from pipeline.annotate.settings import LLMAnnotatorSettings
from pipeline.annotate.tables import add_edges, graph_tables
from pipeline.config import Config
from pipeline.llm.types import LLMError, LLMRequest, LLMSettings
from pipeline.stages import NO_IO, LLMExchange, LLMReply, StageIO, StageOutput, execute


# ---- the stage --------------------------------------------------------------------------------------
def _split_trajectories(steps: pa.Table) -> list[tuple[str, list[dict]]]:
    cols = [
        c
        for c in ("traj_id", "step_idx", "role", "turn", "content", "tool_calls", "tool_call_id", "is_error")
        if c in steps.column_names
    ]
    rows = steps.select(cols).sort_by([("traj_id", "ascending"), ("step_idx", "ascending")]).to_pylist()
    out: list[tuple[str, list[dict]]] = []
    for row in rows:
        if not out or out[-1][0] != row["traj_id"]:
            out.append((row["traj_id"], []))
        out[-1][1].append(row)
    return out


def annotate_llm_requests(steps: pa.Table, config: Config, annotator_id: str | None = None) -> LLMExchange:
    """The llm annotator's requests for a batch of steps (one chat per trajectory) and the parser of their
    answers (`_Annotation.parse`): an answer that is not the schema is re-asked up to `retries` times (the
    parser's next exchange), then the trajectory falls back to uniform weights."""
    s = config.settings(LLMAnnotatorSettings)
    overrides = {"model": s.model} if s.model else {}
    work = _Annotation(steps, s, annotator_id)
    return work.exchange(LLMSettings.from_config(config, **overrides))


def annotate_llm(
    steps: pa.Table, config: Config, annotator_id: str | None = None, io: StageIO = NO_IO
) -> StageOutput:
    """The llm annotator over a batch of steps, its requests sent through the client of `io`."""
    return execute(annotate_llm_requests(steps, config, annotator_id), io)


class _Annotation:
    """One batch's annotation in progress: the transcripts, the requests still waiting for a valid answer, the
    answers so far.

    A request is a job `(k, window)`: trajectory k whole (`window` None) or the items [a, b) of its transcript.
    A trajectory longer than the context (the client answers `too_long` with the prompt's token count and the
    context, having sent nothing) is split into overlapping windows sized from that count (the tokens per
    character of its own request); a window still too long is split again, and a window of one message that
    still does not fit is recorded as too long (not sent). Merging: every action is labelled (its error and
    its incoming edges) by the window in which it is most central (the most messages on its shorter side),
    so each action is judged with context on both sides and the overlaps never count an edge twice. A
    trajectory with a window that failed falls back to uniform weights, like a whole one."""

    MAX_SPLITS = 16  # rounds of splitting before a window is given up as too long

    def __init__(self, steps: pa.Table, s: LLMAnnotatorSettings, annotator_id: str | None) -> None:
        self.s, self.annotator_id = s, annotator_id
        self.round = (
            int(steps.column("round")[0].as_py() or 0)
            if "round" in steps.column_names and steps.num_rows
            else 0
        )
        self.prepared: list[tuple[str, TranscriptIndex, list[dict]]] = []
        for tid, rows in _split_trajectories(steps):
            items, idx = build_transcript(rows, s)
            self.prepared.append((tid, idx, items))
        self.params: dict[str, Any] = {"temperature": 0.0, "max_tokens": s.max_tokens, "purpose": "iapo"}
        if s.structured_output:
            self.params["response_format"] = RESPONSE_FORMAT
        self.answers: dict[tuple, list[dict]] = {}  # job -> the answer's entries
        self.failures: dict[tuple, str] = {}  # job -> why it has no answer
        self.windows: dict[int, list[tuple[int, int]]] = {}  # trajectory -> its windows (split ones only)
        self.model_name: str | None = s.model
        self.pending: list[tuple] = [(k, None) for k in range(len(self.prepared))]
        self.convo: dict[tuple, list[dict]] = {job: self.messages(job) for job in self.pending}
        self.asked: defaultdict[tuple, int] = defaultdict(int)  # re-asks per job
        self.splits: defaultdict[int, int] = defaultdict(int)
        self.notes: defaultdict[str, float] = defaultdict(float)
        self.too_long: dict[int, str] = {}  # trajectory -> why it was given up as too long

    def messages(self, job: tuple) -> list[dict]:
        k, window = job
        items = self.prepared[k][2]
        if window is None:
            return build_messages(items)
        a, b = window
        return build_messages(items[a:b], excerpt=(a, b, len(items)))

    def exchange(self, settings: LLMSettings) -> LLMExchange:
        requests = [LLMRequest.chat(self.convo[job], **self.params) for job in self.pending]
        return LLMExchange(settings, requests, lambda reply: self.parse(reply, settings))

    def parse(self, reply: LLMReply, settings: LLMSettings) -> StageOutput | LLMExchange:
        s, notes = self.s, self.notes
        retry: list[tuple] = []
        for job, res in zip(self.pending, reply.results, strict=True):
            if isinstance(res, LLMError):
                if res.kind == "too_long" and self.asked[job]:
                    # the re-ask (the request plus its invalid answer) outgrew the context: the request itself
                    # fit, so it is not split again; its malformed answer stands (a parse failure)
                    notes["reasks_too_long"] += 1
                    continue
                if res.kind == "too_long":
                    retry += self.split(job, res)
                    continue
                self.failures[job] = f"llm error: {res}"
                notes["llm_errors"] += 1
                continue
            notes["llm_calls"] += 1
            notes["cache_hits"] += float(bool(res.cached))
            self.model_name = self.model_name or res.model
            text = res.choices[0].text if res.choices else ""
            try:
                self.answers[job] = parse_answer(text)
                self.failures.pop(job, None)
            except MalformedAnswer as exc:
                self.failures[job] = str(exc)
                notes["malformed_answers"] += 1
                if self.asked[job] < s.retries:
                    self.asked[job] += 1
                    retry.append(job)
                    self.convo[job] = [
                        *self.convo[job],
                        {"role": "assistant", "content": text[:4000]},
                        {
                            "role": "user",
                            "content": f"That answer was not valid ({str(exc)[:200]}). Answer "
                            "again with only the JSON object described in the instructions.",
                        },
                    ]
        self.pending = retry
        if retry:
            return self.exchange(settings)
        return self.output()

    def split(self, job: tuple, err: LLMError) -> list[tuple]:
        """The windows that replace a job the client found too long (nothing was sent), or none when it cannot
        be split further (then the trajectory is recorded as too long)."""
        k, window = job
        tid, _, items = self.prepared[k]
        a, b = window if window is not None else (0, len(items))
        self.splits[k] += 1
        prompt = err.prompt_tokens or 0
        context = err.context or 0
        budget = context - self.s.max_tokens  # prompt tokens a request may hold
        convo = self.convo.pop(job)
        chars = sum(len(str(m.get("content") or "")) for m in convo)
        item_chars = [len(json.dumps(it, ensure_ascii=False)) for it in items]
        per_char = prompt / max(chars, 1)
        fixed = per_char * (chars - sum(item_chars[a:b]))  # system prompt, instructions, earlier turns
        room = (budget - fixed) * 0.85 / per_char if per_char > 0 else 0.0  # characters of items per window
        if b - a <= 1 or room < max(item_chars[a:b]) or self.splits[k] > self.MAX_SPLITS:
            self.failures[job] = (
                f"too long: {prompt} prompt tokens + {self.s.max_tokens} answer tokens > context {context}"
            )
            self.too_long[k] = self.failures[job]
            self.notes["llm_too_long"] += 1
            return []
        parts = overlapping_windows(item_chars[a:b], room, self.s.window_overlap)
        jobs = []
        known = self.windows.setdefault(k, [])
        if window is not None:
            known.remove(window)
        for lo, hi in parts:
            w = (a + lo, a + hi)
            if not any(it["id"].startswith("action:") for it in items[w[0] : w[1]]):
                continue  # no action to label in it (its messages are context of the neighbours)
            known.append(w)
            new = (k, w)
            self.convo[new] = self.messages(new)
            jobs.append(new)
        self.notes["windows"] += len(jobs)
        return jobs

    def merged(self, k: int) -> tuple[dict[int, list], list[tuple], dict[str, int]] | None:
        """Trajectory k's graph from its answer(s), or None when a request of it has no answer."""
        tid, idx, items = self.prepared[k]
        windows = self.windows.get(k)
        if not windows:
            answer = self.answers.get((k, None))
            return None if answer is None else validate_answer(answer, idx)
        if any((k, w) not in self.answers for w in windows):
            return None
        owner: dict[int, tuple[int, int]] = {}
        best: dict[int, int] = {}
        for w in sorted(windows):
            for p in range(w[0], w[1]):
                iid = items[p]["id"]
                if iid.startswith("action:"):
                    turn = int(iid.split(":")[1])
                    depth = min(p - w[0], w[1] - 1 - p)
                    if depth > best.get(turn, -1):
                        best[turn], owner[turn] = depth, w
        nodes: dict[int, list] = {t: [0, "none", 0] for t in idx.actions}
        edges: list[tuple] = []
        dropped: defaultdict[str, int] = defaultdict(int)
        for w in sorted(windows):
            n_w, e_w, d_w = validate_answer(self.answers[(k, w)], idx)
            for key, v in d_w.items():
                dropped[key] += v
            for t, w_t in owner.items():
                if w_t == w:
                    nodes[t] = n_w[t]
            edges += [e for e in e_w if owner.get(e[1]) == w]
        return nodes, sorted(edges), dict(dropped)

    def output(self) -> StageOutput:
        s, notes, prepared = self.s, self.notes, self.prepared
        ann_id = self.annotator_id or s.annotator_id or f"llm:{self.model_name or 'default'}"
        n: dict[str, list] = defaultdict(list)
        e: dict[str, list] = defaultdict(list)
        failed_k: set[int] = set()
        for k, (tid, idx, _) in enumerate(prepared):
            graph = self.merged(k)
            failed = graph is None
            if graph is None:
                nodes = {t: [0, "none", 0] for t in idx.actions}
                edges: list[tuple] = []
                notes["parse_failures"] += 1
                failed_k.add(k)
            else:
                nodes, edges, dropped = graph
                for key, v in dropped.items():
                    notes[f"dropped_{key}"] += v
            if self.windows.get(k):
                notes["trajectories_windowed"] += 1
            for t in idx.actions:
                err, kind, u_dir = nodes[t]
                n["traj_id"].append(tid)
                n["turn"].append(t)
                n["error"].append(err)
                n["error_kind"].append(kind)
                n["u_dir"].append(u_dir)
                n["parse_failed"].append(failed)
            add_edges(e, tid, edges)
        nodes_t, edges_t = graph_tables(n, e, self.round, ann_id, PROMPT_VERSION)
        notes["edges"] = float(edges_t.num_rows)
        warnings = []
        if notes.get("llm_errors"):
            warnings.append(
                f"iapo llm annotator: {int(notes['llm_errors'])} request(s) failed; those trajectories "
                "fall back to uniform weights"
            )
        if self.too_long:
            first = next(iter(self.too_long))
            warnings.append(
                f"iapo llm annotator: {len(self.too_long)} of {len(prepared)} trajectories do not fit the "
                f"context even as windows of one message (first: {prepared[first][0]}, "
                f"{self.too_long[first]}); recorded as too long, not sent; uniform weights"
            )
        unparsed = sum(
            1
            for k in failed_k - set(self.too_long)
            if any(not why.startswith("llm error") for job, why in self.failures.items() if job[0] == k)
        )
        # requests whose answer stayed unusable after the re-asks (their trajectories fall back): failed
        # requests for the stage's failure share (pipeline.stages.execute), like those the client gave up on
        # (a trajectory recorded too long counts once, as such: llm_too_long)
        fell_back = failed_k - set(self.too_long)
        notes["llm_unusable"] = float(
            sum(
                1
                for job, why in self.failures.items()
                if not why.startswith("llm error") and job[0] in fell_back
            )
        )
        if unparsed:
            warnings.append(
                f"iapo llm annotator: {unparsed} of {len(prepared)} answer(s) were not the JSON schema after "
                f"{s.retries} retr{'y' if s.retries == 1 else 'ies'}; those trajectories fall back to uniform "
                "weights"
            )
        return StageOutput(tables={"nodes": nodes_t, "edges": edges_t}, notes=dict(notes), warnings=warnings)


def overlapping_windows(sizes: list[int], room: float, overlap: float) -> list[tuple[int, int]]:
    """Windows [lo, hi) over items of the given sizes: each holds at most `room` (at least one item), and each
    after the first starts so that about `overlap` of `room` repeats the end of the one before; they cover
    every item, in order, and every window ends later than the one before."""
    out: list[tuple[int, int]] = []
    lo, n = 0, len(sizes)
    while True:
        hi, used = lo, 0.0
        while hi < n and (hi == lo or used + sizes[hi] <= room):
            used += sizes[hi]
            hi += 1
        out.append((lo, hi))
        if hi >= n:
            return out
        nxt, back = hi, 0.0
        while nxt - 1 > lo and back + sizes[nxt - 1] <= overlap * room:
            nxt -= 1
            back += sizes[nxt]
        lo = nxt
