"""A thinking model through the gateway: thinking streamed apart on every protocol, and one chain
whatever the client does with it (docs/reasoning.md).

The model answers as ``tiny-reasoning``: the scripted engine on the untrained
``tiny-reasoning-untrained`` (its tokenizer and thinking template), so it opens with ``<think>``,
writes a short thought, closes it, then calls the offered file-reading tool after a user message or
answers after a tool result. The client-behaviour matrix drives the same conversation (a tool loop
of three calls under one user message, then a second user message and its loop) with each way
clients treat thinking, under both ``--reasoning-history`` policies, and counts the roots: the
policy decides them, never the client. The module's script (tiny-agent's repertoire, and a
second and third call of ``read`` after the first results) makes the loop; a forced
``tool_choice`` holds those calls, after a thinking block the grammar leaves free. Every token is
the script's, so what the gateway re-renders from a client's echo is the turn's own tokens.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import numpy as np
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from stream_gateway.completion._request import ChatCompletionRequest
from stream_gateway.constraints import replay_masks, response_format_constraint, tool_choice_constraint
from stream_gateway.engines import build_engine
from stream_gateway.engines.scripted import DEFAULT_SCRIPT
from stream_gateway.engines.transformers import end_of_turn_ids

from ..support.agent_loop import READ_TOOL
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway, run_gateway, scripted_settings

MODEL = "tiny-reasoning"
FIRST, SECOND = "What is in this repo?", "And now?"
README = "The secret word is lighthouse.\n"
CALLS = 3  # tool calls under each user message: the script's three, the second and third forced too

# A genuine user message (not a turn of tool results) in the decoded prompt, and text without one.
_USER = r"<\|im_start\|>user\n(?!<tool_response>)"
_SINCE_USER = rf"(?:(?!{_USER}).)*"
# CALLS tool results since the last user message: the loop is done.
_LOOP_DONE = "(?s)" + "".join(f"<tool_response>{_SINCE_USER}" for _ in range(CALLS)) + r"\Z"
READ_README = {"name": "read", "arguments": {"path": "README.md"}}
SCRIPT = {
    "rules": [
        {"when": {"last": "tool", "matches": _LOOP_DONE}, "think": "The result is in, now answer.",
         "say": "Done: I read the file."},
        {"when": {"last": "tool", "tool": "read"}, "think": "Read it once more.", "call": [READ_README]},
        *DEFAULT_SCRIPT.model_dump(mode="json", exclude_none=True)["rules"],
    ]
}  # fmt: skip


@pytest.fixture(scope="module", params=["keep", "template"])
def thinking_gateway(
    request: pytest.FixtureRequest, reasoning_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RunningGateway, str]]:
    script = tmp_path_factory.mktemp("script") / "loop.json"
    script.write_text(json.dumps(SCRIPT))
    settings = scripted_settings(
        reasoning_model_path,
        served_model_name=MODEL,
        script=script,
        reasoning_history=request.param,
        max_batch_size=8,
    )
    with run_gateway(build_engine(settings), settings) as running:
        yield running, request.param


def _session(gateway: RunningGateway, session: str) -> dict[str, Any]:
    response = httpx.get(f"{gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer sk-r"})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def _read(arguments: str, workdir: Path) -> str:
    path = workdir / json.loads(arguments)["path"]
    return path.read_text() if path.is_file() else f"no such file: {path.name}"


def _forced(step: int) -> bool:
    """Whether the ``step``-th request under a user message forces a call (the second and third)."""
    return 0 < step < CALLS


# -- chat completions clients -------------------------------------------------------------------


def _chat_turn(client: OpenAI) -> Callable[[list[dict[str, Any]], bool], tuple[str, str, list[dict[str, Any]]]]:
    def turn(messages: list[dict[str, Any]], forced: bool) -> tuple[str, str, list[dict[str, Any]]]:
        thinking, content, calls = "", "", {}
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[READ_TOOL],
            tool_choice={"type": "function", "function": {"name": "read"}} if forced else "auto",
            stream=True,
            max_tokens=200,
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


def _chat_conversation(client: OpenAI, echo: str, workdir: Path) -> tuple[int, int]:
    """Two user messages, each followed by its tool loop; the assistant turns echoed per ``echo``.
    Returns the number of turns the client asked for and of tool calls it ran."""
    turn = _chat_turn(client)
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    turns = ran = 0
    for follow_up in (SECOND, None):
        for step in range(CALLS + 2):
            thinking, content, calls = turn(messages, _forced(step))
            turns += 1
            ran += len(calls)
            assert thinking, "the script thinks first on a thinking model"
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
    return turns, ran


# -- Anthropic Messages clients -----------------------------------------------------------------


def _anthropic_conversation(client: anthropic.Anthropic, echo: str, workdir: Path) -> tuple[int, int]:
    tools = [{"name": "read", "description": "Read a file", "input_schema": READ_TOOL["function"]["parameters"]}]  # type: ignore[index]
    messages: list[dict[str, Any]] = [{"role": "user", "content": FIRST}]
    turns = ran = 0
    for follow_up in (SECOND, None):
        for step in range(CALLS + 2):
            choice = {"type": "tool", "name": "read"} if _forced(step) else {"type": "auto"}
            with client.messages.stream(
                model=MODEL,
                max_tokens=200,
                messages=messages,  # type: ignore[arg-type]
                tools=tools,  # type: ignore[arg-type]
                tool_choice=choice,  # type: ignore[arg-type]
            ) as stream:
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
            ran += len(uses)
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
    return turns, ran


# -- Responses clients --------------------------------------------------------------------------


def _responses_conversation(client: OpenAI, echo: str, workdir: Path) -> tuple[int, int]:
    tool = {"type": "function", "name": "read", "parameters": READ_TOOL["function"]["parameters"]}  # type: ignore[index]
    items: list[Any] = [{"role": "user", "content": FIRST}]
    include = ["reasoning.encrypted_content"] if echo == "encrypted" else []
    turns = ran = 0
    for follow_up in (SECOND, None):
        for step in range(CALLS + 2):
            response = client.responses.create(
                model=MODEL,
                input=items,
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "function", "name": "read"} if _forced(step) else "auto",
                include=include,  # type: ignore[arg-type]
                max_output_tokens=200,
                store=False,
            )
            turns += 1
            output = [item.model_dump(exclude_none=True) for item in response.output]
            assert output[0]["type"] == "reasoning", output
            assert ("encrypted_content" in output[0]) == (echo == "encrypted")
            if echo == "dropped":
                output = [item for item in output if item["type"] != "reasoning"]
            items.extend(output)
            calls = [item for item in output if item["type"] == "function_call"]
            ran += len(calls)
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
    return turns, ran


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
            turns, ran = _anthropic_conversation(aclient, echo, tmp_path)
    else:
        with OpenAI(base_url=f"{base}/v1", api_key="sk-r", max_retries=0, timeout=120) as client:
            conversation = _chat_conversation if protocol == "chat" else _responses_conversation
            turns, ran = conversation(client, echo, tmp_path)
    body = _session(gateway, session)
    recorded = body["turns"]
    assert len(recorded) == turns
    # A loop of three calls per user message, and its answer.
    assert [t["finish_reason"] for t in recorded] == 2 * [*CALLS * ["tool_calls"], "stop"]
    assert ran == 2 * CALLS
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
        assert all(t["matches_full_render"] for t in recorded), [t["matches_full_render"] for t in recorded]
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


BOUNDED = {
    "type": "object",
    "properties": {
        "word": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["word", "count"],
    "additionalProperties": False,
}


def test_forced_output_follows_free_thinking(
    thinking_gateway: tuple[RunningGateway, str], reasoning_model_path: Path
) -> None:
    """response_format and a forced tool_choice hold the answer, after the thinking (as vLLM's
    structured outputs start at ``</think>``); the recorded logprobs are the masked distribution's.
    The script's thought passes the grammar; its hello does not, and the untrained model writes the
    JSON under the grammar (bounded: every document fits the budget); its call of read passes."""
    gateway, _ = thinking_gateway
    tokenizer = AutoTokenizer.from_pretrained(reasoning_model_path)
    model = AutoModelForCausalLM.from_pretrained(reasoning_model_path, dtype=torch.float32).eval()
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    eos = end_of_turn_ids(model, tokenizer)
    response_format = {"type": "json_schema", "json_schema": {"name": "W", "schema": BOUNDED, "strict": True}}
    named = {"type": "function", "function": {"name": "read"}}
    messages = [{"role": "user", "content": FIRST}]
    with OpenAI(base_url=f"{gateway.base_url}/v1", api_key="sk-r", max_retries=0, timeout=120) as client:
        for extra in ({"response_format": response_format}, {"tools": [READ_TOOL], "tool_choice": named}):
            thinking, content, calls, finish = "", "", [], None
            stream = client.chat.completions.create(
                # A thought, then at worst 12 characters as surrogate-pair escapes, 144 tokens, and the keys: under 240.
                model=MODEL,
                messages=messages,
                stream=True,
                max_tokens=240,
                temperature=0,
                **extra,
            )  # type: ignore[call-overload]
            for chunk in stream:
                delta = chunk.choices[0].delta
                if (delta.model_extra or {}).get("reasoning_content"):
                    assert not content and not calls, "thinking after the answer began"
                    thinking += delta.model_extra["reasoning_content"]  # type: ignore[index]
                content += delta.content or ""
                calls += [c for c in delta.tool_calls or [] if c.id]
                finish = chunk.choices[0].finish_reason or finish
                session = stream.response.headers["x-session-id"]
            assert thinking, "the grammar left the thinking to the script"
            if "response_format" in extra:
                assert finish == "stop", (finish, content)
                jsonschema.validate(json.loads(content), BOUNDED)  # the answer, not the thinking, is JSON
                constraint = response_format_constraint(response_format)
            else:
                assert finish == "tool_calls" and [c.function.name for c in calls] == ["read"], (finish, content)
                parsed = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, **extra})
                constraint = tool_choice_constraint(parsed.tool_choice, parsed.tools, tokenizer, "hermes")
            assert constraint is not None
            [turn] = _session(gateway, session)["turns"]
            assert turn["reasoning_tokens"] > 0
            grammar = constraint.after_thinking(start, end, opened=False).grammar
            masks = replay_masks(grammar, tokenizer, turn["output_ids"], eos, model.config.vocab_size)
            prompt, output = turn["prompt_ids"], turn["output_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
            logits[~torch.from_numpy(np.stack(masks))] = float("-inf")
            replayed = torch.log_softmax(logits, -1).gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
            torch.testing.assert_close(replayed, torch.tensor(turn["logprobs"]), atol=2e-4, rtol=0)
