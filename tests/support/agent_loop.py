"""Driving a streamed multi-turn session the way an agent does: tools executed, results sent back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openai import OpenAI

READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def drive_session(
    client: OpenAI,
    model: str,
    messages: list[dict[str, Any]],
    *,
    follow_ups: list[str],
    workdir: Path,
    tools: list[dict[str, Any]] | None = None,
    max_rounds: int = 6,
    **sampling: Any,
) -> list[dict[str, Any]]:
    """Stream turns until the model answers and no follow-up is left; the final messages.

    A tool call is executed (``read`` of a file under ``workdir``) and its result sent back with
    the assistant message echoed as streamed; otherwise the next follow-up user message continues.
    ``sampling`` goes to ``chat.completions.create`` (temperature, seed, max_tokens, metadata...).
    """
    messages, follow_ups = list(messages), list(follow_ups)
    for _ in range(max_rounds):
        content, calls, finish = "", {}, None
        extra = {"tools": tools} if tools else {}
        stream = client.chat.completions.create(model=model, messages=messages, stream=True, **extra, **sampling)  # type: ignore[call-overload]
        for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                    if delta.function is not None:
                        call["name"] += delta.function.name or ""
                        call["arguments"] += delta.function.arguments or ""
                finish = choice.finish_reason or finish
        if finish == "tool_calls":
            echoed = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in calls.values()
            ]
            messages.append({"role": "assistant", "content": content or None, "tool_calls": echoed})
            for c in calls.values():
                path = json.loads(c["arguments"]).get("path", "README.md")
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": (workdir / path).read_text()})
            continue
        messages.append({"role": "assistant", "content": content})
        if not follow_ups:
            break
        messages.append({"role": "user", "content": follow_ups.pop(0)})
    return messages
