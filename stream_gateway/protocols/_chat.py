"""Encoding of ``chat.completion.chunk`` SSE frames and ``chat.completion`` bodies.

Thinking (a reasoning model's, see docs/reasoning.md) goes in ``delta.reasoning_content`` (the
name DeepSeek, LiteLLM, LangChain and OpenClaw read) and the same text in ``delta.reasoning`` (the
name vLLM and pi read), never in ``content``; whole bodies carry ``message.reasoning_content`` and
``message.reasoning``, and usage counts ``completion_tokens_details.reasoning_tokens``.

This is the per-token hot path, so frames are built as bytes: the part of every chunk that never
changes (id, object, created, model) is encoded once per response, and each token only costs one
``orjson.dumps`` of a small choice dict. Frames are complete ``data: ...\\n\\n`` SSE events that
sse-starlette passes through untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel

from stream_gateway._errors import GatewayError
from stream_gateway.completion import (
    ChatCompletionRequest,
    ChoiceResult,
    ChoiceUpdate,
    PreparedCompletion,
    TokenText,
)
from stream_gateway.protocols._edge import Call, EdgeBase, StreamStart
from stream_gateway.tool_parsers import ToolCallDelta

DONE_FRAME = b"data: [DONE]\n\n"


def logprobs_content(
    token_text: TokenText,
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top_logprobs: Sequence[tuple[tuple[int, float], ...]] | None,
) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries for the given tokens."""
    entries = []
    for i, (token, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
        text, raw = token_text(token)
        alternatives = []
        if top_logprobs:
            for alt, alt_logprob in top_logprobs[i]:
                alt_text, alt_raw = token_text(alt)
                # -inf (filtered out by top-k/top-p or a grammar) as OpenAI writes "very unlikely":
                # its schema requires a number, and JSON has no infinity.
                alternatives.append({"token": alt_text, "logprob": max(alt_logprob, -9999.0), "bytes": alt_raw})
        entries.append({"token": text, "logprob": logprob, "bytes": raw, "top_logprobs": alternatives})
    return entries


def frame_head(completion_id: str, kind: str, created: int, model: str) -> bytes:
    """The constant start of every frame of one response: ``data: {"id":..,"object":..,"created":..,"model":..``."""
    return (
        b'data: {"id":'
        + orjson.dumps(completion_id)
        + b',"object":'
        + orjson.dumps(kind)
        + b',"created":'
        + str(created).encode()
        + b',"model":'
        + orjson.dumps(model)
    )


_CONTENT_TAIL = b'},"logprobs":null,"finish_reason":null}]}\n\n'


class ChunkEncoder:
    """Builds the SSE frames of one streamed response."""

    __slots__ = (
        "_content_head",
        "_head",
        "_legacy",
        "_logprobs",
        "_plain",
        "_reasoning",
        "_reasoning_tokens",
        "_token_ids",
        "_token_text",
    )

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        *,
        token_text: TokenText,
        logprobs: bool,
        token_ids: bool,
        legacy_functions: bool = False,
        reasoning: bool = False,
    ) -> None:
        self._head = frame_head(completion_id, "chat.completion.chunk", created, model)
        self._reasoning = reasoning  # the model thinks: usage counts its reasoning tokens
        self._reasoning_tokens = 0
        self._token_text = token_text
        self._logprobs = logprobs
        self._token_ids = token_ids
        self._legacy = legacy_functions
        # Most frames are a piece of content and nothing else: their bytes around the text are constant.
        self._plain = not (logprobs or token_ids)
        self._content_head = self._head + b',"choices":[{"index":0,"delta":{"content":'

    def _frame(self, choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> bytes:
        tail = b"" if not extra else b"," + orjson.dumps(extra)[1:-1]
        return self._head + b',"choices":' + orjson.dumps(choices) + tail + b"}\n\n"

    def role(self, n: int, prompt_token_ids: Sequence[int] | None) -> bytes:
        """The first frame: the assistant role for every choice (and the prompt ids if asked)."""
        choices = [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(n)
        ]
        extra = {"prompt_token_ids": list(prompt_token_ids)} if prompt_token_ids is not None else None
        return self._frame(choices, extra)

    def update(self, update: ChoiceUpdate) -> bytes:
        """A content delta, with finish reason, logprobs and token ids as configured."""
        if (
            self._plain
            and update.text
            and update.finish_reason is None
            and not update.index
            and not update.reasoning
            and not update.tool_calls
        ):  # what the general case below writes for it, without building it
            return self._content_head + orjson.dumps(update.text) + _CONTENT_TAIL
        delta: dict[str, Any] = {"content": update.text} if update.text else {}
        if update.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = update.reasoning
        finish = update.finish_reason
        if finish is not None:
            self._reasoning_tokens += update.reasoning_tokens
        if self._legacy:
            call = _function_call_delta(update.tool_calls)
            if call is not None:
                delta["function_call"] = call
            if finish == "tool_calls":
                finish = "function_call"
        elif update.tool_calls:
            delta["tool_calls"] = [_tool_call_delta(d) for d in update.tool_calls]
        choice: dict[str, Any] = {
            "index": update.index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
        }
        if self._logprobs:
            choice["logprobs"] = {
                "content": logprobs_content(self._token_text, update.token_ids, update.logprobs, update.top_logprobs),
                "refusal": None,
            }
        if self._token_ids:
            choice["token_ids"] = update.token_ids
        return self._frame([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The usage frame, with ``choices: []``, sent after the last choice finished."""
        reasoning = self._reasoning_tokens if self._reasoning else None
        return self._frame([], {"usage": usage_body(prompt_tokens, completion_tokens, reasoning)})

    def end(self, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> bytes:
        """The last write: the usage frame (if asked) and ``[DONE]``."""
        return self.usage(prompt_tokens, completion_tokens) + DONE_FRAME if include_usage else DONE_FRAME

    @staticmethod
    def error(error: GatewayError) -> bytes:
        """An error event in the stream (the OpenAI SDKs raise it as an API error), then ``[DONE]`` as vLLM ends one."""
        return b"data: " + orjson.dumps(error.body()) + b"\n\n" + DONE_FRAME


def _tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {
        "index": delta.index,
        "id": delta.id,
        "type": "function",
        "function": {"name": delta.name, "arguments": delta.arguments},
    }


def _function_call_delta(deltas: Sequence[ToolCallDelta]) -> dict[str, Any] | None:
    # The legacy shape holds one call: the first one's fragments (a model that calls several
    # tools in one turn has the rest recorded, but a ``functions`` client cannot be told).
    out: dict[str, Any] | None = None
    for delta in deltas:
        if delta.index != 0:
            continue
        if out is None:
            out = {"name": delta.name, "arguments": delta.arguments} if delta.id is not None else {"arguments": ""}
            if delta.id is not None:
                continue
        out["arguments"] += delta.arguments
    return out


def usage_body(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object (``reasoning_tokens``: counted in ``completion_tokens_details``)."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def completion_body(
    completion_id: str,
    created: int,
    model: str,
    prompt_token_ids: Sequence[int],
    results: Sequence[ChoiceResult],
    *,
    token_text: TokenText,
    logprobs: bool,
    token_ids: bool,
    legacy_functions: bool = False,
    reasoning: bool = False,
) -> dict[str, Any]:
    """A whole non-streamed ``chat.completion`` body (``reasoning``: the model thinks)."""
    choices = []
    for result in results:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(result.text_parts), "refusal": None}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = result.reasoning or None
        calls = result.tool_calls()
        finish = result.finish_reason
        if calls:
            if legacy_functions:  # one call in the legacy shape (see _function_call_delta)
                message["function_call"] = {"name": calls[0].name, "arguments": calls[0].arguments}
                finish = "function_call" if finish == "tool_calls" else finish
            else:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
            if not message["content"].strip():
                message["content"] = None  # as OpenAI sends a message that only calls tools
        choice: dict[str, Any] = {
            "index": result.index,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
        }
        if logprobs:
            top = result.top_logprobs or None
            choice["logprobs"] = {
                "content": logprobs_content(token_text, result.token_ids, result.logprobs, top),
                "refusal": None,
            }
        if token_ids:
            choice["token_ids"] = result.token_ids
        choices.append(choice)
    body: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_body(
            len(prompt_token_ids),
            sum(len(r.token_ids) for r in results),
            sum(r.reasoning_tokens for r in results) if reasoning else None,
        ),
    }
    if token_ids:
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


@dataclass(frozen=True, slots=True)
class ChatExchange:
    """One admitted chat completion."""

    prepared: PreparedCompletion
    stream: bool
    token_text: TokenText

    @property
    def batch(self) -> tuple[PreparedCompletion]:
        return (self.prepared,)

    def start_stream(self) -> StreamStart:
        prepared = self.prepared
        encoder = ChunkEncoder(
            prepared.completion_id,
            prepared.created,
            prepared.model,
            token_text=self.token_text,
            logprobs=prepared.logprobs,
            token_ids=prepared.return_token_ids,
            legacy_functions=prepared.legacy_functions,
            reasoning=prepared.reasoning is not None,
        )
        first = encoder.role(prepared.n, prepared.prompt_ids if prepared.return_token_ids else None)
        return StreamStart(encoder, first, prepared.include_usage)

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        prepared = self.prepared
        return completion_body(
            prepared.completion_id,
            prepared.created,
            prepared.model,
            prepared.prompt_ids,
            results,
            token_text=self.token_text,
            logprobs=prepared.logprobs,
            token_ids=prepared.return_token_ids,
            legacy_functions=prepared.legacy_functions,
            reasoning=prepared.reasoning is not None,
        )


class ChatEdge(EdgeBase):
    """OpenAI's chat completions, the core's own shape."""

    path: str = "/v1/chat/completions"
    name: str = "chat_completion"
    request: type[BaseModel] = ChatCompletionRequest
    history_field: str | None = "messages"

    async def open(self, body: ChatCompletionRequest, call: Call) -> ChatExchange:
        prepared = await self._service.prepare(body, **call.placement())
        return ChatExchange(prepared, body.stream, self._service.token_text)
