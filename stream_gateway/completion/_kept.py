"""One request's kept history: the one owner of what reading a continuing request derives.

:class:`~._history.Histories` finds the kept body a new body repeats and hands the request a
:class:`KeptHistory`: the kept body (``previous``: None for a conversation it has not seen), how
many of its leading items the request repeats (``reused``), and the request's own kept body
(``current``: None when it is not kept), which the next request of the conversation continues.
Everything a request derives from its items goes through one method here, and each does the
same three things: take the kept body's result for the repeated items, derive the rest anew, keep
the whole for the next request. Callers say what to derive, never where it is kept:

* :meth:`KeptHistory.each`: one result per item (the messages as the template takes them, as a
  response store keeps them);
* :meth:`KeptHistory.running`: a fold over the items, every prefix's value (conversation keys,
  text characters); kept under what it depends on besides the items (the tools' fingerprint);
* :meth:`KeptHistory.known` / :meth:`KeptHistory.keep_known`: how many leading items hold a fact
  (token ids checked against the vocabulary, messages without an image);
* :meth:`KeptHistory.translated`: a translating edge's chat request (Anthropic Messages,
  Responses): the edge declares where each of its messages' chat messages start, and the chat
  messages of the repeated ones are the kept body's, the very objects;
* :meth:`KeptHistory.recorded_render`: the chat template's render, replayed from the kept body's
  record (``_replay.py``), and the render anchor's hash state (``_context.py``);
* :meth:`KeptHistory.kept_turn` / :meth:`KeptHistory.keep_turn`: the turn a token-in prompt made.

Every derivation is counted by the store (``Histories.statistics``, exported as
``gateway_history_reads_total{fact,read}`` and ``gateway_history_read_items_total{fact}``):
``delta`` where it took anything from the kept body, ``whole`` where it derived everything, and
how many items it derived anew. A continuing request that derives a fact whole shows there:
nothing falls back to a full read unseen.

Deliberate choices. The derived facts are private to this module (the way Starlette's ``Request``
caches what it derives): a request reads its kept body through these methods alone, so no caller
can fill one field and miss another. A request no store has read (a small body, a batch, a body
built in code) gets a detached history (:meth:`KeptHistory.of`) whose methods derive everything
and keep and count nothing, so callers never branch on whether a history exists. Kept lists are
shared between requests, never written after they are kept: each method builds a new list.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from stream_gateway._errors import InvalidRequest
from stream_gateway.completion._replay import RenderRecord
from stream_gateway.completion._request import ChatCompletionRequest, Message
from stream_gateway.sessions import RenderAnchor

__all__ = ["KeptBody", "KeptHistory", "KeptStore", "RenderReuse"]

ItemT = TypeVar("ItemT")
ValueT = TypeVar("ValueT")

_ID_BYTES = 36  # a kept token id: a Python int (28 bytes) and the list's pointer to it

# What checking the parent's render anchor may reuse of the kept body's render (``_context.py``
# ``_anchored``): its anchor, the hash state at the anchor's chars, its text, and how far this
# render is known to equal that text.
RenderReuse = tuple[RenderAnchor, Any, str, int]


@dataclass(slots=True, eq=False)
class KeptBody:
    """One body as the store read it (its bytes, where each item ends, the validated items), the
    render recorded for it, and what requests derived from it (:class:`KeptHistory` alone writes
    ``derived``)."""

    body: bytes
    ends: list[int]  # body[:ends[i]]: through item i's closing brace (token ids: the array's end alone)
    opened: int  # body[opened:] starts just inside the items' array
    messages: list[Any]  # the validated items (the edge's own model: chat's, Anthropic's; token ids)
    bucket: bytes
    ids: bool = False  # a token-in prompt: ``messages`` are its ids
    record: RenderRecord | None = None  # the recorded render (``_replay.py``), counted in ``size``
    derived: dict[str, Any] = field(default_factory=dict)  # by fact, in the shape its method keeps

    @property
    def size(self) -> int:
        """Bytes this body holds, about: its bytes, its strings once parsed (a token id's int and
        its pointer), and the render."""
        record = self.record
        parsed = _ID_BYTES * len(self.messages) if self.ids else len(self.body)
        return len(self.body) + parsed + (len(record.text) if record is not None else 0)


class KeptStore(Protocol):
    """Where kept bodies live (``_history.py`` ``Histories``): what a kept history tells it."""

    def count(self, fact: str, delta: bool, items: int) -> None:
        """A request derived ``fact`` for ``items`` items anew, taking the kept body's part (``delta``) or not."""
        ...

    def hold_render(self, entry: KeptBody, record: RenderRecord) -> None:
        """``entry``'s recorded render: its bytes counted."""
        ...


@dataclass(frozen=True, slots=True)
class _Translation:
    """A translating edge's chat messages for a kept body, and what they came from."""

    context: Any  # what the translation depends on besides the messages (the system prompt, as given)
    chat: list[Message]
    starts: list[int]  # starts[i]: chat messages before message i's (-1: it may join the one before); then the end


class KeptHistory:
    """A request's place among the kept histories, and the one owner of what it derives from them.

    ``reused``: how many leading items (messages, token ids; a translated request's chat messages)
    repeat the kept body it continues. Each method derives one fact for the request's items: the
    kept body's for the repeated ones, anew for the rest, and keeps the result for the next request
    (see the module's docstring)."""

    __slots__ = ("_current", "_previous", "_reused", "_store")

    def __init__(
        self, store: KeptStore | None, previous: KeptBody | None, reused: int, current: KeptBody | None
    ) -> None:
        self._store = store
        self._previous = previous
        self._reused = reused if previous is not None else 0
        self._current = current

    @staticmethod
    def of(body: Any) -> KeptHistory:
        """``body``'s kept history (a detached one where no store read it)."""
        # The bodies' ``_history`` private attribute, read from pydantic's dict of private values:
        # ``body._history`` goes through BaseModel.__getattr__, which first asks the attribute's
        # default for ``__get__`` and so raises and catches an AttributeError with a formatted
        # message on every read (pydantic 2.14, main.py and fields.py): about 4 us, four a request.
        private = getattr(body, "__pydantic_private__", None)
        history: KeptHistory | None = private.get("_history") if private else None
        return history if history is not None else _DETACHED

    def attach(self, body: Any) -> None:
        """Make this ``body``'s kept history (the store does, for a body it read)."""
        body.__pydantic_private__["_history"] = self  # (not ``body._history = self``: see :meth:`of`)

    @property
    def reused(self) -> int:
        """Leading items repeated from the kept body this request continues (0: none)."""
        return self._reused

    @property
    def continued(self) -> bool:
        """Whether this request continues a kept body."""
        return self._previous is not None

    @property
    def kept(self) -> bool:
        """Whether this request's own reading is kept, for the next request to continue."""
        return self._current is not None

    # -- derived facts -------------------------------------------------------------------------

    def each(self, fact: str, items: Sequence[ItemT], derive: Callable[[ItemT], ValueT]) -> list[ValueT]:
        """``derive`` of every item: the kept body's results for the repeated ones (the very
        objects), anew for the rest."""
        previous = self._previous
        out: list[ValueT] = self._repeated(fact, previous.derived.get(fact) if previous is not None else None, items)
        out += [derive(item) for item in items[len(out) :]]
        self._keep(fact, out)
        return out

    def running(
        self,
        fact: str,
        items: Sequence[ItemT],
        first: ValueT,
        step: Callable[[ValueT, ItemT], ValueT],
        under: Hashable = None,
    ) -> list[ValueT]:
        """``out[i]``: ``step`` folded over ``items[:i + 1]`` from ``first``; the kept body's values
        for the repeated items when it kept them ``under`` the same (what the fold also depends on)."""
        previous = self._previous
        kept = previous.derived.get(fact) if previous is not None else None
        out: list[ValueT] = self._repeated(fact, kept[1] if kept is not None and kept[0] == under else None, items)
        value = out[-1] if out else first
        for item in items[len(out) :]:
            value = step(value, item)
            out.append(value)
        self._keep(fact, (under, out))
        return out

    def known(self, fact: str) -> int:
        """How many leading items are known to hold ``fact``: the repeated ones the kept body held
        it for (:meth:`keep_known`)."""
        previous = self._previous
        return min(self._reused, previous.derived.get(fact, 0)) if previous is not None else 0

    def keep_known(self, fact: str, count: int) -> None:
        """This request's first ``count`` items hold ``fact`` (checked anew past :meth:`known`)."""
        known = self.known(fact)
        self._count(fact, known > 0, max(count - known, 0))
        self._keep(fact, count)

    def translated(
        self, translate: Callable[[int, list[int]], ChatCompletionRequest], context: Any
    ) -> ChatCompletionRequest:
        """The chat request a translating edge's body means, linked to this kept history at the
        chat level (its chat messages are the items the core's facts are derived for).

        ``translate(start, starts)``: the chat request for the body's messages from ``start`` on
        (from 0: all, with what comes before them, the system prompt), appending to ``starts``
        where each message's chat messages begin among those it returns (-1 where a message may
        join the one before, so that no cut falls there) and, last, their end. ``context``: what
        else the translation depends on (the system prompt as given); a kept translation serves
        only a body with the same. The chat messages of the repeated messages are the kept
        body's, the very objects; a cut that falls inside a joined message, another context, or
        an added message that fails to translate (its error must name its place in the whole
        array) translates the whole body, raising what that raises."""
        current = self._current
        if current is None:
            return translate(0, [])
        previous, reused = self._previous, self._reused
        kept: _Translation | None = previous.derived.get("translated") if previous is not None else None
        if kept is not None and kept.context == context and kept.starts[reused] >= 0:
            cut = kept.starts[reused]
            starts: list[int] = []
            try:
                added = translate(reused, starts)
            except (InvalidRequest, ValueError):
                added = None
            if added is not None:
                self._count("translated", True, len(starts) - 1)
                starts = [*kept.starts[: reused + 1], *(cut + n if n >= 0 else -1 for n in starts[1:])]
                chat = added.model_copy(update={"messages": [*kept.chat[:cut], *added.messages]})
                return self._translation(chat, context, starts, previous, cut)
        starts = []
        chat = translate(0, starts)
        self._count("translated", False, len(starts) - 1)
        return self._translation(chat, context, starts, None, 0)

    def _translation(
        self, chat: ChatCompletionRequest, context: Any, starts: list[int], previous: KeptBody | None, reused: int
    ) -> ChatCompletionRequest:
        self._keep("translated", _Translation(context, chat.messages, starts))
        KeptHistory(self._store, previous, reused, self._current).attach(chat)
        return chat

    def recorded_render(
        self, render: Callable[[RenderRecord | None], RenderRecord | None]
    ) -> tuple[RenderRecord | None, RenderReuse | None]:
        """This request's chat template render, recorded: ``render(the kept body's record or
        None)`` (None: the template cannot be recorded, or this request is not kept: the caller
        renders plainly), and what checking the parent's anchor may reuse of the kept render."""
        current = self._current
        if current is None:
            return None, None
        previous = self._previous
        earlier = previous.record if previous is not None else None
        record = render(earlier)
        if record is None:
            return None, None
        if self._store is not None:
            self._store.hold_render(current, record)
        self._count("rendered", record.same_prefix > 0, record.rendered)
        anchor = previous.derived.get("anchor") if previous is not None else None
        if anchor is None or earlier is None or not record.same_prefix:
            return record, None
        return record, (*anchor, earlier.text, record.same_prefix)

    def keep_anchor(self, anchor: RenderAnchor | None, state: Any) -> None:
        """The anchor of the turn built from this request's recorded render, and its hash state at
        the anchor's chars: the next request checks its parent's anchor from there."""
        current = self._current
        if current is not None and current.record is not None and anchor is not None and state is not None:
            current.derived["anchor"] = (anchor, state)

    @property
    def kept_turn(self) -> str | None:
        """The turn the kept prompt this one repeats made (token-in, a single choice), once it finished."""
        previous = self._previous
        turn: str | None = previous.derived.get("turn") if previous is not None else None
        return turn

    def keep_turn(self, turn_id: str) -> None:
        """This request's prompt made ``turn_id`` (finished): the next prompt of the rollout continues it."""
        self._keep("turn", turn_id)

    # -- the parts every fact shares -------------------------------------------------------------

    def _repeated(self, fact: str, kept: list[Any] | None, items: Sequence[Any]) -> list[Any]:
        """The kept values of the repeated items (a new list), counted with the items left to derive."""
        if kept is not None and self._reused:
            out = kept[: self._reused]
            self._count(fact, True, len(items) - len(out))
            return out
        self._count(fact, False, len(items))
        return []

    def _keep(self, fact: str, value: Any) -> None:
        current = self._current
        if current is not None:
            current.derived[fact] = value

    def _count(self, fact: str, delta: bool, items: int) -> None:
        if self._store is not None:
            self._store.count(fact, delta, items)


_DETACHED = KeptHistory(None, None, 0, None)
