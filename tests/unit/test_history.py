"""Kept request histories (completion/_history.py, completion/_kept.py): a chat body that repeats a
kept one's bytes and appends messages reads only those, and the request it gives is the one a whole
read gives; every other body (re-serialised, edited, a duplicate key, the legacy shape, an error) is
read whole, with the whole read's errors; the kept bytes stay under their bound. What a request
derives through its ``KeptHistory`` is read for the messages it adds alone, counted by the store."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import orjson
import pytest

from stream_gateway._errors import GatewayError
from stream_gateway.completion import (
    ChatCompletionRequest,
    Histories,
    KeptHistory,
    conversation_keys,
    message_fingerprint,
    prefix_keys,
)
from stream_gateway.completion import tools_fingerprint as tools_key
from stream_gateway.http import decode_body

_READ = partial(decode_body, model=ChatCompletionRequest)
_PARSE = ChatCompletionRequest
_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _messages(turns: int) -> list[dict[str, Any]]:
    """An agent's conversation: tool calls, tool results holding JSON-ish text, brackets and quotes."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                      {"role": "user", "content": "Fix the build."}]  # fmt: skip
    for i in range(turns):
        call = {"id": f"c{i}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "f{i}"}}'}}
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        text = f'{{"messages": [{i}], "x": "]}}\\"", "y": "\u00e9\\u00e9"}}\n' + "line ] } [ {\n" * 200
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": text})
    return messages


def _body(messages: list[dict[str, Any]], **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 64, **fields})


def _same(a: ChatCompletionRequest, b: ChatCompletionRequest) -> None:
    assert a.model_dump() == b.model_dump()


def test_a_continuing_body_reads_only_what_it_adds() -> None:
    histories = Histories(1 << 30, decode_body)
    messages = _messages(3)
    first = histories.parse(_body(messages, tools=_TOOLS), _PARSE)
    history = KeptHistory.of(first)
    assert history.kept and not history.continued and histories.statistics().misses == 1
    conversation_keys(first)
    earlier = first
    for turn in range(3, 8):
        messages = _messages(turn + 1)
        raw = _body(messages, tools=_TOOLS)
        body = histories.parse(raw, _PARSE)
        _same(body, _READ(raw))
        history = KeptHistory.of(body)
        assert history.continued and history.reused == 2 + 2 * turn
        # The very objects, not parsed again (all the earlier body's: its last message repeated too).
        assert all(a is b for a, b in zip(body.messages[: history.reused], earlier.messages, strict=False))
        before = histories.statistics()
        keys = conversation_keys(body)  # the kept keys extended: the same as computing them all
        assert keys == prefix_keys(tools_key(body.tools), [message_fingerprint(m) for m in body.messages])
        after = histories.statistics()  # ... and only the two new messages fingerprinted
        assert after.reads[("keyed", "delta")] - before.reads.get(("keyed", "delta"), 0) == 1
        assert after.items["keyed"] - before.items["keyed"] == 2
        earlier = body
    stats = histories.statistics()
    assert stats.hits == 5 and stats.entries == len(histories) == 1  # one conversation, one history kept
    assert ("keyed", "whole") in stats.reads and stats.reads[("keyed", "whole")] == 1  # the first body's


@pytest.mark.parametrize(
    "layout",
    ["messages first", "tools before messages", "pretty-printed", "spaces after commas"],
)
def test_any_layout_a_client_keeps_from_turn_to_turn_continues(layout: str) -> None:
    histories = Histories(1 << 30, decode_body)

    def dump(messages: list[dict[str, Any]]) -> bytes:
        if layout == "messages first":
            return json.dumps({"messages": messages, "model": "m", "tools": _TOOLS}, ensure_ascii=False).encode()
        if layout == "tools before messages":
            return orjson.dumps({"model": "m", "tools": _TOOLS, "stream": True, "messages": messages})
        if layout == "pretty-printed":
            return json.dumps({"model": "m", "messages": messages}, indent=2).encode()
        return json.dumps({"model": "m", "messages": messages, "n": 1}).encode()

    histories.parse(dump(_messages(3)), _PARSE)
    raw = dump(_messages(4))
    body = histories.parse(raw, _PARSE)
    _same(body, _READ(raw))
    assert histories.statistics().hits == 1


def test_a_re_serialised_or_edited_history_is_read_whole() -> None:
    histories = Histories(1 << 30, decode_body)
    messages = _messages(3)
    histories.parse(_body(messages), _PARSE)
    edited = [*messages[:3], {**messages[3], "content": "changed"}, *_messages(4)[4:]]
    for raw in (
        json.dumps({"model": "m", "messages": _messages(4), "max_tokens": 64}).encode(),  # other spacing
        _body(edited),
    ):
        body = histories.parse(raw, _PARSE)
        _same(body, _READ(raw))
        assert not KeptHistory.of(body).continued
    assert histories.statistics().hits == 0


def test_the_latest_messages_may_differ() -> None:
    """A retry (nothing appended) or a latest message whose bytes changed (a client's cache mark
    moved to the new last message): the messages before it are still reused."""
    histories = Histories(1 << 30, decode_body)
    messages = _messages(3)
    histories.parse(_body(messages), _PARSE)
    retry = histories.parse(_body(messages), _PARSE)
    _same(retry, _READ(_body(messages)))
    assert KeptHistory.of(retry).reused == len(messages) - 1
    marked = [*messages[:-1], {**messages[-1], "cache_control": {"type": "ephemeral"}}, *_messages(4)[-2:]]
    raw = _body(marked)
    body = histories.parse(raw, _PARSE)
    _same(body, _READ(raw))
    assert KeptHistory.of(body).reused == len(messages) - 1
    assert histories.statistics().hits == 2


def test_a_later_duplicate_messages_key_is_what_the_parser_keeps() -> None:
    histories = Histories(1 << 30, decode_body)
    messages = _messages(3)
    histories.parse(_body(messages), _PARSE)
    whole = _body(_messages(4))
    raw = whole[:-1] + b',"messages":[{"role":"user","content":"only this"}]}'
    body = histories.parse(raw, _PARSE)
    _same(body, _READ(raw))
    assert [m.content for m in body.messages] == ["only this"]


def test_the_legacy_functions_shape_is_read_whole() -> None:
    histories = Histories(1 << 30, decode_body)
    functions = [{"name": "read", "parameters": {"type": "object"}}]
    messages = _messages(3)
    histories.parse(_body(messages, functions=functions), _PARSE)
    longer = [*messages, {"role": "assistant", "content": None, "function_call": {"name": "read", "arguments": "{}"}},
              {"role": "function", "name": "read", "content": "text " * 800}]  # fmt: skip
    raw = _body(longer, functions=functions)
    body = histories.parse(raw, _PARSE)
    _same(body, _READ(raw))
    assert body.legacy_functions and histories.statistics().hits == 0


def test_a_bad_new_message_gets_the_whole_reads_error() -> None:
    """The error names the message's place in the whole array, as without kept histories."""
    histories = Histories(1 << 30, decode_body)
    messages = _messages(3)
    histories.parse(_body(messages), _PARSE)
    raw = _body([*messages, {"role": "assistant", "content": "ok"}, {"role": "user"}])
    with pytest.raises(GatewayError) as kept:
        histories.parse(raw, _PARSE)
    with pytest.raises(GatewayError) as whole:
        _READ(raw)
    assert kept.value.body() == whole.value.body()
    assert f"messages[{len(messages) + 1}]" in str(kept.value.body())


def test_small_bodies_and_a_zero_budget_keep_nothing() -> None:
    for budget, messages in ((1 << 30, [{"role": "user", "content": "hi"}]), (0, _messages(4))):
        histories = Histories(budget, decode_body)
        body = histories.parse(_body(messages), _PARSE)
        assert not KeptHistory.of(body).kept and len(histories) == 0


def test_kept_bytes_stay_under_the_budget() -> None:
    one = len(_body(_messages(3)))
    histories = Histories(5 * one, decode_body)
    for conversation in range(6):
        messages = _messages(3)
        messages[1] = {"role": "user", "content": f"task {conversation}"}
        histories.parse(_body(messages), _PARSE)
        assert histories.held_bytes <= histories.budget
    assert 0 < len(histories) < 6  # the least recently used went first
    messages = _messages(3)
    messages[1] = {"role": "user", "content": "task 5"}
    longer = [*messages, *_messages(4)[-2:]]
    assert KeptHistory.of(histories.parse(_body(longer), _PARSE)).continued  # the latest is still kept


def _anthropic(turns: int) -> list[dict[str, Any]]:
    """A Claude Code-shaped conversation: tool_use and tool_result blocks, the cache mark on the
    last message's last block (it moves every turn), a mid-conversation system message."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix the build."}]}]
    for i in range(turns):
        if i == 1:
            messages.append({"role": "system", "content": "Agent types: general, explore."})
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "Read", "input": {"file_path": f"/src/f{i}.py"}}
        messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Reading f{i}."}, use]})
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"line {i} ]}}\n" * 300}
        messages.append({"role": "user", "content": [result]})
    last = messages[-1]["content"][-1]
    messages[-1] = {**messages[-1], "content": [{**last, "cache_control": {"type": "ephemeral"}}]}
    return messages


def test_an_anthropic_conversation_translates_only_what_it_adds() -> None:
    """Messages bodies (Claude Code's): the repeated messages' chat translation is reused, the
    moved cache mark notwithstanding, and the chat request equals a whole translation."""
    from stream_gateway.protocols._anthropic import MessagesRequest, to_chat_request

    histories = Histories(1 << 30, decode_body)
    system = [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    tools = [{"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}]

    def raw(turns: int) -> bytes:
        body = {"model": "m", "messages": _anthropic(turns), "system": system, "tools": tools, "max_tokens": 64}
        return orjson.dumps(body)

    first = to_chat_request(histories.parse(raw(2), MessagesRequest))
    conversation_keys(first)
    earlier = first
    for turns in range(3, 7):
        body = histories.parse(raw(turns), MessagesRequest)
        chat = to_chat_request(body)
        whole = to_chat_request(decode_body(raw(turns), MessagesRequest))
        assert chat.model_dump() == whole.model_dump()
        history = KeptHistory.of(chat)
        assert history.continued
        assert history.reused == len(whole.messages) - 3  # all but the marked message and the two added
        assert all(a is b for a, b in zip(chat.messages[: history.reused], earlier.messages, strict=False))
        keys = conversation_keys(chat)
        assert keys == prefix_keys(tools_key(chat.tools), [message_fingerprint(m) for m in chat.messages])
        earlier = chat
    stats = histories.statistics()
    assert stats.hits == 4 and stats.reads[("translated", "delta")] == 4 and stats.reads[("keyed", "delta")] == 4
    assert stats.items["translated"] == len(_anthropic(2)) + 4 * 3  # the first body whole, then three a turn


def _codex(turns: int) -> list[dict[str, Any]]:
    """A Codex-shaped Responses input: a user message, then per turn a reasoning item, an assistant
    message, function calls (joining that message's turn) and their outputs."""
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix the build."}]}
    ]
    for i in range(turns):
        items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": f"thinking {i}"}]})
        items.append(
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"on it {i}"}]}
        )
        for j in range(2):
            items.append(
                {"type": "function_call", "call_id": f"c{i}{j}", "name": "shell", "arguments": '{"cmd": ["ls"]}'}
            )
        for j in range(2):
            items.append({"type": "function_call_output", "call_id": f"c{i}{j}", "output": f"out {i} ]}}\n" * 200})
    return items


def test_a_responses_conversation_translates_only_what_it_adds() -> None:
    """Responses bodies (Codex's): the items repeated up to a boundary nothing crosses keep their
    chat messages, and the chat request equals a whole translation."""
    from stream_gateway.protocols._responses import ResponsesRequest, _conversation, to_chat_request

    histories = Histories(1 << 30, decode_body)
    tools = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]

    def raw(turns: int) -> bytes:
        return orjson.dumps({"model": "m", "input": _codex(turns), "instructions": "You are Codex.", "tools": tools})

    first = to_chat_request(histories.parse(raw(2), ResponsesRequest, "input"))
    conversation_keys(first)
    _conversation(first)
    earlier = first
    for turns in range(3, 7):
        body = histories.parse(raw(turns), ResponsesRequest, "input")
        chat = to_chat_request(body)
        whole = to_chat_request(decode_body(raw(turns), ResponsesRequest))
        assert chat.model_dump() == whole.model_dump()
        history = KeptHistory.of(chat)
        assert history.continued
        assert history.reused == len(whole.messages) - 3  # all but the added turn: an assistant and two tool results
        assert all(a is b for a, b in zip(chat.messages[: history.reused], earlier.messages, strict=False))
        assert conversation_keys(chat) == prefix_keys(
            tools_key(chat.tools), [message_fingerprint(m) for m in chat.messages]
        )
        assert _conversation(chat) == [m.model_dump(exclude_none=True) for m in whole.messages]
        earlier = chat
    stats = histories.statistics()
    assert stats.hits == 4 and stats.reads[("translated", "delta")] == 4 and stats.reads[("stored", "delta")] == 4


def _prompt_body(ids: list[int], *, spaced: bool = False, **fields: Any) -> bytes:
    body = {"model": "m", "prompt": ids, "max_tokens": 16, **fields}
    return json.dumps(body).encode() if spaced else orjson.dumps(body)


def test_a_token_in_rollout_reads_only_the_ids_it_adds() -> None:
    """``/v1/completions`` with prompt ids: the next prompt repeats the last one's bytes through its
    last id, then ``,`` and the ids sampled and added; only those are parsed, the kept list is put
    back in front, and the request equals a whole read (the Python SDK's ``, `` spacing too)."""
    from stream_gateway.protocols._token_in import CompletionRequest

    read = partial(decode_body, model=CompletionRequest)
    for spaced in (False, True):
        histories = Histories(1 << 30, decode_body)
        ids = [(7 * i) % 1999 for i in range(3000)]
        first = histories.parse(_prompt_body(ids, spaced=spaced), CompletionRequest, "prompt")
        assert KeptHistory.of(first).kept
        for turn in range(4):
            ids = ids + [(11 * turn + j) % 1999 for j in range(500)]
            raw = _prompt_body(ids, spaced=spaced, seed=turn)  # fields after the prompt may change
            body = histories.parse(raw, CompletionRequest, "prompt")
            assert body.model_dump() == read(raw).model_dump()
            history = KeptHistory.of(body)
            assert history.continued and history.kept and history.reused == len(ids) - 500
        stats = histories.statistics()
        assert (stats.hits, stats.misses) == (4, 1)
        assert stats.items["parsed"] == 3000 + 4 * 500  # the first prompt's ids, then each turn's 500 alone


def test_token_in_bodies_that_cannot_be_spliced_are_read_whole() -> None:
    from stream_gateway.protocols._token_in import CompletionRequest

    histories = Histories(1 << 30, decode_body)
    ids = list(range(1, 2000))
    histories.parse(_prompt_body(ids), CompletionRequest, "prompt")
    # A string after the kept ids: the whole read's error, naming the whole prompt.
    raw = _prompt_body(ids).replace(b"1999]", b'1999,"x"]', 1)
    with pytest.raises(GatewayError):
        histories.parse(raw, CompletionRequest, "prompt")
    # A nested list after them: the same.
    with pytest.raises(GatewayError):
        histories.parse(_prompt_body(ids).replace(b"1999]", b"1999,[5]]", 1), CompletionRequest, "prompt")
    # A second "prompt" key after the array: what a JSON parser keeps is the later one, so whole.
    raw = _prompt_body([*ids, 5])[:-1] + b',"prompt":[3]}'
    assert histories.parse(raw, CompletionRequest, "prompt").prompt == [3]
    # A batch of prompts is never kept; a text prompt neither.
    batch = histories.parse(orjson.dumps({"model": "m", "prompt": [ids, ids]}), CompletionRequest, "prompt")
    assert not KeptHistory.of(batch).kept
    text = histories.parse(orjson.dumps({"model": "m", "prompt": "word " * 2000}), CompletionRequest, "prompt")
    assert not KeptHistory.of(text).kept
    # And the kept rollout still continues afterwards.
    body = histories.parse(_prompt_body([*ids, 9, 8]), CompletionRequest, "prompt")
    assert body.prompt == [*ids, 9, 8] and KeptHistory.of(body).continued
