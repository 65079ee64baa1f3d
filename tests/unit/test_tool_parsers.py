"""Tool-call parsing: whole text and every way of streaming it agree; bad calls become content."""

from __future__ import annotations

import random

import orjson
import pytest

from stream_gateway.tool_parsers import (
    TOOL_PARSERS,
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    create_tool_parser,
    parse_tool_calls,
)

READ = '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'
BASH = '<tool_call>{"name":"bash","arguments":{"command":"ls -l"}}</tool_call>'


def stream(chunks: list[str], tool_names: frozenset[str] | None = None) -> tuple[list[ParsedDelta], list[ToolCall]]:
    parser = create_tool_parser("hermes", tool_names)
    deltas = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    return deltas, parser.calls


def named(calls: list[ToolCall]) -> list[tuple[str, object]]:
    """Calls without their random ids."""
    return [(call.name, orjson.loads(call.arguments)) for call in calls]


def streamed_result(chunks: list[str]) -> tuple[str, list[tuple[str, object]], list[ToolCallDelta]]:
    deltas, calls = stream(chunks)
    tool_deltas = [d for delta in deltas for d in delta.tool_calls]
    return "".join(d.content for d in deltas), named(calls), tool_deltas


def test_single_call() -> None:
    content, calls = parse_tool_calls(READ)
    assert content == ""
    assert len(calls) == 1
    assert calls[0].name == "read"
    assert calls[0].arguments == '{"path":"a.txt"}'


def test_parallel_calls_stream_with_distinct_ids_and_indexes() -> None:
    deltas, calls = stream([READ + "\n" + BASH])
    assert [c.name for c in calls] == ["read", "bash"]
    assert calls[0].id != calls[1].id
    sent = deltas[0].tool_calls
    assert sent == (
        ToolCallDelta(0, calls[0].id, "read", ""),
        ToolCallDelta(0, None, None, '{"path":"a.txt"}'),
        ToolCallDelta(1, calls[1].id, "bash", ""),
        ToolCallDelta(1, None, None, '{"command":"ls -l"}'),
    )
    assert deltas[0].content == ""


def test_content_before_between_and_after_calls() -> None:
    text = "Let me look.\n\n" + READ + "\nand\n" + BASH + "\n\nDone.\n"
    content, calls = parse_tool_calls(text)
    # The whitespace run on each side of a valid call goes; the rest is kept verbatim.
    assert content == "Let me look.andDone.\n"
    assert named(calls) == [("read", {"path": "a.txt"}), ("bash", {"command": "ls -l"})]


def test_text_without_calls_is_untouched() -> None:
    text = "  a < b, <tool> and <tool_callx> are not calls \n\n"
    assert parse_tool_calls(text) == (text, [])
    assert streamed_result(list(text))[0] == text


TEXTS = [
    "Let me look.\n" + READ + "\n" + BASH + "\nDone.",
    "  <tool_c" + READ + "<tool_call>{bad}</tool_call>\n\n x <tool_cake> y\n",
    "héllo 😀 " + '<tool_call>{"name": "w", "arguments": "{\\"t\\": \\"東京 😀\\"}"}</tool_call>' + "\t <tool_call>{",
    READ + READ + "\n",
]


@pytest.mark.parametrize("text", TEXTS)
def test_every_split_matches_whole_text(text: str) -> None:
    content, calls = parse_tool_calls(text)
    whole = (content, named(calls))
    # Char by char, and every place a single split can fall.
    assert streamed_result(list(text))[:2] == whole
    for cut in range(len(text) + 1):
        assert streamed_result([text[:cut], text[cut:]])[:2] == whole
    rng = random.Random(1234)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(1, 8)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed_result(chunks)[:2] == whole


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_follow_the_openai_shape(text: str) -> None:
    _, calls, tool_deltas = streamed_result(list(text))
    assert len(tool_deltas) == 2 * len(calls)
    for index, (first, rest) in enumerate(zip(tool_deltas[::2], tool_deltas[1::2], strict=True)):
        assert (first.index, rest.index) == (index, index)
        assert first.id and first.name and first.arguments == ""
        assert rest.id is None and rest.name is None and orjson.loads(rest.arguments) == calls[index][1]


def test_partial_start_tag_is_held_then_released() -> None:
    parser = create_tool_parser("hermes", None)
    assert parser.feed("see <tool_c") == ParsedDelta("see")
    assert parser.feed("ake> now") == ParsedDelta(" <tool_cake> now")
    assert parser.feed(" <") == ParsedDelta("")
    assert parser.finish() == ParsedDelta(" <")


def test_content_streams_before_the_call_completes() -> None:
    parser = create_tool_parser("hermes", None)
    assert parser.feed("Sure.\n<tool_call>\n") == ParsedDelta("Sure.")
    assert parser.feed('{"name": "read", "arguments": {}}') == ParsedDelta("")
    delta = parser.feed("\n</tool_call>\n")
    assert delta.content == ""
    assert [d.name for d in delta.tool_calls] == ["read", None]
    assert parser.finish() == ParsedDelta("")


@pytest.mark.parametrize(
    "body",
    [
        "{bad json}",
        '{"arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": [1]}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": "[1, 2]"}',
        '["f", {}]',
        "",
    ],
)
def test_malformed_call_is_the_original_text_as_content(body: str) -> None:
    text = "Try:\n <tool_call>\n" + body + "\n</tool_call>\n"
    assert parse_tool_calls(text) == (text, [])
    assert streamed_result(list(text))[:2] == (text, [])


def test_malformed_call_next_to_a_valid_one() -> None:
    bad = "<tool_call>{nope}</tool_call>"
    content, calls = parse_tool_calls(bad + "\n" + READ + "\n" + bad)
    assert content == bad + bad
    assert named(calls) == [("read", {"path": "a.txt"})]


def test_unterminated_call_is_content_at_finish() -> None:
    text = 'Hi\n<tool_call>\n{"name": "read", "arguments": {"path": "a'
    parser = create_tool_parser("hermes", None)
    assert parser.feed(text) == ParsedDelta("Hi")
    assert parser.finish() == ParsedDelta(text[2:])
    assert parser.calls == []


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('"{\\"path\\": \\"a.txt\\", \\"n\\": 2}"', '{"path":"a.txt","n":2}'),
        ('{"path": "a.txt", "n": 2}', '{"path":"a.txt","n":2}'),
        ("null", "{}"),
    ],
)
def test_arguments_are_compact_json_objects(arguments: str, expected: str) -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "read", "arguments": ' + arguments + "}</tool_call>")
    assert calls[0].arguments == expected


def test_missing_arguments_are_empty() -> None:
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')[1][0].arguments == "{}"


def test_unknown_tool_name_is_content_when_tool_names_are_given() -> None:
    text = READ + "\n" + BASH
    content, calls = parse_tool_calls(text, tool_names=frozenset({"bash"}))
    assert content == READ  # the whitespace before the valid call still goes with it
    assert [c.name for c in calls] == ["bash"]
    assert parse_tool_calls(text, tool_names=frozenset())[1] == []
    assert len(parse_tool_calls(text, tool_names=None)[1]) == 2


def test_ids_are_alphanumeric_and_unique() -> None:
    _, calls = parse_tool_calls(READ * 50)
    ids = [call.id for call in calls]
    assert len(set(ids)) == 50
    assert all(i.isascii() and i.isalnum() and i.startswith("call") and len(i) == 28 for i in ids)


def test_unicode_in_arguments_survives() -> None:
    value = '東京 😀 café \\ "quoted" \n </b>'
    text = "<tool_call>" + orjson.dumps({"name": "write", "arguments": {"text": value}}).decode() + "</tool_call>"
    _, calls = parse_tool_calls(text)
    assert orjson.loads(calls[0].arguments) == {"text": value}
    assert "東京 😀" in calls[0].arguments  # not \u-escaped
    assert named(stream(list(text))[1]) == [("write", {"text": value})]


def test_registry() -> None:
    assert {"hermes", "qwen"} <= set(TOOL_PARSERS)
    assert parse_tool_calls(READ, "qwen")[1][0].name == "read"
    with pytest.raises(ValueError, match="available: hermes, qwen"):
        create_tool_parser("nope", None)
