"""Tool calls in model output text, parsed whole or while it streams, per model family.

A parser turns the text of one choice into content and :class:`ToolCall` objects. The Hermes
format (also Qwen2.5/Qwen3's) wraps each call in tags, several in a row being parallel calls::

    Let me look.
    <tool_call>
    {"name": "read", "arguments": {"path": "a.txt"}}
    </tool_call>

Choices, and why:

- Buffer, then emit. Text outside the tags streams as content at once; a call is held until its
  end tag and then sent whole (one delta with id and name, one with all the arguments). An agent
  cannot run a call before it is complete, so this costs it no latency, and a malformed call can
  fall back to content without retracting anything already sent.
- Malformed calls are content, never errors: bad JSON, no string ``name``, ``arguments`` neither
  an object nor a JSON string of one, or (when the request's tool names are given) a function the
  request did not offer. The original text comes back verbatim, whitespace around it included.
  ``"arguments": null`` or no ``arguments`` means ``{}``.
- A block that generation leaves unterminated is content (vLLM instead tries to parse it).
- The whitespace run on either side of a valid call is dropped (vLLM keeps it). The chat
  templates put their own ``\\n`` around calls when history is rendered, so stripped content
  renders back to what the model wrote. To stream this, trailing whitespace is held back until
  the next visible character shows it is not followed by a call.
- A tag inside a call's JSON strings ends the call early (the call then fails as content), as in
  vLLM: the body is not scanned as JSON while it streams.
- Arguments are re-encoded compactly with orjson, so a client's echo can be compared semantically;
  integers beyond 64 bits become floats, as orjson reads them.
- Ids are ``call`` + 24 hex digits: alphanumeric, because OpenClaw strips anything else from ids
  it echoes back.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import orjson

__all__ = [
    "TOOL_PARSERS",
    "ParsedDelta",
    "TaggedToolCallParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStreamParser",
    "ToolParserFactory",
    "create_tool_parser",
    "parse_tool_calls",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete call: ``arguments`` is a compact JSON object."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """An entry of a streamed ``delta.tool_calls``: the first for a call carries ``id`` and ``name``."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedDelta:
    """What may be sent now for one choice: content and tool-call deltas, either possibly empty."""

    content: str
    tool_calls: tuple[ToolCallDelta, ...] = ()


class ToolCallStreamParser(Protocol):
    """Incremental parser for one choice; ``feed`` text as it is generated, then ``finish``."""

    def feed(self, text: str) -> ParsedDelta:
        """Add generated text; return what may be sent now."""
        ...

    def finish(self) -> ParsedDelta:
        """Generation ended: release whatever is still held, as content."""
        ...

    @property
    def calls(self) -> list[ToolCall]:
        """The calls emitted so far, in order (for the non-streamed body and for capture)."""
        ...


CallDecoder = Callable[[str], tuple[str, dict[str, Any]] | None]
"""Text between the tags -> ``(name, arguments)``, or ``None`` when it is not a valid call."""

ToolParserFactory = Callable[[frozenset[str] | None], ToolCallStreamParser]
"""Makes a parser; the argument is the request's tool names, or ``None`` to accept any name."""


class TaggedToolCallParser:
    """Calls wrapped in a start and an end tag, with the body decoded by ``decode``.

    States: outside a call, ``_held`` is content not yet sent (trailing whitespace and a partial
    start tag); inside one, it is the call's body so far and ``_lead`` is the whitespace that came
    just before the start tag (dropped if the call is valid, sent back if not).
    """

    __slots__ = ("_calls", "_decode", "_end", "_held", "_inside", "_lead", "_skip_space", "_start", "_tool_names")

    def __init__(self, start: str, end: str, decode: CallDecoder, tool_names: frozenset[str] | None = None) -> None:
        self._start = start
        self._end = end
        self._decode = decode
        self._tool_names = tool_names
        self._calls: list[ToolCall] = []
        self._held = ""
        self._lead = ""
        self._inside = False
        self._skip_space = False  # right after a valid call: its trailing whitespace is dropped

    @property
    def calls(self) -> list[ToolCall]:
        """The calls emitted so far, in order."""
        return list(self._calls)

    def feed(self, text: str) -> ParsedDelta:
        """Add generated text; return the content and complete calls it releases."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        # Inside a call, only the new text (and the tail that could begin the end tag) is searched.
        scan = max(0, len(self._held) - len(self._end) + 1) if self._inside else 0
        buf, self._held = self._held + text, ""
        while True:
            if self._inside:
                cut = buf.find(self._end, scan)
                if cut < 0:
                    self._held = buf
                    break
                body, buf, scan = buf[:cut], buf[cut + len(self._end) :], 0
                self._inside = False
                call = self._call(body)
                if call is None:
                    content.append(self._lead + self._start + body + self._end)
                else:
                    index = len(self._calls)
                    self._calls.append(call)
                    # id and name first, then the arguments: the shape pi-ai and OpenClaw key calls by.
                    deltas.append(ToolCallDelta(index, call.id, call.name, ""))
                    deltas.append(ToolCallDelta(index, None, None, call.arguments))
                    self._skip_space = True
                self._lead = ""
                continue
            if self._skip_space:
                buf = buf.lstrip()
                if not buf:
                    break
                self._skip_space = False
            cut = buf.find(self._start)
            if cut >= 0:
                before = buf[:cut]
                visible = before.rstrip()
                content.append(visible)
                self._lead = before[len(visible) :]
                buf = buf[cut + len(self._start) :]
                self._inside = True
                continue
            partial = _partial_tag_suffix(buf, self._start)
            head = buf[: len(buf) - partial]
            visible = head.rstrip()
            content.append(visible)
            self._held = buf[len(visible) :]
            break
        return ParsedDelta("".join(content), tuple(deltas))

    def finish(self) -> ParsedDelta:
        """Generation ended: an unterminated call, a partial tag or held whitespace is content."""
        held = self._lead + self._start + self._held if self._inside else self._held
        self._held, self._lead, self._inside, self._skip_space = "", "", False, False
        return ParsedDelta(held)

    def _call(self, body: str) -> ToolCall | None:
        decoded = self._decode(body)
        if decoded is None:
            return None
        name, arguments = decoded
        if self._tool_names is not None and name not in self._tool_names:
            return None
        return ToolCall(f"call{secrets.token_hex(12)}", name, orjson.dumps(arguments).decode())


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _hermes_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """``{"name": ..., "arguments": {...}}``; some models write the arguments as a JSON string."""
    try:
        call = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    arguments = call.get("arguments")
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        return name, {}
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return None
    return (name, arguments) if isinstance(arguments, dict) else None


def _hermes(tool_names: frozenset[str] | None) -> ToolCallStreamParser:
    return TaggedToolCallParser("<tool_call>", "</tool_call>", _hermes_call, tool_names)


TOOL_PARSERS: Mapping[str, ToolParserFactory] = MappingProxyType({"hermes": _hermes, "qwen": _hermes})
"""Parser factories by the name a deployment configures."""


def create_tool_parser(name: str, tool_names: frozenset[str] | None = None) -> ToolCallStreamParser:
    """A fresh parser for one choice; ``tool_names`` restricts calls to the request's tools.

    Raises :class:`ValueError` naming the available parsers when ``name`` is unknown.
    """
    try:
        factory = TOOL_PARSERS[name]
    except KeyError:
        available = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; available: {available}") from None
    return factory(tool_names)


def parse_tool_calls(
    text: str, parser_name: str = "hermes", tool_names: frozenset[str] | None = None
) -> tuple[str, list[ToolCall]]:
    """Whole text -> (content, calls): exactly what streaming the same text would produce.

    Content is ``""`` when the text holds only calls and whitespace; an OpenAI body then says
    ``"content": null``, which is for the caller to decide.
    """
    parser = create_tool_parser(parser_name, tool_names)
    content = parser.feed(text).content + parser.finish().content
    return content, parser.calls
