"""What every dialect reads off the wire the same way: SSE frames, error bodies, finish reasons.

The frames of one read arrive as one list (:class:`SseFrames`), so a dialect can turn the
tokens that arrived together into one step. Errors an upstream reports in its body or its frames
become :class:`UpstreamFailed`, never a foreign exception.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from stream_gateway._errors import GatewayError, UpstreamFailed
from stream_gateway.engines._base import EngineStep, FinishReason, merge_steps

__all__ = [
    "SseFrames",
    "UpstreamFailed",
    "by_version",
    "describe",
    "error_message",
    "error_param",
    "finish_reason",
    "numeric_version",
    "token_id",
    "top_from_dict",
    "top_from_pairs",
]

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "eos_token": "stop"}


class SseFrames:
    """The JSON ``data:`` payloads of an SSE body, read as its bytes arrive: :meth:`feed` takes one
    read's bytes and returns the payloads they completed, together (one read, so a dialect can turn
    the tokens that arrived together into one step); error payloads raise :class:`UpstreamFailed`.
    :attr:`done` once ``[DONE]`` was read.

    Synchronous on purpose: the remote engine calls it between one read and the next, so a token
    costs no generator layer here (``docs/performance.md``, "The floor")."""

    __slots__ = ("_buffer", "done", "where")

    def __init__(self, where: str) -> None:
        self.where = where  # the server, for messages
        self._buffer = b""  # an unfinished frame
        self.done = False

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """The payloads that ``chunk`` completed (none after ``[DONE]``)."""
        # The common case, one whole ``data:`` frame per read (a token a frame): no splitting.
        if not self._buffer and chunk.startswith(b"data: {") and chunk.find(b"\n\n") == len(chunk) - 2:
            return [self._event(chunk[6:])]
        buffer = self._buffer + chunk if self._buffer else chunk
        if b"\n\n" not in buffer:
            self._buffer = buffer
            return []
        blocks = buffer.split(b"\n\n")
        self._buffer = blocks.pop()  # the unfinished rest
        events: list[dict[str, Any]] = []
        for block in blocks:
            for line in block.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue  # comments (keep-alives), event names, ids
                data = line[5:].strip()
                if data == b"[DONE]":
                    self.done = True
                    self._buffer = b""
                    return events
                events.append(self._event(data))
        return events

    def _event(self, data: bytes) -> dict[str, Any]:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise UpstreamFailed(f"The inference server sent an unreadable frame: {data[:200]!r}") from exc
        if not isinstance(event, dict):
            raise UpstreamFailed(f"The inference server sent a frame that is not an object: {data[:200]!r}")
        if "error" in event or event.get("object") == "error":
            message = error_message(data) or "unknown error"
            raise UpstreamFailed(f"The inference server {self.where} failed: {message}")
        return event


def by_version(pieces: list[EngineStep]) -> list[EngineStep]:
    """Steps that arrived together, merged where consecutive ones were sampled by one weight version."""
    if len(pieces) < 2:
        return pieces
    merged: list[EngineStep] = []
    start = 0
    for i in range(1, len(pieces) + 1):
        if i == len(pieces) or pieces[i].policy_version != pieces[start].policy_version:
            group = pieces[start:i]
            merged.append(group[0] if len(group) == 1 else merge_steps(group))
            start = i
    return merged


def error_param(raw: bytes) -> str | None:
    """The ``param`` of an OpenAI-style error body."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    param = error.get("param") if isinstance(error, dict) else None
    return param if isinstance(param, str) else None


def error_message(raw: bytes) -> str | None:
    """The message of an error body (OpenAI's ``error.message``, FastAPI's ``detail``, or the text)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:300].decode("utf-8", "replace") or None
    if not isinstance(body, dict):
        return None
    error = body.get("error", body)
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


def finish_reason(finish: object, url: str) -> FinishReason | None:
    """An OpenAI-style finish reason as the engines name it; one they do not know fails the request."""
    if finish is None:
        return None
    reason = _FINISH.get(str(finish))
    if reason is None:
        raise UpstreamFailed(f"The inference server {url} ended the request with finish_reason {finish!r}.")
    return reason


def token_id(token: str) -> int:
    """The id of a token written as vLLM's ``return_tokens_as_token_ids`` writes it (``token_id:N``)."""
    if not token.startswith("token_id:"):
        raise UpstreamFailed("the server must return tokens as token ids (return_tokens_as_token_ids)")
    return int(token[9:])


def top_from_dict(entry: Mapping[str, float] | None, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely alternatives of an OpenAI-style ``top_logprobs`` entry, keyed by token id."""
    if not entry:
        return ()
    pairs = sorted(((token_id(k), float(v)) for k, v in entry.items()), key=lambda p: -p[1])
    return tuple(pairs[:n])


def top_from_pairs(entry: Sequence[Sequence[Any]] | None, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` first alternatives of ``[[logprob, id, text], ...]`` (SGLang's form)."""
    if not entry:
        return ()
    return tuple((int(e[1]), float(e[0])) for e in entry[:n])


def numeric_version(value: object) -> int | None:
    """A weight version label that is a number (``3``, ``"3"``); anything else is ``None``."""
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def describe(exc: BaseException) -> str:
    """A short text for a failure, for logs and the pool's view of a server."""
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, GatewayError):
        return exc.message
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
