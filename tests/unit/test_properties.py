"""Properties (hypothesis) of the parts every token and every message go through: the streaming
tool-call parser, the UTF-8-safe text assembler, and message fingerprints."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from stream_gateway.completion._fingerprint import message_fingerprint
from stream_gateway.completion._request import Message
from stream_gateway.completion._text import TextAssembler
from stream_gateway.tool_parsers import create_tool_parser, parse_tool_calls

PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# -- the tool-call parser --------------------------------------------------------------------------

names = st.sampled_from(["read", "bash", "write_file"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=3)


@st.composite
def tool_call_text(draw: st.DrawFn) -> str:
    call = {"name": draw(names), "arguments": draw(arguments)}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=draw(st.booleans())) + "\n</tool_call>"


pieces = st.one_of(
    st.text(alphabet=st.characters(blacklist_characters="<"), max_size=20),  # plain content
    tool_call_text(),
    st.sampled_from(["<tool_call>\n{not json}\n</tool_call>", "<tool_call>", "</tool_call>", "<tool", " \n ", "<"]),
)


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, Any]]]:
    parser = create_tool_parser("hermes")
    content = ""
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    for start, end in itertools.pairwise(points):
        content += parser.feed(text[start:end]).content
    content += parser.finish().content
    return content, [(c.name, json.loads(c.arguments)) for c in parser.calls]


@PROFILE
@given(st.lists(pieces, max_size=8).map("".join), st.lists(st.integers(0, 400), max_size=12))
def test_tool_parsing_does_not_depend_on_how_text_is_cut(text: str, cuts: list[int]) -> None:
    whole_content, whole_calls = parse_tool_calls(text)
    content, calls = _stream(text, cuts)
    assert content == whole_content
    assert calls == [(c.name, json.loads(c.arguments)) for c in whole_calls]


@PROFILE
@given(st.lists(tool_call_text(), min_size=1, max_size=4), st.lists(st.integers(0, 400), max_size=12))
def test_valid_calls_are_parsed_and_never_leak_into_content(calls: list[str], cuts: list[int]) -> None:
    text = "\n".join(calls)
    content, parsed = _stream(text, cuts)
    assert "<tool_call>" not in content and content.strip() == ""
    expected = [json.loads(c.split("\n")[1]) for c in calls]
    assert parsed == [(e["name"], e["arguments"]) for e in expected]


# -- the text assembler ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


texts = st.text(
    alphabet=st.characters(blacklist_categories=["Cs", "Cc"]) | st.sampled_from(["é", "日", "本", "🙂", "\n", " "]),
    max_size=40,
)


@PROFILE
@given(texts, st.lists(st.integers(1, 5), max_size=20))
def test_assembled_text_is_the_decoded_text_however_ids_arrive(tokenizer: Any, text: str, steps: list[int]) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = tokenizer.decode(ids)
    assembler = TextAssembler(tokenizer.backend_tokenizer)
    out, at = [], 0
    for size in [*steps, len(ids)]:
        chunk = ids[at : at + size]
        at += len(chunk)
        delta = assembler.feed(chunk)
        assert "\ufffd" not in delta.text or "\ufffd" in expected  # never half a character
        out.append(delta.text)
    out.append(assembler.flush())
    assert "".join(out) == expected


@PROFILE
@given(texts, st.text(alphabet="abc\n", min_size=1, max_size=3), st.lists(st.integers(1, 4), max_size=20))
def test_text_ends_right_before_the_first_stop_string(tokenizer: Any, text: str, stop: str, steps: list[int]) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = tokenizer.decode(ids)
    assembler = TextAssembler(tokenizer.backend_tokenizer, [stop])
    out, at, stopped = [], 0, False
    for size in [*steps, len(ids)]:
        delta = assembler.feed(ids[at : at + size])
        at += size
        out.append(delta.text)
        if delta.stopped:
            stopped = True
            break
    if not stopped:
        out.append(assembler.flush())
    cut = decoded.find(stop)
    assert stopped == (cut >= 0)
    assert "".join(out) == (decoded[:cut] if cut >= 0 else decoded)


# -- fingerprints ----------------------------------------------------------------------------------


@st.composite
def assistant_messages(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same assistant message as the gateway sent it and as an agent echoes it back."""
    content = draw(st.text(max_size=20))
    calls = draw(st.lists(st.tuples(names, arguments), max_size=2))
    sent = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [
            {"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
        or None,
    }
    keys_reversed = lambda a: dict(reversed(list(a.items())))  # noqa: E731
    echoed = {
        "role": "assistant",
        # as a list of parts or a string, with whitespace around, "" for None
        "content": draw(st.sampled_from([[{"type": "text", "text": f" {content}\n"}], f"{content}  ", content])),
        "tool_calls": [
            {
                "id": f"x_{i}-rewritten",
                "type": "function",
                "function": {
                    "name": n,
                    "arguments": json.dumps(keys_reversed(a), indent=draw(st.sampled_from([None, 2]))),
                },
            }
            for i, (n, a) in enumerate(calls)
        ]
        or None,
        "reasoning_content": draw(st.none() | st.text(max_size=5)),
    }
    return sent, echoed


@PROFILE
@given(assistant_messages())
def test_an_echoed_assistant_message_keeps_its_fingerprint(pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    sent, echoed = pair
    assert message_fingerprint(Message.model_validate(sent)) == message_fingerprint(Message.model_validate(echoed))


@PROFILE
@given(st.text(max_size=30), st.text(max_size=30), st.sampled_from(["system", "developer", "user"]))
def test_different_text_means_a_different_fingerprint(a: str, b: str, role: str) -> None:
    first = message_fingerprint(Message(role=role, content=a))  # type: ignore[arg-type]
    second = message_fingerprint(Message(role="system" if role == "developer" else role, content=b))  # type: ignore[arg-type]
    assert (first == second) == (a.strip() == b.strip())
