"""Anthropic's Messages API at the edge: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A Messages request is translated into a chat completion request, which then takes the same path
as any other (one chat template, the same session tree and turn keys, tool parsers, events and
capture); the engine's updates are translated into Messages events as they come. Nothing below
this module knows which protocol a request came in.

Requests (as Anthropic documents them, read for this from its API reference):

* ``system``: a string or text blocks → one system message (blocks joined by blank lines); any
  other block (an image) is a 400 naming it (``system.1``), as at Anthropic.
* ``messages``: ``user`` content (a string, ``text``, ``image`` and ``tool_result`` blocks) →
  ``tool`` messages for the results (in order), then one user message with the text and images as
  chat parts in their order (``[text, image, text]`` stays three parts); ``assistant`` content
  (``text`` and ``tool_use`` blocks) → one assistant message with its tool calls (the
  ``tool_use`` id is the call id, ``input`` the JSON arguments). ``thinking`` blocks are history
  the chain does not need (the recorded ids stand in, docs/reasoning.md): one signed here is
  recognised, a foreign one is accepted (its text becomes the message's ``reasoning_content``
  for a template to render), one without a signature is a 400 as at Anthropic;
  ``redacted_thinking`` is accepted and ignored. Documents: a clear 400.
* ``image`` blocks → ``image_url`` parts: a ``base64`` source (``image/png``, ``image/jpeg``,
  ``image/webp`` or ``image/gif``, Anthropic's four) → a ``data:`` URL, a ``url`` source → its
  URL (the core fetches it only from allowed hosts, docs/images.md). A ``file`` source (the Files
  API: nothing here holds files), another media type, ``data`` that is not base64, or an image in
  an assistant message: a 400 naming the block (``messages.3.content.1``). The edge checks only
  what names its own fields better than the core could; decoding, limits and whether the served
  model reads images are the core's.
* ``tool_result`` content: a string or ``text`` blocks → the tool message's text (joined, as
  before); once it holds an ``image`` block (Claude Code returns screenshots so) → the tool
  message's content as text and image parts in order. Other blocks in it: a 400.
  ``is_error: true`` stays on the tool message, for the ``tool_error`` signal (docs/rewards.md).
* ``role: "system"`` messages inside ``messages`` (Claude Code sends them) → system messages
  there (text only).
* ``tools`` (``name``, ``description``, ``input_schema``) → function tools; Anthropic's server
  tools (``web_search_20250305`` ...) run on Anthropic's servers: this gateway runs no tools, so
  they are not offered to the model (a ``tool_choice`` naming one is refused); ``tool_choice`` ``auto`` / ``any`` /
  ``tool`` / ``none`` → ``auto`` / ``required`` / the named function / ``none``;
  ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``.
* ``max_tokens`` (required), ``stop_sequences``, ``stream``, ``metadata.user_id``;
  ``output_config.format`` (``json_schema``) → constrained decoding, as ``response_format``
  (see docs/http-api.md). ``temperature``, ``top_p`` and ``top_k`` are no longer in Anthropic's
  SDK (2.x) but older clients send them: honoured. ``thinking`` ``{"type": "disabled"}`` turns a
  reasoning model's thinking off where its template has the switch (``enable_thinking``);
  otherwise, and ``budget_tokens``, ``output_config.effort``, ``cache_control`` and the
  ``anthropic-beta`` header, are accepted and have no effect.

Responses: a ``message`` with a ``thinking`` block (a reasoning model's, signed by this
gateway), ``text`` and ``tool_use`` blocks, ``stop_reason`` ``end_turn`` /
``max_tokens`` / ``stop_sequence`` / ``tool_use``, ``usage.input_tokens`` / ``output_tokens``.
Streams: ``message_start``, then per block ``content_block_start``, ``content_block_delta``
(``thinking_delta`` then one ``signature_delta``, ``text_delta``, ``input_json_delta``),
``content_block_stop``, then ``message_delta`` (stop
reason, output tokens) and ``message_stop``, each frame written the moment its tokens are
sampled. Errors: ``{"type": "error", "error": {"type", "message"}}``, in a stream as an
``error`` event.
"""

from __future__ import annotations

import binascii
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from stream_gateway._errors import GatewayError, InvalidRequest
from stream_gateway.completion import (
    ChatCompletionRequest,
    ChoiceResult,
    ChoiceUpdate,
    CompletionService,
    KeptHistory,
    PreparedCompletion,
)
from stream_gateway.protocols._edge import Call, EdgeBase, SideRoute, StreamStart
from stream_gateway.reasoning import ThinkingSigner

log = logging.getLogger(__name__)

__all__ = [
    "CountTokensRequest",
    "MessagesEdge",
    "MessagesEncoder",
    "MessagesRequest",
    "error_body",
    "message_body",
    "to_chat_request",
]

# Anthropic's error types by HTTP status (its "Errors" page).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# The media types Anthropic accepts in a base64 image source (its Messages API reference).
_IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use"}


class _In(BaseModel):
    # Clients send fields this gateway has no use for (cache_control, citations, betas ...):
    # ignored, so that newer clients keep working. What cannot be honoured is refused by name.
    model_config = ConfigDict(extra="ignore")


class TextBlock(_In):
    type: Literal["text"]
    text: str


class ToolUseBlock(_In):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_In):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None


class ThinkingBlock(_In):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class ImageBlock(_In):
    # The source is checked by hand (_image_part), so that a bad one is refused by the block's name
    # rather than falling through to OtherBlock as an unknown block.
    type: Literal["image"]
    source: Any = None


class OtherBlock(_In):
    """Any other block type: ``redacted_thinking`` is ignored, the rest refused."""

    model_config = ConfigDict(extra="allow")
    type: str


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | ImageBlock | OtherBlock,
    Field(union_mode="left_to_right"),
]
SystemBlock = Annotated[TextBlock | OtherBlock, Field(union_mode="left_to_right")]


class MessageParam(_In):
    # "system" inside messages: Claude Code's mid-conversation system messages (a beta it sends).
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolParam(_In):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; server tools have their own types


class ToolChoice(_In):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(_In):
    user_id: str | None = None


class OutputFormat(_In):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]


class OutputConfig(_In):
    effort: str | None = None  # accepted, no effect
    format: OutputFormat | None = None


class CountTokensRequest(_In):
    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[SystemBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    # The body's kept history (completion/_kept.py KeptHistory), set by the store that read it.
    _history: Any = PrivateAttr(default=None)


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    temperature: Annotated[float, Field(ge=0.0, le=1.0, strict=True)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, strict=True)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    output_config: OutputConfig | None = None


def _is_base64(data: str) -> bool:
    try:
        binascii.a2b_base64(data, strict_mode=True)
    except (binascii.Error, ValueError):  # ValueError: not ASCII
        return False
    return True


def _image_part(source: Any, where: str) -> dict[str, Any]:
    """The chat ``image_url`` part of an image block's ``source`` (``where``: the block, for a 400)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in _IMAGE_MEDIA_TYPES:
            allowed = ", ".join(_IMAGE_MEDIA_TYPES)
            raise InvalidRequest(
                f"{where}: source.media_type must be one of {allowed}, not {media_type!r}.", param=where
            )
        if not isinstance(data, str) or not data or not _is_base64(data):
            raise InvalidRequest(f"{where}: source.data must be the image's bytes in base64.", param=where)
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidRequest(f"{where}: source.url must be an http(s) URL.", param=where)
        return {"type": "image_url", "image_url": {"url": url}}
    if kind == "file":
        raise InvalidRequest(
            f"{where}: image sources of type 'file' are not supported (this gateway holds no files): "
            "send the image as base64 or a url.",
            param=where,
        )
    raise InvalidRequest(
        f"{where}: an image block's source must be of type 'base64' or 'url', not {kind!r}.", param=where
    )


def _tool_result_content(content: str | list[dict[str, Any]] | None, where: str) -> str | list[dict[str, Any]]:
    """A tool result's text (joined, as for text alone), or its text and image parts in order
    once it holds an image."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.content.{k}"
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image_part(block.get("source"), at))
        else:
            raise InvalidRequest(f"{at}: a tool result holds text and image blocks only, not {kind!r}.", param=at)
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _system_text(blocks: Sequence[Any], where: str) -> str:
    """A system prompt's text blocks joined by blank lines; any other block (an image) is a 400."""
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            kind = getattr(block, "type", None)
            raise InvalidRequest(
                f"{where}.{j}: a system prompt holds text blocks (with their text) only, not {kind!r}.",
                param=f"{where}.{j}",
            )
    return "\n\n".join(block.text for block in blocks)


def _refuse_block(block: OtherBlock, where: str) -> None:
    if block.type in ("thinking", "redacted_thinking"):
        return  # a thinking block that failed ThinkingBlock's shape is refused by _thought
    if block.type == "document":
        raise InvalidRequest(f"{where}: document blocks are not supported.", param=where)
    raise InvalidRequest(f"{where}: unsupported content block type {block.type!r}.", param=where)


def _thought(block: ThinkingBlock | OtherBlock, where: str, signer: ThinkingSigner | None) -> str:
    """The text of a thinking block in history (``""``: nothing to render)."""
    if isinstance(block, OtherBlock):  # redacted_thinking (opaque), or a thinking block missing its text
        if block.type == "thinking":
            raise InvalidRequest(f"{where}: a thinking block needs its `thinking` text.", param=where)
        return ""
    if not block.signature:
        raise InvalidRequest(f"{where}: a thinking block needs its `signature`, as it was received.", param=where)
    if signer is not None and signer.check(block.signature, block.thinking) == "modified":
        log.info("%s: a thinking block signed here but changed (or signed with another key): foreign history", where)
    return block.thinking


def _messages(
    body: CountTokensRequest, signer: ThinkingSigner | None = None, start: int = 0, offsets: list[int] | None = None
) -> list[dict[str, Any]]:
    """The chat messages ``body.messages[start:]`` mean (with ``start`` 0, the system prompt's
    first); ``offsets`` gets how many chat messages the output holds before each and after the last."""
    out: list[dict[str, Any]] = []
    if body.system and not start:
        system = body.system if isinstance(body.system, str) else _system_text(body.system, "system")
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages[start:], start):
        if offsets is not None:
            offsets.append(len(out))
        where = f"messages.{i}.content"
        blocks: list[Any] = (
            [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        )
        if message.role == "system":
            out.append({"role": "system", "content": _system_text(blocks, where)})
        elif message.role == "assistant":
            out.append(_assistant_message(blocks, where, signer))
        else:
            out.extend(_user_messages(blocks, where))
    if offsets is not None:
        offsets.append(len(out))
    return out


def _assistant_message(blocks: list[Any], where: str, signer: ThinkingSigner | None) -> dict[str, Any]:
    """One assistant message: its text, its tool calls, and foreign thinking as ``reasoning_content``."""
    texts: list[str] = []
    calls = []
    thoughts: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock) or (isinstance(block, OtherBlock) and "thinking" in block.type):
            thoughts.append(_thought(block, where, signer))
        elif isinstance(block, ToolUseBlock):
            arguments = orjson.dumps(block.input).decode()
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        elif isinstance(block, ToolResultBlock):
            raise InvalidRequest(f"{where}: tool_result blocks belong in user messages.", param=where)
        elif isinstance(block, ImageBlock):
            at = f"{where}.{j}"
            raise InvalidRequest(f"{at}: image blocks belong in user messages, not the assistant's.", param=at)
        else:
            _refuse_block(block, f"{where}.{j}")
    assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if any(thoughts):
        assistant["reasoning_content"] = "\n\n".join(t for t in thoughts if t)
    if calls:
        assistant["tool_calls"] = calls
    return assistant


def _user_messages(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user message's tool results (as ``tool`` messages, in order), then its text and images
    (as parts, in order)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolResultBlock):
            content = _tool_result_content(block.content, f"{where}.{j}")
            result: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}
            if block.is_error:  # read by the tool_error signal (completion/_signals.py), never rendered
                result["is_error"] = True
            out.append(result)
        elif isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            parts.append(_image_part(block.source, f"{where}.{j}"))
        elif isinstance(block, ToolUseBlock):
            raise InvalidRequest(f"{where}: tool_use blocks belong in assistant messages.", param=where)
        elif isinstance(block, ThinkingBlock):
            raise InvalidRequest(f"{where}: thinking blocks belong in assistant messages.", param=where)
        else:
            _refuse_block(block, f"{where}.{j}")
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _tools(body: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    # Anthropic's server tools (web_search_..., code_execution_...) run on Anthropic's servers;
    # this gateway runs no tools, so they are not offered to the model (see the module docstring).
    client_tools = [tool for tool in body.tools or () if tool.type in (None, "custom")]
    if client_tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema or {"type": "object", "properties": {}},
                },
            }
            for tool in client_tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequest("tool_choice of type 'tool' needs a name.", param="tool_choice.name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def to_chat_request(
    body: CountTokensRequest, signer: ThinkingSigner | None = None, thinking_switch: bool = False
) -> ChatCompletionRequest:
    """The chat completion request that ``body`` means (``thinking_switch``: the served model's
    template reads ``enable_thinking``, so ``thinking: {"type": "disabled"}`` turns thinking off).

    Translated through the body's kept history (``completion/_kept.py``): a continuing body
    translates only the messages it adds, the chat messages of the repeated ones are the kept
    history's, the very objects, and the chat request's own facts (fingerprints, template
    messages, render) are read the same way."""

    def translate(start: int, starts: list[int]) -> ChatCompletionRequest:
        return _chat_request(body, _messages(body, signer, start, starts), thinking_switch)

    return KeptHistory.of(body).translated(translate, body.system)


def _chat_request(
    body: CountTokensRequest, messages: list[dict[str, Any]], thinking_switch: bool
) -> ChatCompletionRequest:
    fields: dict[str, Any] = {"model": body.model, "messages": messages, **_tools(body)}
    if isinstance(body, MessagesRequest):
        kind = body.thinking.get("type") if body.thinking else None
        if thinking_switch and kind in ("enabled", "disabled", "adaptive"):
            fields["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
        fields |= {"max_tokens": body.max_tokens, "stream": body.stream}
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k"):
            if (value := getattr(body, name)) is not None:
                fields[name] = value
        if body.stop_sequences:
            fields["stop"] = body.stop_sequences
        if body.metadata is not None and body.metadata.user_id:
            fields["user"] = body.metadata.user_id
        if body.output_config is not None and body.output_config.format is not None:
            schema = body.output_config.format.schema_
            fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    if not fields["messages"] or fields["messages"][-1]["role"] == "assistant":
        # A prefilled assistant turn would need the template to leave it open: not supported.
        raise InvalidRequest("The last message must be a user message.", param="messages")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def message_id() -> str:
    return f"msg_{secrets.token_hex(12)}"


def _stop(finish_reason: str | None, stop_sequence: str | None) -> tuple[str | None, str | None]:
    if finish_reason == "stop" and stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return _STOP_REASONS.get(finish_reason or "", finish_reason), None


def message_body(
    message: str, model: str, result: ChoiceResult, input_tokens: int, signer: ThinkingSigner | None = None
) -> dict[str, Any]:
    """A whole (non-streamed) Messages response."""
    content: list[dict[str, Any]] = []
    thought = result.reasoning
    if thought and signer is not None:
        content.append({"type": "thinking", "thinking": thought, "signature": signer.sign(message, thought)})
    text = "".join(result.text_parts)
    if text:
        content.append({"type": "text", "text": text})
    for call in result.tool_calls():
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    stop_reason, matched = _stop(result.finish_reason, result.stop_sequence)
    return {
        "id": message,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": matched,
        "usage": _usage(input_tokens, len(result.token_ids)),
    }


def _input(arguments: str) -> Any:
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {"_raw_arguments": arguments}  # what the model wrote, kept rather than lost
    return value if isinstance(value, dict) else {"_value": value}


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def error_body(error: GatewayError) -> dict[str, Any]:
    """Anthropic's error shape for a gateway error."""
    kind = _ERROR_TYPES.get(error.status_code)
    if kind is None:  # a status Anthropic does not list (405): its kind of request error, or a server error
        kind = "invalid_request_error" if error.error_type == "invalid_request_error" else "api_error"
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class MessagesEncoder:
    """Messages stream events from a chat response's updates (one choice)."""

    __slots__ = ("_index", "_mac", "_matched", "_message", "_model", "_open", "_signer", "_stop")

    def __init__(self, message: str, model: str, signer: ThinkingSigner | None = None) -> None:
        self._message = message
        self._model = model
        self._signer = signer
        self._mac: Any = None  # the signature's MAC while a thinking block is open
        self._index = -1  # the current block's index
        self._open: str | None = None  # "text" or "tool_use" while a block is open
        self._stop: str | None = None
        self._matched: str | None = None

    def start(self, input_tokens: int) -> bytes:
        message: dict[str, Any] = {
            "id": self._message,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(input_tokens, 0),
        }
        return _event("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking" and self._signer is not None:
            delta = {"type": "signature_delta", "signature": self._signer.finish(self._message, self._mac)}
            out = _event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        self._open = None
        return out + _event("content_block_stop", {"type": "content_block_stop", "index": self._index})

    def _begin(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return out + _event(
            "content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block}
        )

    def update(self, update: ChoiceUpdate) -> bytes:
        out = b""
        if update.reasoning and self._signer is not None:
            if self._open != "thinking":
                out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
                self._mac = self._signer.start(self._message)
            self._mac.update(update.reasoning.encode())
            delta = {"type": "thinking_delta", "thinking": update.reasoning}
            out += _event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        if update.text:
            if self._open != "text":
                out += self._begin({"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": update.text}
            out += _event("content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
        for call in update.tool_calls:
            if call.id is not None:
                out += self._begin({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            if call.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.arguments}
                event = {"type": "content_block_delta", "index": self._index, "delta": delta}
                out += _event("content_block_delta", event)
        if update.finish_reason is not None:
            out += self._close()
            self._stop, self._matched = update.finish_reason, update.stop_sequence
        return out

    def end(self, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> bytes:
        stop_reason, matched = _stop(self._stop, self._matched)
        delta = {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": matched}}
        delta["usage"] = {"output_tokens": completion_tokens}
        return self._close() + _event("message_delta", delta) + _event("message_stop", {"type": "message_stop"})

    @staticmethod
    def error(error: GatewayError) -> bytes:
        return _event("error", error_body(error))


@dataclass(frozen=True, slots=True)
class MessagesExchange:
    """One admitted Messages request."""

    prepared: PreparedCompletion
    stream: bool
    message: str  # the message id

    @property
    def batch(self) -> tuple[PreparedCompletion]:
        return (self.prepared,)

    signer: ThinkingSigner

    def start_stream(self) -> StreamStart:
        encoder = MessagesEncoder(self.message, self.prepared.model, self.signer)
        return StreamStart(encoder, encoder.start(len(self.prepared.prompt_ids)), True)

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        prepared = self.prepared
        return message_body(self.message, prepared.model, results[0], len(prepared.prompt_ids), self.signer)


class MessagesEdge(EdgeBase):
    """Anthropic's Messages API, translated into a chat request and served as one."""

    path: str = "/v1/messages"
    name: str = "anthropic_messages"
    request: type[BaseModel] = MessagesRequest
    history_field: str | None = "messages"

    def __init__(self, service: CompletionService) -> None:
        super().__init__(service)
        self.side_routes = (SideRoute("/v1/messages/count_tokens", CountTokensRequest, self._count_tokens),)

    async def open(self, body: MessagesRequest, call: Call) -> MessagesExchange:
        service = self._service
        chat = to_chat_request(body, service.signer, service.thinking_switch)
        prepared = await service.prepare(chat, **call.placement())
        return MessagesExchange(prepared, body.stream, message_id(), service.signer)

    async def _count_tokens(self, body: CountTokensRequest, tenant: str) -> dict[str, Any]:
        return {"input_tokens": await self._service.count_tokens(to_chat_request(body))}

    error_body = staticmethod(error_body)
