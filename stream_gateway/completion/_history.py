"""Reading a continuing request in proportion to what it adds, not to the history it repeats.

An agent's next request is its last one with a message or two appended: the same JSON bytes up to
the end of the last message, then ``,`` and the new messages. :class:`Histories` keeps, per
conversation, the last body (``_kept.py`` ``KeptBody``): its bytes, where each of its messages
ends, the validated messages, and what requests derived from them. A body whose bytes start with a
kept one's through one of its last four messages (a client may move a cache mark to its new last
message, or edit it), then ``,``, parses only what follows: the kept messages are cut out of the
``messages`` array (``{..."messages":[`` + the new messages + the rest of the body), that is parsed
and validated, and the kept messages are put back in front. Byte-equal JSON means equal messages,
so nothing is re-read; anything else (another key order, a re-serialised history, an edit further
back) is a miss and the body is read whole, as without this. Chat and Anthropic Messages bodies go
through it by their ``messages``, Responses bodies by their ``input`` (``Edge.history_field``).
The request gets a ``KeptHistory`` (``_kept.py``): the one owner of everything it derives from
its messages after the parse, each fact read only for what it adds.

Guards, each falling back to the whole read: the body's ``messages`` key must be unique (a later
duplicate would be what a JSON parser keeps); the legacy ``functions`` shape, whose translation
looks across messages, is never spliced; a spliced body that fails validation is read whole, so an
error names the message's position in the whole array. The bytes are compared with ``memcmp``
(``bytes.startswith``); only the new messages' bytes are scanned for the array's end (strings
skipped by one regular expression each).

Token-in bodies (``/v1/completions`` with ``prompt`` a list of ids, ``Edge.history_field`` "prompt")
go through it the same way with one boundary, the array's end: a rollout's next prompt is its last
one, the ids it sampled and the new message's ids, so the kept ids are put back in front of the new
ones and only those are parsed and validated; the kept history also names the turn the kept prompt
made, which the new prompt continues if it repeats that turn's sampled ids
(``completion/_prepare.py``), with no pass over the ids it carries.

Entries are found by the request model and the body's first 256 bytes, then by the bytes before
each candidate boundary; they are bounded by ``--history-cache-bytes`` (least recently used first
out), and a continued entry is replaced by its continuation, so a conversation holds one. The store
counts every read through them (:meth:`Histories.statistics`): the parse here (fact ``parsed``),
and each fact a request derives through its ``KeptHistory``.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import orjson
from pydantic import BaseModel, ValidationError

from stream_gateway._errors import GatewayError
from stream_gateway.completion._kept import KeptBody, KeptHistory
from stream_gateway.completion._replay import RenderRecord

__all__ = ["Histories", "HistoryStatistics"]

BodyT = TypeVar("BodyT", bound=BaseModel)

# Bodies below this size are read whole and not kept: reading them costs less than keeping them.
MIN_KEPT_BYTES = 4 * 1024
_HEAD = 256  # bytes of the body that pick the bucket of candidate histories
_TAIL = 64  # the bytes before a candidate boundary, compared before the whole prefix
_BACK = 4  # message boundaries tried per candidate, from its last message back

_TOKENS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"|[\[\]{},:]')
_MESSAGES_KEY = b'"messages"'
_WHITESPACE = b" \t\r\n"


@dataclass(frozen=True, slots=True)
class HistoryStatistics:
    """The kept histories now, and what requests read through them (:meth:`Histories.statistics`).

    ``reads[(fact, read)]``: requests that derived ``fact`` (``parsed``, ``translated``, ``keyed``,
    ...: ``_kept.py``) taking the kept body's part (``read`` ``delta``) or none of it (``whole``);
    ``items[fact]``: the items (messages, token ids) they derived it for anew."""

    entries: int
    held_bytes: int
    reads: Mapping[tuple[str, str], int]
    items: Mapping[str, int]

    @property
    def hits(self) -> int:
        """Bodies that continued a kept one: only what they add parsed."""
        return self.reads.get(("parsed", "delta"), 0)

    @property
    def misses(self) -> int:
        """Bodies over 4 KiB that continued none (read whole)."""
        return self.reads.get(("parsed", "whole"), 0)


class Histories:
    """Kept request histories, bounded by bytes (``--history-cache-bytes``; 0: none kept)."""

    def __init__(self, budget: int, read: Callable[[bytes, type[Any]], Any]) -> None:
        self.budget = budget
        self._read = read  # a whole body read (http/_body.py decode_body: its error wording)
        self._entries: OrderedDict[int, KeptBody] = OrderedDict()  # by id, least recently used first
        self._buckets: dict[bytes, list[KeptBody]] = {}
        self._held = 0
        self._lock = threading.Lock()
        self._reads: Counter[tuple[str, str]] = Counter()
        self._items: Counter[str] = Counter()

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def statistics(self) -> HistoryStatistics:
        """A snapshot of the kept histories and the reads through them."""
        with self._lock:
            return HistoryStatistics(len(self._entries), self._held, dict(self._reads), dict(self._items))

    def count(self, fact: str, delta: bool, items: int) -> None:
        """A request derived ``fact`` for ``items`` items anew, taking the kept body's part (``delta``) or not."""
        with self._lock:
            self._reads[(fact, "delta" if delta else "whole")] += 1
            self._items[fact] += items

    def parse(self, raw: bytes, model: type[BodyT], field: str = "messages") -> BodyT:
        """``raw`` as a ``model`` request whose top-level ``field`` array holds the conversation,
        reading only what a kept history does not hold. Raises what reading it whole raises."""
        if not self.budget or len(raw) < MIN_KEPT_BYTES:
            return cast(BodyT, self._read(raw, model))
        bucket = hashlib.blake2b(model.__name__.encode() + raw[:_HEAD], digest_size=16).digest()
        found = self._match(raw, bucket)
        body = self._continue(raw, model, field, *found) if found is not None else None
        if body is not None:
            return body
        whole: Any = self._read(raw, model)
        items = getattr(whole, field)
        ids = _token_ids(items)
        span = _messages_span(raw, 0, 0, _key(field), ids)
        if span is None or not isinstance(items, list) or len(span[1]) != (1 if ids else len(items)):
            self.count("parsed", False, 0)
            return cast(BodyT, whole)
        if getattr(whole, "legacy_functions", False) or (not ids and isinstance(items[0], (list, int, str))):
            self.count("parsed", False, 0)
            return cast(BodyT, whole)  # (a batch of prompts: not a conversation)
        messages = list(items)
        self.count("parsed", False, len(messages))
        current = KeptBody(raw, span[1], span[0], messages, bucket, ids)
        KeptHistory(self, None, 0, self._keep(current, None)).attach(whole)
        return cast(BodyT, whole)

    def _match(self, raw: bytes, bucket: bytes) -> tuple[KeptBody, int] | None:
        """The kept history ``raw`` continues and how many of its messages it repeats byte for
        byte (the last few may differ: clients move cache marks and edit the latest message)."""
        with self._lock:
            for entry in reversed(self._buckets.get(bucket, ())):  # the latest first
                ends = entry.ends
                for count in range(len(ends), max(0, len(ends) - _BACK), -1):
                    end = ends[count - 1]
                    if len(raw) <= end or raw[end] != 0x2C:  # ","
                        continue
                    if raw[end - _TAIL : end] != entry.body[end - _TAIL : end]:
                        continue
                    if raw.startswith(memoryview(entry.body)[:end]):
                        self._entries.move_to_end(id(entry))
                        return entry, count
        return None

    def _continue(self, raw: bytes, model: type[BodyT], field: str, previous: KeptBody, count: int) -> BodyT | None:
        """The request, its kept messages not parsed again (None: this body cannot be spliced)."""
        cut = previous.ends[count - 1]
        span = _messages_span(raw, cut + 1, 2, _key(field), previous.ids)
        if span is None:
            return None
        spliced = raw[: previous.opened] + raw[cut + 1 :]
        try:
            data = orjson.loads(spliced)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict) or (not previous.ids and not _plain_messages(data, field, len(span[1]))):
            return None
        try:
            added: Any = model.model_validate(data)
        except (ValidationError, GatewayError, ValueError):
            return None  # read whole, for the error to name the message's place in the whole array
        if getattr(added, "legacy_functions", False):
            return None
        items = getattr(added, field)
        if not isinstance(items, list) or (previous.ids and not _token_ids(items)):
            return None
        if previous.ids:  # every kept id, then the new ones; the array's end is the one boundary
            messages, ends, count = previous.messages + items, span[1], len(previous.messages)
        else:
            messages, ends = [*previous.messages[:count], *items], [*previous.ends[:count], *span[1]]
        self.count("parsed", True, len(items))
        body: Any = added.model_copy(update={field: messages})
        current = KeptBody(raw, ends, previous.opened, messages, previous.bucket, previous.ids)
        KeptHistory(self, previous, count, self._keep(current, previous)).attach(body)
        return cast(BodyT, body)

    def _keep(self, entry: KeptBody, replaces: KeptBody | None) -> KeptBody:
        with self._lock:
            if replaces is not None and self._entries.pop(id(replaces), None) is not None:
                self._forget(replaces)
            self._entries[id(entry)] = entry
            self._buckets.setdefault(entry.bucket, []).append(entry)
            self._held += entry.size
            self._evict()
        return entry

    def hold_render(self, entry: KeptBody, record: RenderRecord) -> None:
        """``entry``'s recorded render (``_kept.py``): its bytes counted, what no longer fits evicted."""
        with self._lock:
            before = entry.size
            entry.record = record
            if id(entry) in self._entries:
                self._held += entry.size - before
                self._evict()

    def _evict(self) -> None:
        while self._held > self.budget and self._entries:
            _, oldest = self._entries.popitem(last=False)
            self._forget(oldest)

    def _forget(self, entry: KeptBody) -> None:
        self._held -= entry.size
        bucket = self._buckets.get(entry.bucket)
        if bucket is not None:
            bucket[:] = [e for e in bucket if e is not entry]
            if not bucket:
                del self._buckets[entry.bucket]


def _key(field: str) -> bytes:
    return b'"' + field.encode() + b'"'


def _messages_span(
    raw: bytes, position: int, depth: int, name: bytes = _MESSAGES_KEY, ids: bool = False
) -> tuple[int, list[int]] | None:
    """Scan ``raw`` from ``position`` at JSON ``depth`` (0: the body's start; 2: just after a
    message's comma in the top-level ``messages`` array) for that array: ``(opened, ends)``, where
    ``raw[opened:]`` starts inside it and ``raw[:ends[i]]`` ends with the i-th item scanned (None:
    no array, an empty one, or a second ``messages`` key after it).

    ``ids``: the array holds token ids (the caller checks the parsed array holds only ints, so
    that its first ``]`` is its end), and ``ends`` is its end alone: no scan of the ids."""
    if ids and depth == 2:
        return _ids_end(raw, position, position, name)
    opened = position if depth == 2 else -1
    ends: list[int] = []
    key = expect = False  # the last token was the "messages" key / its colon
    for match in _TOKENS.finditer(raw, position):
        first = raw[match.start()]
        if first == 0x22:  # a string
            key = depth == 1 and opened < 0 and match.group() == name
            expect = False
            continue
        if first == 0x3A:  # ":"
            expect, key = key, False
            continue
        if first == 0x5B or first == 0x7B:  # "[", "{"
            depth += 1
            if expect and first == 0x5B and depth == 2:
                opened = match.end()
                if ids:
                    return _ids_end(raw, opened, opened, name)
            expect = key = False
            continue
        expect = key = False
        if first == 0x2C:  # ","
            if opened >= 0 and depth == 2:
                ends.append(_before_space(raw, match.start()))
            continue
        depth -= 1  # "]", "}"
        if opened >= 0 and depth == 1 and first == 0x5D:
            end = _before_space(raw, match.start())
            if end > opened:
                ends.append(end)
            if raw.find(name, match.end()) >= 0:
                return None  # a second "messages" (or the word as a later value): read whole
            return (opened, ends) if ends else None
        if depth < 0:
            return None
    return None


def _ids_end(raw: bytes, opened: int, position: int, name: bytes) -> tuple[int, list[int]] | None:
    """An array of token ids opened at ``opened``: its end (the first ``]`` from ``position``)."""
    close = raw.find(b"]", position)
    if close < 0 or raw.find(name, close) >= 0:
        return None
    end = _before_space(raw, close)
    return (opened, [end]) if end > opened else None


def _token_ids(items: Any) -> bool:
    """Whether a validated (or parsed) field is one prompt of token ids: a non-empty list of ints
    (a validated prompt's union puts ints only in a list of ints; a parsed one is checked through)."""
    return isinstance(items, list) and bool(items) and type(items[0]) is int and type(items[-1]) is int


def _before_space(raw: bytes, position: int) -> int:
    while raw[position - 1] in _WHITESPACE:
        position -= 1
    return position


def _plain_messages(data: dict[str, Any], field: str, added: int) -> bool:
    """Whether the spliced body holds ``added`` new messages in today's shape (no legacy functions)."""
    messages = data.get(field)
    if not isinstance(messages, list) or len(messages) != added:
        return False
    if "functions" in data or "function_call" in data:
        return False
    return not any(isinstance(m, dict) and ("function_call" in m or m.get("role") == "function") for m in messages)
