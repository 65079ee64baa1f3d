"""Sessions: trees of token-exact turns, found by id or by the conversation a request continues.

* :mod:`._store`: :class:`Turn`, :class:`Session` (a tree) and the bounded local
  :class:`SessionStore`.
* :mod:`._directory`: :class:`SessionDirectory`, the front door the completion core uses.
* :mod:`._shared`: the NATS side that lets any replica continue any session.
* :mod:`._record`: :class:`SessionRecord` and :class:`TurnEntry`, the record replicas share, and
  :func:`merge_record`, a write's pure merge.
* :mod:`._replay`: turns read back from the events stream, parents first.
* :mod:`._events`: :func:`turn_to_event` and :func:`turn_from_event`, a turn and its
  ``turn.completed``/``turn.aborted`` event converted in one place.

The contracts these keep (a turn holds exactly the sampled ids; an echoed assistant message is
continued by its ids, never re-tokenized; a diverging history opens a branch, never a splice)
are stated in ``docs/sessions.md``.
"""

from stream_gateway._errors import SharedUnavailable
from stream_gateway.sessions._directory import SessionDirectory, SharingConfig
from stream_gateway.sessions._events import TurnEvent, turn_from_event, turn_to_event
from stream_gateway.sessions._ids import Logprobs, TokenIds, wire_ids
from stream_gateway.sessions._record import SessionRecord, TurnEntry, merge_record
from stream_gateway.sessions._shared import SharedSessions, expected_seqs, record_key
from stream_gateway.sessions._store import (
    SEQ_BLOCK,
    SIGNAL_ORDER,
    Chain,
    RenderAnchor,
    Session,
    SessionStore,
    Turn,
    TurnImage,
    TurnSignal,
    prompt_after,
    scope_of,
    session_body,
    session_signals,
    turn_routes,
)

__all__ = [
    "Chain",
    "Logprobs",
    "RenderAnchor",
    "SEQ_BLOCK",
    "SIGNAL_ORDER",
    "Session",
    "SessionDirectory",
    "SessionRecord",
    "SessionStore",
    "SharedSessions",
    "SharedUnavailable",
    "SharingConfig",
    "TokenIds",
    "Turn",
    "TurnEntry",
    "TurnEvent",
    "TurnImage",
    "TurnSignal",
    "expected_seqs",
    "merge_record",
    "prompt_after",
    "record_key",
    "scope_of",
    "session_body",
    "session_signals",
    "turn_from_event",
    "turn_routes",
    "turn_to_event",
    "wire_ids",
]
