"""Implicit signals: what a chat request says about the turns of its session before it.

A user who regenerates an answer, edits the message that led to it, or feeds back a failed tool
call gives a signal without a button; the request that does so is the only moment it can be seen.
:func:`request_signals` reads it off the request, its conversation keys and the session's turns;
the turn that request makes records it (:class:`~stream_gateway.sessions.TurnSignal`, in its event's
``signals``), naming the earlier turn, and readers fold it onto that turn
(:func:`stream_gateway.sessions.session_signals`, :mod:`consumers.signals`). docs/rewards.md lists
them with the scorer that turns them into a reward.

Deliberate choices:

* **Keys, not text.** A regenerate repeats the request's messages exactly as the conversation keys
  see them (``_fingerprint.py``: blind to re-serialisation), so an earlier turn whose request had
  the same last key was ``retried``; one whose messages before a last user message had the same key
  but whose last message differed was ``edited``. Only a message after an answer counts: a
  conversation's first user message (after the same system prompt) is how a new conversation, a
  sub-agent or a compacted history starts too, so changing it is never called an edit.
* **Once per turn.** A turn already named ``retried`` (or ``edited``) by a later turn is not named
  again: three regenerates mark the first two answers, each once. The ``n`` choices of one request
  are each other's siblings, never retries.
* **Tool errors** are the tool results that follow the continued turn's assistant message, when that
  turn called tools: an Anthropic ``tool_result`` with ``is_error`` (kept on the tool message by the
  Messages edge), or a text matching ``--tool-error-pattern`` (by default one that begins with
  ``Error``, after white space).
* The keys live in memory only (like a turn's ``head``): a replica that loaded a session from the
  events stream sees the signals recorded so far but does not detect a retry of a turn it never held.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from stream_gateway.completion._request import Message
from stream_gateway.sessions import Session, Turn, TurnSignal

__all__ = ["edit_key", "request_signals"]

_DETAIL_CHARS = 120


def edit_key(messages: Sequence[Message], keys: Sequence[bytes]) -> bytes | None:
    """The key of the messages before a last user message (what an edit keeps); ``None``: the last
    message is not a user's, or no answer comes before it (a conversation's first message)."""
    if messages[-1].role != "user" or not any(m.role == "assistant" for m in messages[:-1]):
        return None
    return keys[-2]


def request_signals(
    session: Session | None,
    parent: Turn | None,
    messages: Sequence[Message],
    keys: Sequence[bytes],
    tool_error: re.Pattern[str],
) -> tuple[TurnSignal, ...]:
    """What this request says about the earlier turns of ``session``: turns it retries or edits,
    and failed tool calls of ``parent`` (the turn it continues)."""
    if session is None or not session.turns:
        return ()
    said = {(s.turn_id, s.signal) for turn in session.turns.values() for s in turn.signals}
    request, edit = keys[-1], edit_key(messages, keys)
    found: list[TurnSignal] = []
    for turn in session.turns.values():
        if turn.request_key is None:
            continue
        if turn.request_key == request:
            if (turn.turn_id, "retried") not in said:
                found.append(TurnSignal(turn.turn_id, "retried"))
        elif edit is not None and turn.edit_key == edit and (turn.turn_id, "edited") not in said:
            found.append(TurnSignal(turn.turn_id, "edited"))
    if parent is not None and parent.tool_calls and (parent.turn_id, "tool_error") not in said:
        found.extend(_tool_errors(parent, messages, tool_error))
    return tuple(found)


def _tool_errors(parent: Turn, messages: Sequence[Message], pattern: re.Pattern[str]) -> list[TurnSignal]:
    """The tool results right after ``parent``'s assistant message that report a failure."""
    found = []
    for message in messages[parent.context_length + 1 :]:
        if message.role != "tool":
            break
        text = message.text()
        extra = message.model_extra or {}
        if extra.get("is_error") is True or pattern.match(text):
            detail = f"{message.tool_call_id or ''}: {text.strip()[:_DETAIL_CHARS]}"
            found.append(TurnSignal(parent.turn_id, "tool_error", detail))
    return found
