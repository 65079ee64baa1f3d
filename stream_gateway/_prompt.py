"""Chat messages to prompt token ids, through the model's own chat template.

Messages are normalised before rendering the way chat templates expect them: ``developer``
becomes ``system`` (few templates know ``developer``), content parts are joined into one string,
and tool-call ``arguments`` are parsed from the JSON string OpenAI clients send into the mapping
that Hugging Face templates render with ``tojson`` (a string would be double-encoded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from ._api_types import Message, Tool
from ._errors import InvalidRequest


def template_message(message: Message) -> dict[str, Any]:
    """One message as the chat template consumes it."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    tools: Sequence[Tool] | None = None,
) -> list[int]:
    """Render ``messages`` with the generation prompt appended and tokenize the result."""
    if tokenizer.chat_template is None:
        raise InvalidRequest("the served model has no chat template; chat completions need one")
    tool_specs: Any = [tool.model_dump(exclude_none=True) for tool in tools] if tools else None
    try:
        text = tokenizer.apply_chat_template(
            [template_message(m) for m in messages],
            tools=tool_specs,
            add_generation_prompt=True,
            tokenize=False,
        )
    except TemplateError as exc:
        # Templates raise for conversations they cannot render (e.g. roles out of order).
        raise InvalidRequest(f"the chat template rejected the messages: {exc}", param="messages") from exc
    assert isinstance(text, str)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def _arguments(arguments: str) -> Any:
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        # Not JSON: render it verbatim rather than refuse a conversation the model produced.
        return arguments
