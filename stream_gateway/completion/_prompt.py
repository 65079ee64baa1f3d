"""Chat messages as the model's chat template expects them.

Messages are normalised before rendering the way chat templates expect them: ``developer``
becomes ``system`` (few templates know ``developer``), text parts are joined into one string (a
message with images keeps its parts: the template renders each image),
and tool-call ``arguments`` are parsed from the JSON string OpenAI clients send into the mapping
that Hugging Face templates render with ``tojson`` (a string would be double-encoded).
"""

from __future__ import annotations

from typing import Any

import orjson

from stream_gateway.completion._request import ImagePart, Message


def template_message(message: Message) -> dict[str, Any]:
    """One message as the chat template consumes it."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.images() and isinstance(message.content, list):
        # Vision-language templates render each image part as its placeholder (docs/images.md).
        out["content"] = [
            {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
            for part in message.content
        ]
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
    reasoning = (message.model_extra or {}).get("reasoning_content")
    if message.role == "assistant" and isinstance(reasoning, str):
        out["reasoning_content"] = reasoning  # a client's echo; a recorded turn's own thinking replaces it
    return out


def _arguments(arguments: str) -> Any:
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        # Not JSON: render it verbatim rather than refuse a conversation the model produced.
        return arguments
