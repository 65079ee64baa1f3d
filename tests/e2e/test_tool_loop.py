"""A real multi-turn tool loop through the gateway with the official openai client.

The gateway serves the untrained tiny model as ``tiny-agent`` on the scripted engine: it calls the
``read`` tool after a user message and answers "Done: I read the file." after a tool result, each
token with its real logprob from the model's forward pass. The client executes the tool and sends
the result back, echoing the assistant message either exactly or re-serialised the way real agents
do; a forward pass of the same untrained model over the chain reproduces every recorded logprob.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..support.agent_loop import READ_TOOL
from ..support.fidelity import assert_chain_logprobs
from ..support.servers import RunningGateway

TOOLS = [
    READ_TOOL,
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
]


def _stream_turn(client: OpenAI, messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """One streamed turn: (content, tool calls as the client assembles them, finish reason)."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    stream = client.chat.completions.create(model="tiny-agent", messages=messages, tools=TOOLS, stream=True)  # type: ignore[arg-type]
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    # pi-ai and OpenClaw key calls by id: the first delta must carry id, type and name.
                    assert delta.id and delta.type == "function" and delta.function and delta.function.name
                    assert re.fullmatch(r"[A-Za-z0-9]+", delta.id), delta.id
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None
                calls[delta.index]["arguments"] += (delta.function.arguments if delta.function else None) or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _execute(call: dict[str, Any], workdir: Path) -> str:
    args = json.loads(call["arguments"])
    assert call["name"] == "read"
    return (workdir / args["path"]).read_text()


@pytest.mark.parametrize("echo", ["exact", "reserialised"])
def test_tool_loop_builds_one_token_exact_chain(
    agent_gateway: RunningGateway, agent_model_path: Path, tmp_path: Path, echo: str
) -> None:
    (tmp_path / "README.md").write_text("The secret word is lighthouse.\n")
    session = f"loop{secrets.token_hex(4)}"
    base = f"{agent_gateway.base_url}/sessions/{session}/v1"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "What does the README say?"},
    ]
    ids_seen: set[str] = set()
    with OpenAI(base_url=base, api_key="sk-agent", timeout=120, max_retries=0) as client:
        for round_ in range(2):
            content, calls, finish = _stream_turn(client, messages)
            assert finish == "tool_calls", (content, calls)
            assert [c["name"] for c in calls] == ["read"]
            assert not ids_seen & {c["id"] for c in calls}, "tool-call ids must be unique"
            ids_seen |= {c["id"] for c in calls}
            if echo == "exact":
                echoed_calls = [
                    {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                    for c in calls
                ]
                messages.append({"role": "assistant", "content": content or None, "tool_calls": echoed_calls})
                results = [{"role": "tool", "tool_call_id": c["id"], "content": _execute(c, tmp_path)} for c in calls]
            else:
                # What real agents do: ids rewritten, arguments re-encoded, content as parts.
                rewritten = {c["id"]: f"call_{i}x{round_}" for i, c in enumerate(calls)}
                echoed_calls = [
                    {
                        "id": rewritten[c["id"]],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(json.loads(c["arguments"]), indent=2)},
                    }
                    for c in calls
                ]
                messages.append({"role": "assistant", "content": "", "tool_calls": echoed_calls})
                results = [
                    {
                        "role": "tool",
                        "tool_call_id": rewritten[c["id"]],
                        "content": [{"type": "text", "text": _execute(c, tmp_path)}],
                    }
                    for c in calls
                ]
            messages.extend(results)
            answer, more_calls, finish = _stream_turn(client, messages)
            assert (answer, more_calls, finish) == ("Done: I read the file.", [], "stop")
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": f"Read it again ({round_})."})

    body = httpx.get(
        f"{agent_gateway.base_url}/sessions/{session}", headers={"authorization": "Bearer sk-agent"}, timeout=10
    ).json()
    turns = body["turns"]
    assert len(turns) == 4
    [chain] = body["chains"]  # T2: one chain, however the client re-serialised its echo
    assert chain["turn_ids"] == [t["turn_id"] for t in turns]
    tokenizer = AutoTokenizer.from_pretrained(agent_model_path)
    for turn in turns:  # T1
        start = len(turn["prompt_ids"])
        assert chain["token_ids"][start : start + len(turn["output_ids"])] == turn["output_ids"]
        assert chain["mask"][start : start + len(turn["output_ids"])] == [1] * len(turn["output_ids"])
        assert len(turn["logprobs"]) == len(turn["output_ids"])
    first_call = tokenizer.decode(turns[0]["output_ids"])
    assert first_call.startswith("<tool_call>") and first_call.endswith("<|im_end|>")
    # The model writes calls exactly as its template renders them, and the template renders parsed
    # arguments (not the client's string) and no ids: so the incremental prompt also equals a full
    # re-render here. It is the sampled ids that are used either way.
    assert all(t["matches_full_render"] for t in turns)

    model = AutoModelForCausalLM.from_pretrained(agent_model_path, dtype=torch.float32).eval()
    assert_chain_logprobs(model, chain["token_ids"], chain["mask"], chain["logprobs"])


def test_non_streamed_tool_call(agent_gateway: RunningGateway) -> None:
    with OpenAI(base_url=agent_gateway.base_url + "/v1", api_key="x", timeout=120, max_retries=0) as client:
        reply = client.chat.completions.create(
            model="tiny-agent",
            messages=[{"role": "user", "content": "look"}],
            tools=TOOLS,  # type: ignore[arg-type]
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert call.type == "function" and call.function.name == "read"
        assert json.loads(call.function.arguments) == {"path": "README.md"}
        # tool_choice "none": the same output is plain content.
        plain = client.chat.completions.create(
            model="tiny-agent",
            messages=[{"role": "user", "content": "look"}],
            tools=TOOLS,
            tool_choice="none",  # type: ignore[arg-type]
        )
        assert plain.choices[0].finish_reason == "stop"
        assert plain.choices[0].message.tool_calls is None
        assert "<tool_call>" in (plain.choices[0].message.content or "")
