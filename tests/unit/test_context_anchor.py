"""Agent-sized turns: a continuation tokenizes what it adds, and says what a full tokenization would.

Each test walks a conversation turn by turn twice: once as the gateway does (each turn carrying the
render anchor its build produced) and once cold (the parent's anchor taken away, so the whole render
is tokenized and compared, as before anchors existed). Prompts and ``matches_full_render`` must
agree on every turn, on the tiny model's byte-level BPE and on SmolLM2's GGUF-converted tokenizer.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion._context import Context, ContextBuilder
from stream_gateway.completion._request import Message, Tool
from stream_gateway.models import smollm2_path
from stream_gateway.sessions import TokenIds, Turn

_TOOLS = [Tool.model_validate({"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}})]


def _turn(turn_id: str, parent: Turn | None, context: Context, output: list[int], context_length: int) -> Turn:
    return Turn(
        turn_id=turn_id, session_id="s", parent_id=parent.turn_id if parent else None, key=None,
        context_length=context_length, prompt_ids=context.prompt_ids,  # type: ignore[arg-type]
        reused_prompt_tokens=context.reused_prompt_tokens, output_ids=tuple(output),
        logprobs=tuple([0.0] * len(output)), finish_reason="stop", content="", tool_calls=(), policy_version=0,
        policy_versions=((0, 0),), created_at=0.0, time_to_first_token_s=None, duration_s=0.0,
        matches_full_render=context.matches_full_render, fallback_reason=None, render_anchor=context.anchor,
    )  # fmt: skip


class _Counting:
    """The builder's tokenizer calls, by characters tokenized."""

    def __init__(self, builder: ContextBuilder) -> None:
        self.chars = 0
        encode = builder._encode

        def counted(text: str) -> list[int]:
            self.chars += len(text)
            return encode(text)

        builder._encode = counted  # type: ignore[method-assign]


def _tokenizer(name: str, tiny_model_path: Path) -> PreTrainedTokenizerBase:
    path = tiny_model_path if name == "tiny" else smollm2_path()
    return AutoTokenizer.from_pretrained(path)


def _walk(
    builder: ContextBuilder, tokenizer: PreTrainedTokenizerBase, turns: int, sampled: Any
) -> list[tuple[Context, Context, int, int]]:
    """A tool loop of ``turns`` turns, each adding a ~2k-character tool result. For each continuing
    turn: (warm context, cold context, characters the warm build tokenized, the cold one's)."""
    counting = _Counting(builder)
    builder._pieces = None  # cold: the whole render tokenized, no piece from memory (test_render_pieces.py)
    messages = [Message(role="system", content="You are an agent."), Message(role="user", content="Read it all.")]
    first = builder.build(messages, _TOOLS, None)
    assert first.cold and first.anchor is not None and first.anchor.exact
    parent = _turn("t0", None, first, sampled(0), len(messages))
    seen = []
    for n in range(1, turns):
        text = tokenizer.decode(parent.output_ids, skip_special_tokens=True)
        messages = [*messages, Message(role="assistant", content=text), Message(role="user", content=_result(n))]
        counting.chars = 0
        warm = builder.build(messages, _TOOLS, parent)
        warm_chars = counting.chars
        counting.chars = 0
        cold = builder.build(messages, _TOOLS, replace(parent, render_anchor=None))
        seen.append((warm, cold, warm_chars, counting.chars))
        parent = _turn(f"t{n}", parent, warm, sampled(n), len(messages))
    return seen


def _result(n: int) -> str:
    return "".join(f"line {n}.{i}: the file says {n * i} things, some of them twice.\n" for i in range(40))


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_continuations_tokenize_what_they_add_and_agree_with_a_full_tokenization(
    tiny_model_path: Path, name: str
) -> None:
    tokenizer = _tokenizer(name, tiny_model_path)
    builder = ContextBuilder(tokenizer)
    assert builder._splits, "the tokenizer tokenizes either side of a special token on its own"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def sampled(n: int) -> list[int]:  # what a model would sample: the text's own tokenization, then the end
        return [*tokenizer.encode(f"Reading part {n} next.", add_special_tokens=False), end]

    seen = _walk(builder, tokenizer, 12, sampled)
    for warm, cold, _, _ in seen:
        assert not warm.cold and cold.cold
        assert warm.prompt_ids == cold.prompt_ids
        assert warm.matches_full_render and cold.matches_full_render
        assert warm.anchor == cold.anchor
        # ... and holds only the ids it added: the history is its parent's storage, not a copy.
        assert isinstance(warm.prompt_ids, TokenIds)
        assert warm.prompt_ids.held == len(warm.prompt_ids) - warm.reused_prompt_tokens < len(_result(1))
    # A warm build tokenizes what the turn adds (the new messages, and the assistant message with
    # them to compare with what was sampled), whatever the conversation holds; a cold one all of it.
    for n, (_, _, warm_chars, cold_chars) in enumerate(seen, start=1):
        assert warm_chars <= len(_result(n)) + 300  # the new messages once, and the assistant message
        assert cold_chars > n * len(_result(1))


def test_an_ancestor_sampled_otherwise_stays_a_mismatch_down_the_chain(tiny_model_path: Path) -> None:
    """One turn samples ids that a fresh tokenization of its text would not give (single bytes of
    a word); every later turn's prompt holds them, and says so, as a full tokenization would."""
    tokenizer = _tokenizer("tiny", tiny_model_path)
    builder = ContextBuilder(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    word = tokenizer.encode("Reading", add_special_tokens=False)
    assert len(word) < len("Reading")

    def sampled(n: int) -> list[int]:
        if n == 2:  # "Reading" spelled out a character at a time
            letters = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "Reading"]
            return [*letters, *tokenizer.encode(" on.", add_special_tokens=False), end]
        return [*tokenizer.encode(f"Reading part {n} next.", add_special_tokens=False), end]

    seen = _walk(builder, tokenizer, 6, sampled)
    matches = [(warm.matches_full_render, cold.matches_full_render) for warm, cold, _, _ in seen]
    assert matches == [(True, True), (True, True), (False, False), (False, False), (False, False)]
    assert all(not warm.cold for warm, _, _, _ in seen)


def test_a_history_re_serialised_by_the_client_builds_cold(tiny_model_path: Path) -> None:
    """The client re-sends its history with the tool call's arguments in another key order (the
    same conversation to the session match, another text to the template): the render no longer
    starts with what the parent's anchor covered, so the build tokenizes it all and compares."""
    tokenizer = _tokenizer("tiny", tiny_model_path)
    builder = ContextBuilder(tokenizer)
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"a": 1, "b": 2}'}}
    messages = [Message(role="user", content="Read it.")]
    first = builder.build(messages, _TOOLS, None)
    output = tokenizer.encode('<tool_call>\n{"name": "read", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>')
    parent = _turn("t0", None, first, output, 1)
    second_messages = [
        *messages,
        Message.model_validate({"role": "assistant", "content": None, "tool_calls": [call]}),
        Message(role="tool", tool_call_id="c1", content="hello"),
    ]
    second = builder.build(second_messages, _TOOLS, parent)
    assert not second.cold
    child = _turn("t1", parent, second, tokenizer.encode("Done.<|im_end|>"), 3)
    reordered = dict(call, function={"name": "read", "arguments": '{"b": 2, "a": 1}'})
    third_messages = [
        *messages,
        Message.model_validate({"role": "assistant", "content": None, "tool_calls": [reordered]}),
        Message(role="tool", tool_call_id="c1", content="hello"),
        Message(role="assistant", content="Done."),
        Message(role="user", content="Thanks."),
    ]
    third = builder.build(third_messages, _TOOLS, child)
    cold = builder.build(third_messages, _TOOLS, replace(child, render_anchor=None))
    assert third.cold and third.prompt_ids == cold.prompt_ids
    assert third.matches_full_render == cold.matches_full_render
