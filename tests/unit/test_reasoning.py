"""The reasoning component without a server: the token-aligned split, streamed thinking text,
signatures, the automatic choice of format, and the split's stream equalling the whole-output one."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stream_gateway.completion._thinking import ThinkingStream
from stream_gateway.constraints import Constraint, TokenMask, grammar_tokenizer, response_format_constraint
from stream_gateway.models._tiny_reasoning import TINY_REASONING_CHAT_TEMPLATE
from stream_gateway.reasoning import (
    ReasoningFormat,
    ThinkingSigner,
    ThoughtText,
    resolve_reasoning_format,
    split_thinking,
)

START, END = 9001, 9002
QWEN3 = ReasoningFormat("qwen3", START, END)
R1 = ReasoningFormat("deepseek_r1", START, END)


@pytest.fixture(scope="module")
def thinking_tokenizer(tiny_model_path: Path) -> PreTrainedTokenizerBase:
    """tiny's tokenizer with <think> and </think> added as single tokens."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.mark.parametrize(
    ("fmt", "prompt", "output", "expected"),
    [
        (QWEN3, [1, 2], [START, 5, 6, END, 7, 8], (4, 4)),  # opens and closes its block
        (QWEN3, [1, 2], [7, 8], (0, 0)),  # never thinks: all answer
        (QWEN3, [1, START], [5, 6, END, 7], (3, 3)),  # the template opened the block
        (QWEN3, [1, START, 3, END], [7, 8], (0, 0)),  # enable_thinking=false: closed in the prompt
        (QWEN3, [1, 2], [START, 5, 6], (3, None)),  # cut by max_tokens inside thinking
        (QWEN3, [START, 4, END, 1], [START, END, 7], (2, 2)),  # earlier turns' thinking in the prompt
        (R1, [1, 2], [5, 6, END, 7], (3, 3)),  # R1 thinks from the first token
        (R1, [1, START, 3, END], [7, 8], (0, 0)),
        (QWEN3, [1, 2], [], (0, None)),  # nothing sampled yet: pending, no answer token
    ],
)
def test_split_is_token_aligned(
    fmt: ReasoningFormat, prompt: list[int], output: list[int], expected: tuple[int, int | None]
) -> None:
    assert split_thinking(fmt, prompt, output) == expected


def test_split_is_the_same_however_the_output_is_chunked() -> None:
    rng = random.Random(7)
    for _ in range(300):
        output = [rng.choice([START, END, 3, 4, 5]) for _ in range(rng.randint(0, 12))]
        prompt = [rng.choice([START, END, 1]) for _ in range(rng.randint(0, 3))]
        whole = split_thinking(QWEN3, prompt, output)
        tracker = QWEN3.tracker(prompt)
        taken = 0
        while taken < len(output):
            step = output[taken : taken + rng.randint(1, 4)]
            cut = tracker.feed(step)
            assert 0 <= cut <= len(step)
            taken += len(step)
        assert (tracker.reasoning_tokens, tracker.answer_start) == whole


def test_thought_text_drops_the_template_newlines_only() -> None:
    text = ThoughtText()
    pieces = [text.feed(p) for p in ["\n", "I will", " read it.\n", "\nThen", " answer.\n"]]
    assert "".join(pieces) == "I will read it.\n\nThen answer."  # inner newlines kept, outer ones dropped


def test_thinking_stream_splits_text_by_token(thinking_tokenizer: PreTrainedTokenizerBase) -> None:
    tok = thinking_tokenizer
    fmt = resolve_reasoning_format("qwen3", tok)
    assert fmt is not None
    sampled = "<think>\nThe user wants a file.\n</think>\n\nDone: I read it.<|im_end|>"
    ids = tok.encode(sampled, add_special_tokens=False)
    stream = ThinkingStream(
        fmt, tok.encode("<|im_start|>assistant\n", add_special_tokens=False), tok.backend_tokenizer, True
    )
    from stream_gateway.completion._text import TextAssembler

    answer = TextAssembler(tok.backend_tokenizer)
    thought, text = [], []
    for i in range(0, len(ids), 2):  # two ids a step: a step may straddle </think>
        piece, rest = stream.feed(ids[i : i + 2]) if stream.active else ("", ids[i : i + 2])
        thought.append(piece)
        text.append(stream.answer(answer.feed(rest).text))
    assert "".join(thought) == "The user wants a file."
    assert "".join(text) == "Done: I read it."
    end = ids.index(tok.convert_tokens_to_ids("</think>"))
    assert ThinkingStream.span_of(stream) == (end + 1, end + 1)


def test_signatures_recognise_our_own_thinking() -> None:
    signer = ThinkingSigner(b"k" * 32)
    signature = signer.sign("msg_1", "a thought")
    assert signer.check(signature, "a thought") == "ours"
    assert signer.check(signature, "another thought") == "modified"
    assert ThinkingSigner(b"x" * 32).check(signature, "a thought") == "modified"  # another deployment's key
    assert signer.check("EqQBCkYIARgCKkBAnthropicsOwn", "a thought") == "foreign"
    mac = signer.start("msg_1")
    for part in ("a ", "thought"):
        mac.update(part.encode())
    assert ThinkingSigner.finish("msg_1", mac) == signature  # streamed == whole
    with pytest.raises(ValueError, match="16 bytes"):
        ThinkingSigner(b"short")


def test_auto_choice_needs_single_tokens_and_a_template_that_thinks(
    thinking_tokenizer: PreTrainedTokenizerBase, tiny_model_path: Path
) -> None:
    plain = AutoTokenizer.from_pretrained(tiny_model_path)
    assert resolve_reasoning_format("auto", plain) is None  # tiny has no think tokens
    with pytest.raises(ValueError, match="single tokens"):
        resolve_reasoning_format("qwen3", plain)
    assert resolve_reasoning_format("none", thinking_tokenizer) is None
    # Tokens but a template that never mentions </think>: ambiguous, so none.
    assert resolve_reasoning_format("auto", thinking_tokenizer) is None
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ '</think>' if false }}"
    chosen = resolve_reasoning_format("auto", tok)
    assert chosen is not None and chosen.name == "qwen3"
    tok.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<think>\n{% endif %}{# </think> #}"
    )
    chosen = resolve_reasoning_format("auto", tok)
    assert chosen is not None and chosen.name == "deepseek_r1"


# -- the history policy, on a Qwen3-style template, without a model ------------------------------

# tiny-reasoning's chat template (Qwen3's rules): an assistant turn after the last user query keeps
# its thinking when it has some or is the last message; earlier turns are rendered without it.
QWEN3_STYLE_TEMPLATE = TINY_REASONING_CHAT_TEMPLATE


def _builder_and_turns(tokenizer: PreTrainedTokenizerBase, history: str) -> tuple[Any, list[Any]]:
    from stream_gateway.completion._context import ContextBuilder

    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    fmt = resolve_reasoning_format("auto", tokenizer)
    assert fmt is not None and fmt.name == "qwen3"
    return ContextBuilder(tokenizer, fmt, history), [fmt]


def _turn(turn_id: str, parent: Any, prompt: list[int], output: list[int], context_length: int, fmt: Any) -> Any:
    from stream_gateway.sessions import Turn

    thinking, answer = split_thinking(fmt, prompt, output)
    return Turn(
        turn_id=turn_id, session_id="s", parent_id=parent.turn_id if parent else None, key=None,
        context_length=context_length, prompt_ids=tuple(prompt), reused_prompt_tokens=0,
        output_ids=tuple(output), logprobs=tuple([0.0] * len(output)), finish_reason="stop", content="",
        tool_calls=(), policy_version=0, policy_versions=((0, 0),), created_at=0.0,
        time_to_first_token_s=None, duration_s=0.0, matches_full_render=True, fallback_reason=None,
        reasoning_tokens=thinking, answer_start=answer,
    )  # fmt: skip


@pytest.mark.parametrize("history", ["keep", "template"])
@pytest.mark.parametrize("echo", ["dropped", "echoed", "summarised"])
def test_history_policy_decides_the_roots(tiny_model_path: Path, history: str, echo: str) -> None:
    from stream_gateway.completion._request import Message, Tool

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.add_tokens(["<think>", "</think>"])
    builder, [fmt] = _builder_and_turns(tok, history)
    tools = [Tool.model_validate({"type": "function", "function": {"name": "read", "parameters": {}}})]
    call = '<tool_call>\n{"name": "read", "arguments": {"path": "README.md"}}\n</tool_call>'
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731

    def assistant(thought: str, content: str | None, calls: bool) -> Message:
        fields: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            fields["tool_calls"] = [{"id": "c1", "function": {"name": "read", "arguments": '{"path":"README.md"}'}}]
        if echo == "echoed":
            fields["reasoning_content"] = thought
        elif echo == "summarised":
            fields["reasoning_content"] = "(a summary)"
        return Message.model_validate(fields)

    messages = [Message(role="user", content="What is in this repo?")]
    first = builder.build(messages, tools, None)
    turn1 = _turn(
        "t1", None, first.prompt_ids, encode(f"<think>\nI should read it.\n</think>\n\n{call}<|im_end|>"), 1, fmt
    )
    messages += [assistant("I should read it.", None, True), Message(role="tool", tool_call_id="c1", content="hi")]
    second = builder.build(messages, tools, turn1, {1: turn1})
    # Within the tool loop both policies continue, and the template agrees with what was sampled.
    assert second.parent is turn1 and second.fallback_reason is None
    assert second.prompt_ids[: second.reused_prompt_tokens] == [*turn1.prompt_ids, *turn1.output_ids]
    assert second.matches_full_render
    turn2 = _turn("t2", turn1, second.prompt_ids, encode("<think>\nI have it.\n</think>\n\nDone.<|im_end|>"), 3, fmt)
    messages += [assistant("I have it.", "Done.", False), Message(role="user", content="And now?")]
    third = builder.build(messages, tools, turn2, {1: turn1, 3: turn2})
    if history == "keep":
        assert third.parent is turn2 and third.fallback_reason is None
        assert third.prompt_ids[: third.reused_prompt_tokens] == [*turn2.prompt_ids, *turn2.output_ids]
        assert third.prompt_ids[third.reused_prompt_tokens :] == encode(
            "\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"
        )
        assert not third.matches_full_render  # the template would have dropped the earlier thinking
    else:
        assert third.parent is None and third.predecessor is turn2
        assert third.fallback_reason is not None and third.fallback_reason.startswith("reasoning_history=template")
        assert third.matches_full_render
        assert "<think>" not in tok.decode(third.prompt_ids)  # earlier thinking stripped, as rendered


def _accepts(constraint: Constraint, tok: PreTrainedTokenizerBase, ids: list[int]) -> bool:
    """Whether the grammar allows ``ids`` and then the end of the turn."""
    mask = TokenMask(constraint, grammar_tokenizer(tok, len(tok), [tok.eos_token_id]), len(tok))
    for token in [*ids, tok.eos_token_id]:
        if not mask.allowed()[token]:
            return False
        mask.advance(token)
    return True


def test_a_constraint_holds_the_answer_and_leaves_the_thinking_free(
    thinking_tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Forced output on a thinking model: the block comes first, free, then what was asked for."""
    tok = thinking_tokenizer
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    answer = response_format_constraint({"type": "json_object"})
    assert answer is not None
    qwen3 = answer.after_thinking(start, end, opened=False)
    r1 = answer.after_thinking(start, end, opened=True)
    thought = ids('Any text, {"even": "json"} and newlines\n\n')
    assert _accepts(qwen3, tok, [start, *thought, end, *ids('\n\n{"a": 1}')])
    assert _accepts(qwen3, tok, ids('{"a": 1}'))  # the block is optional when the prompt did not open it
    assert not _accepts(qwen3, tok, [*thought, end, *ids('{"a": 1}')])  # no closing tag without an opening one
    assert not _accepts(qwen3, tok, [start, *thought, end, *ids("not json")])  # the answer is held
    assert not _accepts(qwen3, tok, [start, *thought])  # nor may the turn end inside the block
    assert _accepts(r1, tok, [*thought, end, *ids('{"a": 1}')])  # the prompt opened it: output starts inside
    assert not _accepts(r1, tok, ids('{"a": 1}')) and not _accepts(r1, tok, [start, *thought, end, *ids("{}")])
    assert _accepts(answer, tok, ids('{"a": 1}')) and not _accepts(answer, tok, [start, *thought, end, *ids("{}")])
