"""OpenAI's Responses API at the edge: ``POST /v1/responses``.

Like :mod:`._anthropic`, a thin translation: a Responses request becomes a chat completion
request (the same template, session tree, turn keys, tool parsers, events and capture), and the
engine's updates become Responses events as they are sampled.

Requests (OpenAI's API reference for ``responses.create``, and the ``openai`` SDK's types):

* ``input``: a string (one user message) or items: messages (``role`` ``user`` / ``system`` /
  ``developer`` / ``assistant``; content a string or ``input_text`` / ``output_text`` /
  ``input_image`` parts; ``input_file`` and ``input_audio``: a clear 400), ``function_call``
  (``call_id``, ``name``, ``arguments``), ``function_call_output`` (``call_id``, ``output``: a
  string, or ``input_text`` / ``input_image`` items as newer clients send a tool's screenshot).
  Content of text alone is joined into one string, as before images; content with an image stays
  a list of chat parts in its order (text, ``image_url``, text ...). An ``input_image``'s
  ``image_url`` (a ``data:`` URL, or an ``http(s)`` one that the core fetches only from allowed
  hosts, docs/images.md) becomes the part's URL, its ``detail`` passed on when it is ``auto`` /
  ``low`` / ``high`` (``original`` is dropped: the model's processor decides the size). A
  ``file_id`` instead (nothing here holds files), another kind of URL, or an image in an
  assistant message: a 400 naming the part (``input.2.content.1``, the dotted form every param of
  this module takes). Decoding, limits and whether the served model reads images are the core's.
  An assistant message and the function calls after it are one assistant turn. ``reasoning``
  items are history the chain does not need (the recorded ids stand in, docs/reasoning.md): their
  text (``content``, else ``summary``) goes with the next assistant turn as ``reasoning_content``,
  for a template to render a foreign one; an ``encrypted_content`` from this gateway is
  recognised. ``instructions`` → a system message first.
* ``tools`` (``type: function``) and ``tool_choice``; hosted tools (``web_search``, ``file_search``,
  ``mcp`` ...), ``namespace`` and ``custom`` tools are not offered to the model (this gateway
  runs no tools; Codex sends several by default); ``text.format`` ``json_schema`` /
  ``json_object`` → constrained decoding; ``max_output_tokens``, ``temperature``, ``top_p``,
  ``parallel_tool_calls``, ``metadata``, ``user``. ``reasoning.effort`` is accepted with no
  effect (the served model thinks as it was trained to); ``reasoning.summary`` (any value but
  ``none``) also streams the thinking as the item's summary; ``include:
  ["reasoning.encrypted_content"]`` (Codex sends it) adds ``encrypted_content`` to reasoning items:
  an opaque signature (no thinking inside) by which this gateway recognises the item when it
  comes back. ``truncation`` and ``store`` are accepted; nothing is stored for later retrieval
  (``GET`` of a response is not offered).
* ``previous_response_id``: continues a response this gateway process produced for the same
  key, if it still holds it (the last :data:`_KEEP` responses); otherwise a 400 that says to
  send the whole conversation as ``input`` instead, as stateless clients (``store: false``) do.

Streams: ``response.created``, ``response.in_progress``, per output item
``response.output_item.added``; for a reasoning model's thinking first a ``reasoning`` item,
``response.reasoning_text.delta`` ... ``response.reasoning_text.done`` (and the
``response.reasoning_summary_*`` events when a summary was asked for); for a message ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``, ``response.content_part.done``,
for a function call ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``; ``response.output_item.done``; then
``response.completed`` (or ``response.incomplete`` at ``max_output_tokens``) with the whole
response. Every event has its ``sequence_number``. An error mid-stream is an ``error`` event.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel

from stream_gateway._errors import GatewayError, InvalidRequest
from stream_gateway.completion import (
    ChatCompletionRequest,
    ChoiceResult,
    ChoiceUpdate,
    CompletionService,
    KeptHistory,
    Message,
    PreparedCompletion,
)
from stream_gateway.protocols._edge import Call, EdgeBase, StreamStart
from stream_gateway.protocols._responses_request import ResponsesRequest, refuse_unsupported
from stream_gateway.reasoning import ThinkingSigner

log = logging.getLogger(__name__)

__all__ = [
    "ResponseStore",
    "ResponsesEdge",
    "ResponsesEncoder",
    "ResponsesRequest",
    "response_body",
    "to_chat_request",
]

_KEEP_BYTES = 256 * 1024 * 1024  # of held conversations, JSON-encoded (images are base64 in them)
_KEEP = 10_000  # responses held for previous_response_id, per process
_IMAGE_DETAILS = ("auto", "low", "high")  # the chat image part's; Responses' "original" is dropped


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat ``image_url`` part of an ``input_image`` (``where``: the part, for a 400)."""
    if part.get("file_id") is not None:
        raise InvalidRequest(
            f"{where}: file ids are not supported (this gateway holds no files): send the image as image_url, "
            "a data: URL.",
            param=where,
        )
    url = part.get("image_url")
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        raise InvalidRequest(
            f"{where}: an input_image needs its image_url: a data: URL or an http(s) URL.", param=where
        )
    image = {"url": url}
    if part.get("detail") in _IMAGE_DETAILS:
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _content(content: Any, where: str, images: bool = True) -> str | list[dict[str, Any]]:
    """Message (or function output) content in chat form: its text joined into one string, as
    for text alone, or its text and image parts in order once it holds an image (``images``:
    whether it may)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}: content must be a string or a list of parts.", param=where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image" and images:
            parts.append(_image_part(part, at))
        elif kind == "input_image":
            raise InvalidRequest(f"{at}: an assistant message carries no images.", param=at)
        elif kind in ("input_file", "input_audio"):
            raise InvalidRequest(f"{at}: {kind} parts are not supported (text and images are).", param=at)
        else:
            raise InvalidRequest(f"{at}: unsupported content part {kind!r}.", param=at)
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _reasoning_text(item: dict[str, Any], where: str, signer: ThinkingSigner | None) -> str:
    """A reasoning input item's text: its ``content``, else its ``summary`` (``""``: none)."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise InvalidRequest(f"{where}: a reasoning item's content and summary are lists of parts.", param=where)
    text = "\n\n".join(str(p.get("text", "")) for p in parts)
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str) and signer is not None and signer.check(sealed, text) == "modified":
        log.info("%s: a reasoning item signed here but changed (or signed with another key): foreign history", where)
    return text


def _messages(
    body: ResponsesRequest,
    history: list[dict[str, Any]],
    signer: ThinkingSigner | None = None,
    start: int = 0,
    offsets: list[int] | None = None,
) -> list[dict[str, Any]]:
    """The chat messages ``history`` and the input items from ``start`` mean (with ``start`` 0, the
    instructions' system message first); ``offsets`` gets, before each item and after the last,
    how many chat messages came before, or -1 where an item could still join the one before (a
    ``function_call`` after an assistant message, an assistant turn after a reasoning item)."""
    out: list[dict[str, Any]] = list(history)
    if body.instructions and not start:  # a continued response takes this request's instructions, as OpenAI's does
        system = {"role": "system", "content": body.instructions}
        if out and out[0]["role"] == "system":
            out[0] = system
        else:
            out.insert(0, system)
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    thought: str | None = None  # a reasoning item's text, for the assistant turn it precedes
    for i, item in enumerate(items[start:], start):
        if offsets is not None:
            offsets.append(_boundary(out, thought))
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(f"{where}: unknown role {role!r}.", param=f"{where}.role")
            content = _content(item.get("content", ""), f"{where}.content", images=role != "assistant")
            out.append({"role": role, "content": content})
            if role == "assistant" and thought:
                out[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            call_id, name = str(item.get("call_id", "")), str(item.get("name", ""))
            if not call_id or not name:
                raise InvalidRequest(f"{where}: a function_call needs call_id and name.", param=where)
            function = {"name": name, "arguments": str(item.get("arguments", ""))}
            call = {"id": call_id, "type": "function", "function": function}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # the same turn as the text before it
                # A new dict: ``last`` may be a stored response's message (previous_response_id).
                out[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
                if not out[-1]["content"]:
                    out[-1]["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thought:
                    out[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call_output":
            output = _content(item.get("output", ""), f"{where}.output")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": output})
        elif kind == "reasoning":
            thought = _reasoning_text(item, where, signer)
        else:
            raise InvalidRequest(f"{where}: unsupported input item type {kind!r}.", param=f"{where}.type")
    if offsets is not None:
        offsets.append(_boundary(out, thought))
    return out


def _boundary(out: list[dict[str, Any]], thought: str | None) -> int:
    """Where the next item's chat messages start, if nothing there depends on what came before."""
    return len(out) if thought is None and (not out or out[-1]["role"] != "assistant") else -1


def to_chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]] | None = None, signer: ThinkingSigner | None = None
) -> ChatCompletionRequest:
    """The chat completion request that ``body`` means (after ``history``, a previous response's).

    Translated through the body's kept history (``completion/_kept.py``): a continuing body
    translates only the items it adds after a boundary nothing crosses (the chat messages of the
    repeated items are the kept history's, the very objects). A continued response (``history``)
    is translated whole and not kept."""
    if history:
        return _chat_request(body, _messages(body, history, signer))

    def translate(start: int, starts: list[int]) -> ChatCompletionRequest:
        return _chat_request(body, _messages(body, [], signer, start, starts))

    return KeptHistory.of(body).translated(translate, body.instructions)


def _chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    refuse_unsupported(body)
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    # Hosted tools (web_search, file_search, mcp ...), namespaces and custom (freeform) tools run
    # on OpenAI's side or need a grammar per tool: this gateway runs no tools, so they are not
    # offered to the model (Codex sends several by default).
    functions = [tool for tool in body.tools or () if tool.type == "function"]
    if functions:
        tools = []
        for tool in functions:
            if not tool.name:
                raise InvalidRequest("A function tool needs a name.", param="tools")
            function: dict[str, Any] = {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.parameters,
            }
            if tool.strict is not None:
                function["strict"] = tool.strict
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    if isinstance(body.tool_choice, dict) and body.tool_choice.get("type") == "allowed_tools":
        fields["tool_choice"] = _allowed_tools(body.tool_choice)
    elif isinstance(body.tool_choice, dict):
        if body.tool_choice.get("type") != "function" or not body.tool_choice.get("name"):
            raise InvalidRequest(
                "tool_choice must name a function ({type: function, name}) or be {type: allowed_tools, mode, tools}.",
                param="tool_choice",
            )
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice["name"]}}
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    if body.max_output_tokens is not None:
        fields["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "metadata", "user"):
        if (value := getattr(body, name)) is not None:
            fields[name] = value
    if body.stream:
        fields |= {"stream": True, "stream_options": {"include_usage": True}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "output", "schema": fmt.schema_ or {}, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    if not fields["messages"] or fields["messages"][-1]["role"] == "assistant":
        raise InvalidRequest("The input must end with a user message or a function_call_output.", param="input")
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


class ResponseStore:
    """The last responses of this process, for ``previous_response_id``: id → (tenant, messages)."""

    def __init__(self, keep: int = _KEEP, budget_bytes: int = _KEEP_BYTES) -> None:
        self._keep = keep
        self._budget = budget_bytes
        self._bytes = 0
        self._held: OrderedDict[str, tuple[str, list[dict[str, Any]], int]] = OrderedDict()

    def put(self, response_id: str, tenant: str, messages: list[dict[str, Any]]) -> None:
        # Bounded by count and by size: a conversation of screenshots holds megabytes of base64.
        size = len(orjson.dumps(messages))
        old = self._held.pop(response_id, None)
        if old is not None:
            self._bytes -= old[2]
        self._held[response_id] = (tenant, messages, size)
        self._bytes += size
        while len(self._held) > self._keep or (self._bytes > self._budget and len(self._held) > 1):
            self._bytes -= self._held.popitem(last=False)[1][2]

    def history(self, response_id: str, tenant: str) -> list[dict[str, Any]]:
        """The whole conversation of a held response of ``tenant`` (its own output last); else 400."""
        held = self._held.get(response_id)
        if held is None or held[0] != tenant:
            raise InvalidRequest(
                f"Previous response `{response_id}` is not held by this gateway (responses are not stored; it "
                "keeps the last ones of this process only). Send the whole conversation as `input` instead.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        copy: list[dict[str, Any]] = orjson.loads(orjson.dumps(held[1]))  # merged into: never the held one
        return copy


def response_id() -> str:
    return f"resp_{secrets.token_hex(12)}"


def assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat form of a response's output items, to continue from with ``previous_response_id``."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in output
        if item["type"] == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def _usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def _shell(rid: str, created: int, model: str, body: ResponsesRequest, status: str) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
        "previous_response_id": body.previous_response_id,
        "store": bool(body.store),
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters,
                "strict": t.strict,
            }
            for t in body.tools or ()
            if t.type == "function"
        ],
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "truncation": "disabled",
        "metadata": body.metadata or {},
        **({"user": body.user} if body.user is not None else {}),
        # Every field the Open Responses schema requires, with what the request asked or the default
        # (issue 58): null only where that schema allows it.
        "completed_at": None,
        "reasoning": _reasoning_config(body),
        "max_tool_calls": body.max_tool_calls,  # it bounds built-in tools, which this gateway runs none of
        "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key,
        "presence_penalty": 0.0,  # penalties are refused by chat's rules; a response never has one
        "frequency_penalty": 0.0,
        "top_logprobs": 0,  # more are refused (_responses_request.refuse_unsupported)
        "background": False,  # background responses are refused (_responses_request.refuse_unsupported)
        "service_tier": "default",
        "usage": None,  # until the response ends (_finish)
    }


def _reasoning_config(body: ResponsesRequest) -> dict[str, Any] | None:
    """The request's ``reasoning`` as the response echoes it (``effort``, ``summary``), or null."""
    if not body.reasoning:
        return None
    return {"effort": body.reasoning.get("effort"), "summary": body.reasoning.get("summary")}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str, summary: bool, sealed: str | None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "reasoning",
        "id": item_id,
        "summary": [{"type": "summary_text", "text": text}] if summary else [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }
    if sealed is not None:
        item["encrypted_content"] = sealed
    return item


def _wants_summary(body: ResponsesRequest) -> bool:
    return bool(body.reasoning and body.reasoning.get("summary") not in (None, "none"))


def _wants_sealed(body: ResponsesRequest) -> bool:
    return "reasoning.encrypted_content" in (body.include or ())


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def _finish(
    shell: dict[str, Any], finish_reason: str | None, input_tokens: int, output_tokens: int, reasoning_tokens: int
) -> None:
    if finish_reason == "length":
        shell["status"] = "incomplete"
        shell["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        shell["status"] = "completed"
        shell["completed_at"] = int(time.time())
    shell["usage"] = _usage(input_tokens, output_tokens, reasoning_tokens)


def response_body(
    rid: str,
    created: int,
    model: str,
    body: ResponsesRequest,
    result: ChoiceResult,
    input_tokens: int,
    signer: ThinkingSigner | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) response."""
    shell = _shell(rid, created, model, body, "completed")
    thought = result.reasoning
    if thought:
        sealed = signer.sign(rid, thought) if signer is not None and _wants_sealed(body) else None
        shell["output"].append(_reasoning_item(f"rs_{rid[5:]}", thought, "completed", _wants_summary(body), sealed))
    text = "".join(result.text_parts)
    if text:
        shell["output"].append(_message_item(f"msg_{rid[5:]}", text, "completed"))
    for call in result.tool_calls():
        shell["output"].append(_call_item(call.id, call.name, call.arguments, "completed"))
    _finish(shell, result.finish_reason, input_tokens, len(result.token_ids), result.reasoning_tokens)
    return shell


def error_event(error: GatewayError, sequence: int) -> dict[str, Any]:
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param,
            "sequence_number": sequence}  # fmt: skip


class ResponsesEncoder:
    """Responses stream events from a chat response's updates (one choice)."""

    __slots__ = (
        "_calls",
        "_finish",
        "_id",
        "_input_tokens",
        "_mac",
        "_on_end",
        "_open",
        "_reasoning_tokens",
        "_seq",
        "_shell",
        "_signer",
        "_summary",
        "_text",
        "_thought",
    )

    def __init__(
        self,
        rid: str,
        created: int,
        model: str,
        body: ResponsesRequest,
        input_tokens: int,
        on_end: Callable[[dict[str, Any]], None] | None = None,
        signer: ThinkingSigner | None = None,
    ) -> None:
        """``on_end`` is called with the whole response once it has ended."""
        self._id = rid
        self._summary = _wants_summary(body)
        self._signer = signer if _wants_sealed(body) else None
        self._mac: Any = None
        self._thought: list[str] | None = None  # the open reasoning item's text
        self._reasoning_tokens = 0
        self._input_tokens = input_tokens
        self._finish: str | None = None
        self._on_end = on_end
        self._seq = 0
        self._shell = _shell(rid, created, model, body, "in_progress")
        self._text: list[str] | None = None  # the open message item's text
        self._calls: dict[int, list[str]] = {}  # open function call: index -> [call_id, name, arguments]
        self._open: int | None = None  # output index of the open item

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {"type": kind, **data, "sequence_number": self._seq}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def start(self) -> bytes:
        return self._event("response.created", {"response": self._shell}) + self._event(
            "response.in_progress", {"response": self._shell}
        )

    @property
    def _item_id(self) -> str:
        return f"msg_{self._id[5:]}"

    def _close(self) -> bytes:
        index, out = self._open, b""
        if index is None:
            return out
        self._open = None
        if self._thought is not None:
            events, item = self._close_reasoning(index)
            out += events
        elif self._text is not None:
            text, self._text = "".join(self._text), None
            where = {"item_id": self._item_id, "output_index": index, "content_index": 0}
            out += self._event("response.output_text.done", {**where, "text": text, "logprobs": []})
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out += self._event("response.content_part.done", {**where, "part": part})
            item = _message_item(self._item_id, text, "completed")
        else:
            [(call_id, name, arguments)] = self._calls.values()
            self._calls.clear()
            item = _call_item(call_id, name, arguments, "completed")
            done = {"item_id": item["id"], "output_index": index, "name": name, "arguments": arguments}
            out += self._event("response.function_call_arguments.done", done)
        self._shell["output"].append(item)
        return out + self._event("response.output_item.done", {"output_index": index, "item": item})

    def _close_reasoning(self, index: int) -> tuple[bytes, dict[str, Any]]:
        text, self._thought = "".join(self._thought or ()), None
        item_id = f"rs_{self._id[5:]}"
        sealed = self._signer.finish(self._id, self._mac) if self._signer is not None else None
        where = {"item_id": item_id, "output_index": index}
        out = self._event("response.reasoning_text.done", {**where, "content_index": 0, "text": text})
        if self._summary:
            part = {"type": "summary_text", "text": text}
            out += self._event("response.reasoning_summary_text.done", {**where, "summary_index": 0, "text": text})
            out += self._event("response.reasoning_summary_part.done", {**where, "summary_index": 0, "part": part})
        return out, _reasoning_item(item_id, text, "completed", self._summary, sealed)

    def _reason(self, text: str) -> bytes:
        out = b""
        item_id = f"rs_{self._id[5:]}"
        if self._thought is None:
            out += self._close()
            self._open, self._thought = len(self._shell["output"]), []
            if self._signer is not None:
                self._mac = self._signer.start(self._id)
            item = _reasoning_item(item_id, "", "in_progress", False, None)
            item["content"] = []
            out += self._event("response.output_item.added", {"output_index": self._open, "item": item})
            if self._summary:
                part = {"type": "summary_text", "text": ""}
                where = {"item_id": item_id, "output_index": self._open, "summary_index": 0}
                out += self._event("response.reasoning_summary_part.added", {**where, "part": part})
        self._thought.append(text)
        if self._mac is not None:
            self._mac.update(text.encode())
        where = {"item_id": item_id, "output_index": self._open}
        out += self._event("response.reasoning_text.delta", {**where, "content_index": 0, "delta": text})
        if self._summary:
            out += self._event("response.reasoning_summary_text.delta", {**where, "summary_index": 0, "delta": text})
        return out

    def update(self, update: ChoiceUpdate) -> bytes:
        out = self._reason(update.reasoning) if update.reasoning else b""
        if update.text:
            if self._text is None:
                out += self._close()
                self._open, self._text = len(self._shell["output"]), []
                item = {**_message_item(self._item_id, "", "in_progress"), "content": []}
                out += self._event("response.output_item.added", {"output_index": self._open, "item": item})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                where = {"item_id": self._item_id, "output_index": self._open, "content_index": 0}
                out += self._event("response.content_part.added", {**where, "part": part})
            self._text.append(update.text)
            where = {"item_id": self._item_id, "output_index": self._open, "content_index": 0}
            out += self._event("response.output_text.delta", {**where, "delta": update.text, "logprobs": []})
        for call in update.tool_calls:
            if call.id is not None:
                out += self._close()
                self._open = len(self._shell["output"])
                self._calls[call.index] = [call.id, call.name or "", ""]
                item = _call_item(call.id, call.name or "", "", "in_progress")
                out += self._event("response.output_item.added", {"output_index": self._open, "item": item})
            if call.arguments and call.index in self._calls:
                entry = self._calls[call.index]
                entry[2] += call.arguments
                delta = {"item_id": f"fc_{entry[0]}", "output_index": self._open, "delta": call.arguments}
                out += self._event("response.function_call_arguments.delta", delta)
        if update.finish_reason is not None:
            out += self._close()
            self._finish = update.finish_reason
            self._reasoning_tokens = update.reasoning_tokens
        return out

    def end(self, prompt_tokens: int, completion_tokens: int, include_usage: bool) -> bytes:
        out = self._close()
        _finish(self._shell, self._finish, self._input_tokens, completion_tokens, self._reasoning_tokens)
        if self._on_end is not None:
            self._on_end(self._shell)
        kind = "response.incomplete" if self._shell["status"] == "incomplete" else "response.completed"
        return out + self._event(kind, {"response": self._shell})

    def error(self, error: GatewayError) -> bytes:
        data = error_event(error, self._seq)
        self._seq += 1
        return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


def created_now() -> int:
    return int(time.time())


@dataclass(frozen=True, slots=True)
class ResponsesExchange:
    """One admitted Responses request; a finished one is held for ``previous_response_id``."""

    prepared: PreparedCompletion
    request: ResponsesRequest
    rid: str
    tenant: str
    conversation: list[dict[str, Any]]  # the chat messages it was served as
    held: ResponseStore
    signer: ThinkingSigner

    @property
    def stream(self) -> bool:
        return self.request.stream

    @property
    def batch(self) -> tuple[PreparedCompletion]:
        return (self.prepared,)

    def start_stream(self) -> StreamStart:
        prepared = self.prepared
        encoder = ResponsesEncoder(
            self.rid,
            prepared.created,
            prepared.model,
            self.request,
            len(prepared.prompt_ids),
            self._remember,
            self.signer,
        )
        return StreamStart(encoder, encoder.start(), True)

    def body(self, results: list[ChoiceResult]) -> dict[str, Any]:
        prepared = self.prepared
        response = response_body(
            self.rid, prepared.created, prepared.model, self.request, results[0], len(prepared.prompt_ids), self.signer
        )
        self._remember(response)
        return response

    def _remember(self, response: dict[str, Any]) -> None:
        if response["status"] == "completed" or response["status"] == "incomplete":
            self.held.put(self.rid, self.tenant, [*self.conversation, assistant_message(response["output"])])


class ResponsesEdge(EdgeBase):
    """OpenAI's Responses API, translated into a chat request and served as one."""

    path: str = "/v1/responses"
    name: str = "openai_responses"
    request: type[BaseModel] = ResponsesRequest
    history_field: str | None = "input"

    def __init__(self, service: CompletionService, held: ResponseStore | None = None) -> None:
        super().__init__(service)
        self._held = held if held is not None else ResponseStore()

    async def open(self, body: ResponsesRequest, call: Call) -> ResponsesExchange:
        previous = body.previous_response_id
        history = self._held.history(previous, call.tenant) if previous else None
        service = self._service
        chat = to_chat_request(body, history, service.signer)
        prepared = await service.prepare(chat, **call.placement())
        conversation = _conversation(chat)
        return ResponsesExchange(prepared, body, response_id(), call.tenant, conversation, self._held, service.signer)


def _conversation(chat: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The chat messages as the response store keeps them, the kept history's already dumped."""
    return KeptHistory.of(chat).each("stored", chat.messages, _stored)


def _stored(message: Message) -> dict[str, Any]:
    return message.model_dump(exclude_none=True)


def _allowed_tools(choice: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's flat ``{type: allowed_tools, mode, tools: [{type: function, name}]}`` as
    chat's ``{type: allowed_tools, allowed_tools: {mode, tools: [{type: function, function: {name}}]}}``
    (what the mode and names may be is checked there, as for chat requests)."""
    entries = choice.get("tools")
    if isinstance(entries, list):
        entries = [
            {"type": "function", "function": {"name": e.get("name")}}
            if isinstance(e, dict) and e.get("type") == "function" and "function" not in e
            else e
            for e in entries
        ]
    return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": entries}}
