"""The `rules` IAPO annotator: a deterministic dependency graph from values, no model.

Rules (the paper's three acceptance conditions read mechanically; every [INF] knob is in
`RulesAnnotatorSettings`):

* **Information units** are specific values: e-mails, dates, ids and codes (tokens with a digit, e.g.
  `mia_li_3668`, `HAT069`, `2024-05-20`), upper-case codes (`JFK`, `EHGLP3`), numbers with at least
  `min_number_digits` digits, and title-case JSON leaves (`Mia`, `Austin`). Trivial values (0, 1, 42, booleans,
  lower-case enum words like `economy`) never count, which keeps *necessity*. Values that appear in a system
  message are common knowledge and never count either. Tool returns are walked as JSON (every leaf, plus the
  tokens inside free-text leaves); user messages and non-JSON returns are scanned with the same token rules.
* **Explicit binding**: a unit is bound by an action when it is a leaf of one of its tool-call arguments
  (binding `tool.path`), or a value stated in its text (binding `text`, when `text_values`).
* **Sources** are observations before the action: a successful tool return resolves to the action that made
  the call (edge type `success_utilization`), a user message to the assistant action right before it, which
  elicited it (type `input`). A user message with no earlier assistant action has no elicitor: when it is cited
  it adds one to the consuming action's `u_dir` instead of an edge.
* **Source priority**: the action's bound units are covered greedily by the resolved sources: the source
  covering most of the still-uncovered units first (most comprehensive), ties to the earliest; a source is
  cited only when it adds units the chosen ones do not cover (non-overlapping). Duplicate evidence (the same
  source through several messages) counts once.
* **Errors** (`e_i = 1`): a tool return flagged `is_error` (or whose text starts with `Error`) marks the calling
  action (`tool`); tool-call arguments that are not JSON, or an assistant step flagged `is_error`, mark the
  action (`schema`); a user message that explicitly rejects the preceding action marks it (`rejection`).
* **Failed use** (`failed_utilization`): a later call identical to an errored call (same tool, same canonical
  arguments) repeats the error; the first action after an observable error must fall back because of it.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pyarrow as pa

from pipeline.annotate.settings import RulesAnnotatorSettings
from pipeline.annotate.tables import add_edges, graph_tables
from pipeline.render import canonical_arguments, tool_call_spans

ANNOTATOR_ID = "rules"

_TOKEN = re.compile(r"[\w@.+:/-]+")
_STRIP = ".,:;/-+"
_EMAIL = re.compile(r"^[\w.+-]+@[\w-]+(\.[\w-]+)+$")
_NUMERIC = re.compile(r"^[+-]?\d+(\.\d+)?$")
_UPPER_CODE = re.compile(r"^[A-Z][A-Z0-9]{2,9}$")
_TITLE = re.compile(r"^[A-Z][a-z]+(?:[ '-][A-Z][a-z]+)*$")
_UPPER_STOP = {
    "EST",
    "PST",
    "CST",
    "MST",
    "UTC",
    "GMT",
    "YES",
    "NO",
    "OK",
    "THE",
    "AND",
    "FOR",
    "NOT",
    "YOU",
    "ARE",
    "BUT",
    "ALL",
    "ANY",
    "CAN",
    "HAS",
    "HAVE",
    "WILL",
    "JSON",
    "API",
    "TRANSFER",
    "STOP",
    "NOTE",
    "PLEASE",
    "HOLD",
    "AGENT",
    "HUMAN",
    "BEING",
    "TRANSFERRED",
    "ON",
    "TO",
    "A",
    "YOUR",
    "THIS",
    "THAT",
    "WITH",
    "ID",
}
_ERROR_TEXT = re.compile(r"^\s*(error\b|exception\b|traceback\b)", re.IGNORECASE)
_REJECTION = re.compile(
    r"(\bthat'?s not (right|correct|what i)|\bthat is not (right|correct|what i)|\bthat'?s (wrong|incorrect)"
    r"|\bthat is (wrong|incorrect)|\byou (made a mistake|got it wrong|are wrong|did it wrong)"
    r"|\bnot what i (asked|wanted|meant|said)|\bi (did not|didn'?t) (ask|say|want|mean|request|authori[sz]e)"
    r"|\bthis is (wrong|incorrect)|\bincorrect\b|\bwrong (one|flight|reservation|order|item|address|card)\b)",
    re.IGNORECASE,
)


# ---- value extraction -------------------------------------------------------------------------------
# \d (Unicode decimal digits) is a subset of what str.isdigit() accepts; the rest (superscripts, circled
# digits, ...) is not ASCII, so only non-ASCII tokens without a \d need the per-character test
_DECIMAL = re.compile(r"\d")


def _has_digit(tok: str) -> bool:
    """Whether any character of `tok` is a digit by str.isdigit()."""
    return _DECIMAL.search(tok) is not None or (not tok.isascii() and any(c.isdigit() for c in tok))


# the `_TOKEN` runs that hold a digit, '@', an ASCII capital or a non-ASCII character: the only runs that can be
# specific values, found in one regex pass (anchored at run starts, so linear), so that plain lower-case words
# never cost a Python call
_CANDIDATE = re.compile(r"(?<![\w@.+:/-])[\w@.+:/-]*?(?=[\w@.+:/-])(?:[\d@A-Z]|[^\x00-\x7f])[\w@.+:/-]*")


def _specific_token(tok: str, s: RulesAnnotatorSettings) -> str | None:
    tok = tok.strip(_STRIP)
    if len(tok) < 1:
        return None
    if "@" in tok:
        return tok.casefold() if _EMAIL.match(tok) else None
    if _has_digit(tok):
        if _NUMERIC.match(tok):  # only signs, a point and \d characters: every digit is a \d match
            return _number(float(tok), s) if len(_DECIMAL.findall(tok)) >= s.min_number_digits else None
        return tok.casefold() if len(tok) >= s.min_value_chars else None
    if _UPPER_CODE.match(tok) and tok not in _UPPER_STOP and len(tok) >= s.min_value_chars:
        return tok.casefold()
    return None


def _number(x: float, s: RulesAnnotatorSettings) -> str | None:
    if x != x or x in (float("inf"), float("-inf")):
        return None
    if float(x).is_integer():
        v = str(int(x))
        return v if len(v.lstrip("-")) >= s.min_number_digits else None
    v = repr(float(x))
    return v if sum(ch.isdigit() for ch in v) >= s.min_number_digits else None


def text_values(text: str, s: RulesAnnotatorSettings) -> set[str]:
    """Specific values mentioned in free text."""
    out = set()
    for tok in _CANDIDATE.findall(text or ""):
        v = _specific_token(tok, s)
        if v is not None:
            out.add(v)
    return out


def _leaf_values(leaf, s: RulesAnnotatorSettings) -> set[str]:
    if isinstance(leaf, bool) or leaf is None:
        return set()
    if isinstance(leaf, int | float):
        v = _number(float(leaf), s)
        return {v} if v else set()
    if not isinstance(leaf, str):
        return set()
    stripped = leaf.strip()
    whole = _specific_token(stripped, s) if _TOKEN.fullmatch(stripped) else None
    if whole is not None:
        return {whole}
    if _TITLE.match(stripped) and len(stripped) >= s.min_value_chars:
        return {stripped.casefold()}
    return text_values(stripped, s)


def json_leaves(obj, path: str = "") -> list[tuple[str, object]]:
    """(path, leaf) pairs of a parsed JSON value."""
    out: list[tuple[str, object]] = []
    stack = [(path, obj)]
    while stack:
        p, o = stack.pop()
        if isinstance(o, dict):
            stack.extend((f"{p}.{k}" if p else str(k), v) for k, v in o.items())
        elif isinstance(o, list):
            stack.extend((f"{p}[{i}]", v) for i, v in enumerate(o))
        else:
            out.append((p, o))
    return out


def json_values(obj, s: RulesAnnotatorSettings) -> set[str]:
    out: set[str] = set()
    for _, leaf in json_leaves(obj):
        out |= _leaf_values(leaf, s)
    return out


def observation_values(text: str, s: RulesAnnotatorSettings) -> set[str]:
    """Values of a tool return / user message: JSON leaves when it parses, else text tokens."""
    stripped = (text or "").strip()
    if stripped[:1] in "[{":
        try:
            return json_values(json.loads(stripped), s)
        except ValueError:
            pass
    return text_values(stripped, s)


def _strip_tool_calls(content: str) -> str:
    spans = tool_call_spans(content or "")
    if not spans:
        return content or ""
    parts, pos = [], 0
    for a, b in spans:
        parts.append(content[pos:a])
        pos = b
    parts.append(content[pos:])
    return " ".join(parts)


# ---- per trajectory ---------------------------------------------------------------------------------
def annotate_trajectory(
    rows: list[dict], s: RulesAnnotatorSettings
) -> tuple[dict[int, tuple[str, int]], list[tuple]]:
    """One trajectory's steps (in step order) -> ({turn: (error_kind, u_dir)}, [edges]).

    An edge is (src_turn, dst_turn, type, info_unit, binding)."""
    walk = _Walk(s)
    for order, row in enumerate(rows):
        role = row["role"]
        content = row["content"] or ""
        if role == "system":
            walk.system_values |= text_values(content, s)
        elif role == "user":
            walk.user(order, content)
        elif role == "tool":
            walk.tool(order, row, content)
        elif role == "assistant":
            walk.assistant(row, content)
    return {t: (k, u) for t, (k, u) in walk.nodes.items()}, [
        (i, j, t, *walk.edges[(i, j, t)]) for (i, j, t) in sorted(walk.edges)
    ]


class _Walk:
    """The state of one trajectory's walk in step order: its actions (nodes), edges, the values each source
    offers, the tool calls made and those that failed, the errors still waiting for a recovery."""

    def __init__(self, s: RulesAnnotatorSettings) -> None:
        self.s = s
        self.nodes: dict[int, list] = {}  # turn -> [error_kind, u_dir]
        self.edges: dict[tuple[int, int, str], tuple[str, str]] = {}
        self.system_values: set[str] = set()
        # sources: (key, order, kind, values); key = ("action", turn) or ("user", step_idx)
        self.sources: list[tuple[tuple, int, str, set[str]]] = []
        self.call_info: dict[str, tuple[int, str, str]] = {}  # call id -> (turn, name, canonical args)
        self.errored_calls: list[tuple[int, str, str]] = []
        self.pending_errors: list[int] = []
        self.last_action: int | None = None
        self.last_calls: list[str] = []

    def mark_error(self, turn: int, kind: str) -> None:
        node = self.nodes.get(turn)
        if node is not None and node[0] == "none":
            node[0] = kind
            self.pending_errors.append(turn)

    def add_edge(self, i: int, j: int, typ: str, info: str, binding: str) -> None:
        key = (i, j, typ)
        if key not in self.edges and i < j:
            self.edges[key] = (info[: self.s.max_info_chars], binding[: self.s.max_info_chars])

    def user(self, order: int, content: str) -> None:
        """A user message: a rejection marks the action before it; its values are a source (the action
        that elicited it, else the message itself)."""
        if self.last_action is not None and self.s.rejections and _REJECTION.search(content):
            self.mark_error(self.last_action, "rejection")
        key = ("action", self.last_action) if self.last_action is not None else ("user", order)
        self.sources.append((key, order, "user", observation_values(content, self.s)))

    def tool(self, order: int, row: dict, content: str) -> None:
        """A tool result: an error marks the action that made the call (and remembers the failed call);
        otherwise its values are a source of that action."""
        call = self.call_info.get(row.get("tool_call_id") or "")
        owner = call[0] if call else (row.get("turn") if row.get("turn") in self.nodes else self.last_action)
        if owner is None:
            return
        if row.get("is_error") or _ERROR_TEXT.match(content):
            self.mark_error(owner, "tool")
            if call is not None:
                self.errored_calls.append(call)
            elif len(self.last_calls) == 1 and self.last_calls[0] in self.call_info:
                self.errored_calls.append(self.call_info[self.last_calls[0]])
            return
        self.sources.append((("action", owner), order, "tool", observation_values(content, self.s)))

    def assistant(self, row: dict, content: str) -> None:
        """An action: recovery edges from the errors before it, the units its calls and text bind, covered by
        the earlier sources."""
        s = self.s
        turn = row.get("turn")
        if turn is None:
            return
        turn = int(turn)
        self.nodes[turn] = ["none", 0]
        # failed use: the first action after an observable error falls back because of it
        if s.recovery_edges:
            for i in self.pending_errors:
                if i < turn:
                    self.add_edge(i, turn, "failed_utilization", "error trace", "recovery")
        self.pending_errors = [i for i in self.pending_errors if i >= turn]
        bound = self._call_units(turn, row.get("tool_calls") or [])
        if row.get("is_error") and self.nodes[turn][0] == "none":
            self.nodes[turn][0] = "schema"
            self.pending_errors.append(turn)
        if s.text_values:
            for v in text_values(_strip_tool_calls(content), s):
                bound.setdefault(v, "text")
        for v in self.system_values:
            bound.pop(v, None)
        if bound and self.sources:
            _cover(turn, bound, self.sources, self.nodes, self.add_edge)
        self.last_action = turn

    def _call_units(self, turn: int, calls: list[dict]) -> dict[str, str]:
        """The units an action's tool calls bind (value -> `name.path`); arguments that are not JSON mark it a
        schema error; a call repeating a failed one (same name and arguments) gets its failed-use edge."""
        bound: dict[str, str] = {}
        self.last_calls = []
        for n_call, call in enumerate(calls):
            name = call.get("name") or ""
            raw = call.get("arguments") or ""
            cid = call.get("id") or f"{turn}:{n_call}"
            canon = canonical_arguments(raw)
            self.call_info[cid] = (turn, name, canon)
            self.last_calls.append(cid)
            try:
                args = json.loads(raw) if raw.strip() else {}
            except ValueError:
                self.nodes[turn][0] = "schema"
                self.pending_errors.append(turn)
                args = None
            if args is not None:
                for path, leaf in json_leaves(args):
                    for v in _leaf_values(leaf, self.s):
                        bound.setdefault(v, f"{name}.{path}" if path else name)
            if self.s.repeat_edges:
                for i, n2, c2 in self.errored_calls:
                    if i < turn and n2 == name and c2 == canon:
                        self.add_edge(i, turn, "failed_utilization", f"{name}({canon})", f"repeat {name}")
        return bound


def _cover(turn: int, bound: dict[str, str], sources, nodes, add_edge) -> None:
    """Greedy source priority: most comprehensive resolved source first, ties to the earliest."""
    by_key: dict[tuple, list] = {}
    for key, order, kind, values in sources:
        if key[0] == "action" and key[1] == turn:
            continue
        hit = values.intersection(bound)
        if not hit:
            continue
        entry = by_key.setdefault(key, [order, set(), defaultdict(set)])
        entry[1] |= hit
        for v in hit:
            entry[2][v].add(kind)
    remaining = set(bound)
    while remaining and by_key:
        key, (order, units, kinds) = min(
            by_key.items(), key=lambda kv: (-len(kv[1][1] & remaining), kv[1][0])
        )
        new = units & remaining
        if not new:
            break
        remaining -= new
        del by_key[key]
        vals = sorted(new)
        info = ", ".join(vals)
        binding = ", ".join(sorted({bound[v] for v in vals}))
        if key[0] == "user":
            nodes[turn][1] += 1
            continue
        typ = "success_utilization" if any("tool" in kinds[v] for v in new) else "input"
        add_edge(int(key[1]), turn, typ, info, binding)


def annotate_rules(
    steps: pa.Table, settings: RulesAnnotatorSettings | None = None, annotator_id: str = ANNOTATOR_ID
) -> tuple[pa.Table, pa.Table, dict[str, float]]:
    """The rules annotator over a batch of steps -> (nodes, edges, notes)."""
    s = settings or RulesAnnotatorSettings()
    cols = ["traj_id", "step_idx", "role", "turn", "content", "tool_calls", "tool_call_id", "is_error"]
    present = [c for c in cols if c in steps.column_names]
    round_ = 0
    if "round" in steps.column_names and steps.num_rows:
        round_ = int(steps.column("round")[0].as_py() or 0)
    steps = steps.select(present).sort_by([("traj_id", "ascending"), ("step_idx", "ascending")])
    rows = steps.to_pylist()
    n: dict[str, list] = defaultdict(list)
    e: dict[str, list] = defaultdict(list)
    start = 0
    while start < len(rows):
        tid = rows[start]["traj_id"]
        end = start
        while end < len(rows) and rows[end]["traj_id"] == tid:
            end += 1
        nodes, edges = annotate_trajectory(rows[start:end], s)
        for turn in sorted(nodes):
            kind, u_dir = nodes[turn]
            n["traj_id"].append(tid)
            n["turn"].append(turn)
            n["error"].append(int(kind != "none"))
            n["error_kind"].append(kind)
            n["u_dir"].append(u_dir)
        add_edges(e, tid, edges)
        start = end
    nodes_t, edges_t = graph_tables(n, e, round_, annotator_id, None)
    nn, ne = nodes_t.num_rows, edges_t.num_rows
    notes = {"edges": float(ne), "errors": float(sum(n["error"])), "actions": float(nn)}
    return nodes_t, edges_t, notes
