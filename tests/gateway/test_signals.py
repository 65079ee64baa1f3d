"""Implicit signals in the session tree (issue 57): a regenerate, an edit and a failed tool call,
through a real gateway (the scripted engine on the untrained tiny model, ``agent_gateway``) and the
official OpenAI and Anthropic clients, each shown on the turn it concerns in ``GET /sessions/{id}``.
The pipeline's side (events, trajectories, the batch, ``abandoned``) is tests/e2e/test_signals.py."""

from __future__ import annotations

import secrets
from typing import Any

import anthropic
import httpx
from openai import OpenAI

from ..support.agent_loop import READ_TOOL
from ..support.servers import RunningGateway

KEY = "sk-signals"
ASK_README = "What does the README say?"
READ_SCHEMA: Any = READ_TOOL["function"]["parameters"]  # type: ignore[index]


def _client(gateway: RunningGateway, session: str) -> OpenAI:
    return OpenAI(base_url=gateway.base_url + "/v1", api_key=KEY, default_headers={"x-session-id": session},
                  timeout=60, max_retries=0)  # fmt: skip


def _signals(gateway: RunningGateway, session: str, key: str = KEY) -> list[list[str]]:
    """Each turn's signals, in the order the turns were made."""
    body = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": f"Bearer {key}"},
                     timeout=10).json()  # fmt: skip
    turns = sorted(body["turns"], key=lambda t: t["created_at"])
    return [t["signals"] for t in turns]


def _session() -> str:
    return f"sig{secrets.token_hex(4)}"


def test_a_regenerate_marks_the_answer_it_replaced_retried_once(agent_gateway: RunningGateway) -> None:
    session = _session()
    ask: Any = [{"role": "user", "content": "Tell me a story."}]
    with _client(agent_gateway, session) as client:
        for _ in range(3):
            client.chat.completions.create(model="tiny-agent", messages=ask, max_tokens=8)
    # Each regenerate names the answer before it; the last one stands.
    assert _signals(agent_gateway, session) == [["retried"], ["retried"], []]


def test_an_edited_message_marks_the_answer_to_the_old_one(agent_gateway: RunningGateway) -> None:
    session = _session()
    with _client(agent_gateway, session) as client:
        first: Any = [{"role": "user", "content": "Tell me a story."}]
        answer = client.chat.completions.create(model="tiny-agent", messages=first, max_tokens=8)
        history = [*first, {"role": "assistant", "content": answer.choices[0].message.content}]
        for follow_up in ("Make it about a cat.", "Make it about a dog."):  # the second replaces the first
            asked = [*history, {"role": "user", "content": follow_up}]
            client.chat.completions.create(model="tiny-agent", messages=asked, max_tokens=8)
    # The first answer was carried on (twice), the answer to the cat was edited away.
    assert _signals(agent_gateway, session) == [["accepted"], ["edited"], []]


def test_a_tool_result_that_begins_with_error_marks_the_call_that_failed(agent_gateway: RunningGateway) -> None:
    session = _session()
    with _client(agent_gateway, session) as client:
        ask: list[Any] = [{"role": "user", "content": ASK_README}]
        called = client.chat.completions.create(model="tiny-agent", messages=ask, tools=[READ_TOOL],  # type: ignore[list-item]
                                                max_tokens=64)  # fmt: skip
        message = called.choices[0].message
        assert message.tool_calls, message
        echo = message.model_dump(exclude_none=True)
        failed = [*ask, echo, {"role": "tool", "tool_call_id": message.tool_calls[0].id,
                               "content": "Error: README.md: no such file"}]  # fmt: skip
        client.chat.completions.create(model="tiny-agent", messages=failed, tools=[READ_TOOL], max_tokens=64)  # type: ignore[list-item]
    assert _signals(agent_gateway, session) == [["accepted", "tool_error"], []]
    body = httpx.get(f"{agent_gateway.base_url}/sessions/{session}", headers={"authorization": f"Bearer {KEY}"}).json()
    assert body["turns"][0]["signals"] == ["accepted", "tool_error"]


def test_an_anthropic_tool_result_with_is_error_marks_the_call_that_failed(agent_gateway: RunningGateway) -> None:
    failing, fine = _session(), _session()
    for session, is_error in ((failing, True), (fine, False)):
        base = f"{agent_gateway.base_url}/sessions/{session}"
        with anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0) as client:
            messages: list[Any] = [{"role": "user", "content": ASK_README}]
            tools: Any = [{"name": "read", "description": "Read a file", "input_schema": READ_SCHEMA}]
            asked = client.messages.create(model="tiny-agent", max_tokens=64, messages=messages, tools=tools)
            [call] = [b for b in asked.content if b.type == "tool_use"]
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in asked.content]})
            # Not a text beginning with "Error": only is_error says it failed.
            result = {"type": "tool_result", "tool_use_id": call.id, "content": "no access", "is_error": is_error}
            messages.append({"role": "user", "content": [result]})
            client.messages.create(model="tiny-agent", max_tokens=64, messages=messages, tools=tools)
    assert _signals(agent_gateway, failing) == [["accepted", "tool_error"], []]
    assert _signals(agent_gateway, fine) == [["accepted"], []]
