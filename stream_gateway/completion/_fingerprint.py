"""Message fingerprints: when is a message the client sends "the same" as one we know?

Agents re-serialise the history they echo back. These differences are not differences:

* tool-call ``arguments`` re-encoded (key order, whitespace): compared as parsed JSON;
* tool-call ids rewritten (OpenClaw strips non-alphanumerics): ids are not compared at all, on
  assistant tool calls or on tool results' ``tool_call_id``;
* ``content`` as a string or as a list of text parts; ``null`` vs ``""``; surrounding whitespace;
* reasoning (``reasoning_content``, ``reasoning``, a ``<think>...</think>`` block leading the
  content, Anthropic ``thinking`` blocks, Responses ``reasoning`` items) echoed, dropped,
  summarised or re-shaped: never compared (the sampled ids stand in for it);
* ``developer`` vs ``system``.

Images are compared by their place among a message's parts and a digest of their URL: for the
``data:`` URLs clients send, the image's bytes; another image is another conversation.

Everything else (roles, text, tool names, argument values, order) is compared exactly.
A fingerprint is a short digest, and a conversation prefix is identified by a rolling digest
of its messages' fingerprints, so a lookup costs one hash per message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import orjson

from stream_gateway.completion._kept import KeptHistory
from stream_gateway.completion._request import ChatCompletionRequest, Message

Fingerprint = bytes


def canonical_arguments(arguments: str) -> Any:
    """Tool-call arguments as a comparable value (parsed JSON, or the raw string if not JSON)."""
    try:
        return orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments.strip()


def assistant_fingerprint(content: str, tool_calls: Sequence[tuple[str, str]]) -> Fingerprint:
    """Fingerprint of an assistant message from its text and ``(name, arguments)`` calls."""
    calls = [[name, canonical_arguments(arguments)] for name, arguments in tool_calls]
    if "</think>" in content:  # thinking echoed inline, before the answer: not the answer
        content = content.rpartition("</think>")[2]
    return _digest(["assistant", content.strip(), calls])


def message_fingerprint(message: Message) -> Fingerprint:
    """Fingerprint of a request message, blind to the re-serialisations listed above."""
    if message.role == "assistant":
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]
        return assistant_fingerprint(message.text(), calls)
    role = "system" if message.role == "developer" else message.role
    images = message.images()
    if images:  # each image by its place among the parts and a digest of its URL (its bytes, for data: URLs)
        where = [[j, hashlib.blake2b(part.image_url.url.encode(), digest_size=16).hexdigest()] for j, part in images]
        return _digest([role, message.text().strip(), message.name or "", where])
    return _digest([role, message.text().strip(), message.name or ""])


def tools_fingerprint(tools: Sequence[Any] | None) -> Fingerprint:
    """Fingerprint of the request's tool definitions: they are part of the rendered prompt."""
    return _digest([t.model_dump(exclude_none=True) for t in tools] if tools else [])


def prefix_keys(seed: Fingerprint, fingerprints: Sequence[Fingerprint]) -> list[bytes]:
    """``keys[i]`` identifies the conversation prefix ``fingerprints[:i + 1]`` under ``seed``."""
    keys = []
    state = seed
    for fp in fingerprints:
        state = extend_key(state, fp)
        keys.append(state)
    return keys


def extend_key(key: bytes, fingerprint: Fingerprint) -> bytes:
    """The key of the conversation ``key`` identifies, followed by one more message."""
    return hashlib.blake2b(key + fingerprint, digest_size=16).digest()


def conversation_keys(body: ChatCompletionRequest) -> list[bytes]:
    """``keys[i]`` identifies the conversation ``body.messages[:i + 1]`` under its tools: the kept
    history's keys for the messages it repeats (``_kept.py``), one hash per message for the rest."""
    seed = tools_fingerprint(body.tools)
    return KeptHistory.of(body).running("keyed", body.messages, seed, _extended, under=seed)


def _extended(key: bytes, message: Message) -> bytes:
    return extend_key(key, message_fingerprint(message))


def _digest(value: Any) -> Fingerprint:
    return hashlib.blake2b(orjson.dumps(value, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
