"""A thinking model through the gateway: thinking streamed apart on every protocol, and one chain
whatever the client does with it (docs/reasoning.md).

The model is ``tiny-reasoning``: it opens with ``<think>``, writes a short thought, closes it, then
calls the offered file-reading tool after a user message or answers after a tool result. The
client-behaviour matrix drives the same conversation (a tool loop under one user message, then a
second user message and its tool loop) with each way clients treat thinking, under both
``--reasoning-history`` policies, and counts the roots: the policy decides them, never the client.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI
from transformers import AutoModelForCausalLM

from stream_gateway import Settings
from stream_gateway.engines import build_engine
from stream_gateway.models import resolve_model

from ..support.agent_loop import READ_TOOL
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway, run_gateway

MODEL = "tiny-reasoning"
FIRST, SECOND = "What is in this repo?", "And now?"
README = "The secret word is lighthouse.\n"


@pytest.fixture(scope="module")
def reasoning_model_path() -> Path:
    return Path(resolve_model(MODEL))


@pytest.fixture(scope="module", params=["keep", "template"])
def thinking_gateway(
    request: pytest.FixtureRequest, reasoning_model_path: Path
) -> Iterator[tuple[RunningGateway, str]]:
    settings = Settings(
        model=str(reasoning_model_path), served_model_name=MODEL, reasoning_history=request.param, max_batch_size=8
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running, request.param


def _session(gateway: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer sk-r"})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _read(arguments: str, workdir: Path) -> str:
    return (workdir / json.loads(arguments)["path"]).read_text()


# -- chat completions clients -------------------------------------------------------------------


def _chat_turn(client: OpenAI) -> Callable[[list[dict[str, Any]]], tuple[str, str, list[dict[str, Any]]]]:
    def turn(messages: list[dict[str, Any]]) -> tuple[str, str, list[dict[str, Any]]]:
        thinking, content, calls = "", "", {}
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[READ_TOOL],
            stream=True,
            temperature=1.0,  # type: ignore[list-item]
        )
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                extra = delta.model_extra or {}
                if extra.get("reasoning_content"):
                    assert not content and not calls, "thinking after the answer began"
                    assert extra["reasoning"] == extra["reasoning_content"]
                    thinking += extra["reasoning_content"]
                content += delta.content or ""
                for call in delta.tool_calls or []:
                    entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                    entry["name"] += (call.function.name if call.function else None) or ""
                    entry["arguments"] += (call.function.arguments if call.function else None) or ""
        assert "<think>" not in content and "</think>" not in content
        return thinking, content, [calls[i] for i in sorted(calls)]

    return turn


def _chat_conversation(client: OpenAI, echo: str, workdir: Path) -> int:
    """Two user messages, each followed by its tool loop; the assistant turns echoed per ``echo``.
    Returns the number of turns the client asked for."""
    turn = _chat_turn(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    turns = 0
    for follow_up in (SECOND, None):
        for _ in range(4):
            thinking, content, calls = turn(messages)
            turns += 1
            assert thinking, "tiny-reasoning always thinks"
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if calls:
                message["tool_calls"] = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls
                ]
            if echo == "reasoning_content":
                message["reasoning_content"] = thinking
            elif echo == "summary":
                message["reasoning_content"] = f"(summary) {thinking.split('.')[0][:20]}"
            elif echo == "inline":
                message["content"] = f"<think>\n{thinking}\n</think>\n\n{content}"
            messages.append(message)
            if not calls:
                break
            for call in calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": _read(call["arguments"], workdir)}
                )
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    return turns


# -- Anthropic Messages clients -----------------------------------------------------------------


def _anthropic_conversation(client: anthropic.Anthropic, echo: str, workdir: Path) -> int:
    tools = [{"name": "read", "description": "Read a file", "input_schema": READ_TOOL["function"]["parameters"]}]  # type: ignore[index]
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    turns = 0
    for follow_up in (SECOND, None):
        for _ in range(4):
            with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=tools) as stream:  # type: ignore[arg-type]
                kinds = [event.content_block.type for event in stream if event.type == "content_block_start"]
                message = stream.get_final_message()
            turns += 1
            assert kinds and kinds[0] == "thinking", kinds  # the thinking block comes first
            blocks = [block.model_dump(exclude_none=True) for block in message.content]
            assert blocks[0]["signature"].startswith("sgw1.")
            if echo == "redacted":
                blocks[0] = {"type": "redacted_thinking", "data": "b3BhcXVl"}
            elif echo == "foreign":
                blocks[0] = {"type": "thinking", "thinking": "Another model's words.", "signature": "EqQBCkYIBRgC"}
            messages.append({"role": "assistant", "content": blocks})
            uses = [b for b in blocks if b["type"] == "tool_use"]
            if not uses:
                break
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": u["id"],
                            "content": _read(json.dumps(u["input"]), workdir),
                        }
                        for u in uses
                    ],
                }
            )
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    return turns


# -- Responses clients --------------------------------------------------------------------------


def _responses_conversation(client: OpenAI, echo: str, workdir: Path) -> int:
    tool = {"type": "function", "name": "read", "parameters": READ_TOOL["function"]["parameters"]}  # type: ignore[index]
    items: list[Any] = [{"role": "user", "content": FIRST}]
    include = ["reasoning.encrypted_content"] if echo == "encrypted" else []
    turns = 0
    for follow_up in (SECOND, None):
        for _ in range(4):
            response = client.responses.create(
                model=MODEL,
                input=items,
                tools=[tool],
                include=include,
                store=False,  # type: ignore[list-item,arg-type]
            )
            turns += 1
            output = [item.model_dump(exclude_none=True) for item in response.output]
            assert output[0]["type"] == "reasoning", output
            assert ("encrypted_content" in output[0]) == (echo == "encrypted")
            if echo == "dropped":
                output = [item for item in output if item["type"] != "reasoning"]
            items.extend(output)
            calls = [item for item in output if item["type"] == "function_call"]
            if not calls:
                break
            for call in calls:
                items.append(
                    {
                        "type": "function_call_output",
                        "call_id": call["call_id"],
                        "output": _read(call["arguments"], workdir),
                    }
                )
        if follow_up is not None:
            items.append({"role": "user", "content": follow_up})
    return turns


CLIENTS = [
    ("chat", "dropped"),  # the OpenAI SDK: reasoning never echoed
    ("chat", "reasoning_content"),  # DeepSeek-style clients echo it
    ("chat", "summary"),  # a client that rewrites the thinking into a summary
    ("chat", "inline"),  # a client that puts it back into the content
    ("messages", "signed"),  # the Anthropic SDK (Claude Code): signed thinking blocks as received
    ("messages", "redacted"),
    ("messages", "foreign"),
    ("responses", "encrypted"),  # Codex: reasoning items with encrypted_content
    ("responses", "plain"),  # reasoning items without it
    ("responses", "dropped"),
]


@pytest.mark.parametrize(("protocol", "echo"), CLIENTS, ids=[f"{p}-{e}" for p, e in CLIENTS])
def test_roots_follow_the_policy_not_the_client(
    thinking_gateway: tuple[RunningGateway, str], tmp_path: Path, protocol: str, echo: str
) -> None:
    gateway, history = thinking_gateway
    (tmp_path / "README.md").write_text(README)
    session = f"think{secrets.token_hex(4)}"
    base = f"{gateway.base_url}/sessions/{session}"
    if protocol == "messages":
        with anthropic.Anthropic(base_url=base, api_key="sk-r", max_retries=0, timeout=120) as aclient:
            turns = _anthropic_conversation(aclient, echo, tmp_path)
    else:
        with OpenAI(base_url=f"{base}/v1", api_key="sk-r", max_retries=0, timeout=120) as client:
            conversation = _chat_conversation if protocol == "chat" else _responses_conversation
            turns = conversation(client, echo, tmp_path)
    body = _session(gateway, session)
    recorded = body["turns"]
    assert len(recorded) == turns
    roots = [t for t in recorded if t["parent_id"] is None]
    # keep: one chain for the whole conversation; template: one root per user message, the second
    # linked to the turn it follows, with the reason recorded.
    assert len(roots) == (1 if history == "keep" else 2), [(t["parent_id"], t["fallback_reason"]) for t in recorded]
    assert len(body["chains"]) == len(roots)
    for t in recorded:
        assert t["reasoning_tokens"] > 0 and t["answer_start"] == t["reasoning_tokens"]
        if t["parent_id"] is not None:
            assert t["reused_prompt_tokens"] > 0
    if history == "template":
        second = roots[1]
        assert second["predecessor_id"] in {t["turn_id"] for t in recorded}
        assert second["fallback_reason"].startswith("reasoning_history=template")
        assert all(t["matches_full_render"] for t in recorded)
    else:
        assert recorded[0]["fallback_reason"] is None
        assert all(t["fallback_reason"] is None for t in recorded)


def test_streams_put_thinking_first_and_record_exact_ids(
    thinking_gateway: tuple[RunningGateway, str], reasoning_model_path: Path, tmp_path: Path
) -> None:
    gateway, _ = thinking_gateway
    (tmp_path / "README.md").write_text(README)
    session = f"exact{secrets.token_hex(4)}"
    with OpenAI(base_url=f"{gateway.base_url}/sessions/{session}/v1", api_key="sk-r", max_retries=0) as client:
        whole = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": FIRST}], tools=[READ_TOOL]
        )  # type: ignore[list-item]
        message = whole.choices[0].message
        extra = message.model_extra or {}
        assert extra["reasoning_content"] and message.tool_calls, message
        assert "<think>" not in (message.content or "")
        usage = whole.usage
        assert usage is not None and usage.completion_tokens_details is not None
        assert 0 < (usage.completion_tokens_details.reasoning_tokens or 0) < usage.completion_tokens
    body = _session(gateway, session)
    [chain] = body["chains"]
    model = AutoModelForCausalLM.from_pretrained(reasoning_model_path, dtype="float32")
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"])
