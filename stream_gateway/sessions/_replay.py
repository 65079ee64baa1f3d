"""Turns read back from the events stream: how a replica learns another replica's turns.

The session record (:mod:`._record`) names a session's turns; their exact ids are in their
``turn.completed``/``turn.aborted`` events. :class:`TurnReplay` reads those with a short-lived
consumer filtered on the session's turn subjects, from where the last read of that session
stopped (its :class:`ReplayCursor`), and rebuilds the turns parents first, since a turn's prompt
starts with its parent's ids (:func:`~._events.turn_from_event`).

Deliberate choices:

* An ephemeral, in-memory, unacknowledged consumer per read, deleted afterwards: a read is rare
  (a replica meets a session, or a turn newer than its copy), and a durable consumer per session
  would outlive most sessions.
* The wanted turns' events are waited for (bounded by ``timeout_s``): the record is written when
  a turn ends, and its event may still be on its way from the writer's publisher.
* NATS errors propagate as they are; :class:`~._shared.SharedSessions` turns them into its
  fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
from pipeline.events import TurnAborted, TurnCompleted, decode_event, subject_token, tenant_id

from stream_gateway.sessions._events import TurnEvent, turn_from_event
from stream_gateway.sessions._record import TurnEntry
from stream_gateway.sessions._store import Session, SessionStore

if TYPE_CHECKING:
    from nats.js import JetStreamContext

__all__ = ["ReplayCursor", "TurnReplay", "build_turns"]

log = logging.getLogger(__name__)

_FETCH_BATCH = 256  # messages per pull
_POLL_S = 0.02  # between reads while a wanted turn's event is still on its way


@dataclass(slots=True)
class ReplayCursor:
    """Where reading a session's events stands: the last events-stream sequence read for it, and
    the turn events read past that no read wanted yet.

    A turn's event usually reaches the stream before the record names the turn, so a read for
    other turns meets it first. Kept here, it is there when the record names it; dropped (as it
    once was), the cursor had moved past it and no later read saw it again: the turn stayed
    unreadable until the session left the cache (seen in a rolling restart of a cluster).
    """

    stream_seq: int = 0
    read_ahead: dict[str, TurnEvent] = field(default_factory=dict)


class TurnReplay:
    """Reads sessions' turn events from the events stream ``stream`` and adds their turns to ``store``."""

    def __init__(self, store: SessionStore, *, stream: str, subject_prefix: str, timeout_s: float) -> None:
        self._store = store
        self._stream = stream
        self._prefix = subject_prefix
        self._timeout_s = timeout_s

    async def read_turns(
        self,
        js: JetStreamContext,
        session: Session,
        cursor: ReplayCursor,
        wanted: set[str],
        entries: Mapping[str, TurnEntry],
    ) -> None:
        """Read ``session``'s turn events until every one of ``wanted`` is there (bounded), and add
        those turns; ``entries``: the record's, for what the events do not hold."""
        events = cursor.read_ahead
        deadline = time.monotonic() + self._timeout_s
        while not wanted <= events.keys():
            for event in await self.turn_events(js, session, cursor):
                if event.turn_id not in session.turns:  # not this replica's own, nor one read before
                    events.setdefault(event.turn_id, event)
            if wanted <= events.keys() or time.monotonic() >= deadline:
                break
            await anyio.sleep(_POLL_S)  # the writer's event may still be on its way to the stream
        added = build_turns(self._store, session, {t: events.pop(t) for t in wanted if t in events}, entries)
        if added < len(wanted):
            log.warning(
                "session %s: %d of %d turns could not be read back from the stream",
                session.session_id,
                len(wanted) - added,
                len(wanted),
            )

    async def turn_events(self, js: JetStreamContext, session: Session, cursor: ReplayCursor) -> list[TurnEvent]:
        """``session``'s turn events after ``cursor`` (which moves past every message read)."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from pipeline.subscriber import message_payload

        owner = subject_token(tenant_id(session.tenant))
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if cursor.stream_seq else DeliverPolicy.ALL,
            opt_start_seq=cursor.stream_seq + 1 if cursor.stream_seq else None,
            ack_policy=AckPolicy.NONE,
            filter_subject=f"{self._prefix}.events.{owner}.{subject_token(session.session_id)}.turn.*",
            inactive_threshold=10.0,
            mem_storage=True,
            num_replicas=1,
        )
        out: list[TurnEvent] = []
        with anyio.fail_after(self._timeout_s * 4):
            info = await js.add_consumer(self._stream, config=config)
            remaining = info.num_pending
            if not remaining:
                await js.delete_consumer(self._stream, info.name)
                return out
            sub = await js.pull_subscribe_bind(consumer=info.name, stream=self._stream)
            try:
                while remaining > 0:
                    for msg in await sub.fetch(min(remaining, _FETCH_BATCH), timeout=self._timeout_s):
                        remaining -= 1
                        cursor.stream_seq = max(cursor.stream_seq, msg.metadata.sequence.stream)
                        if not msg.subject.endswith((".turn.completed", ".turn.aborted")):
                            continue
                        event = decode_event(await message_payload(msg, js))
                        assert isinstance(event, TurnCompleted | TurnAborted)
                        out.append(event)
            finally:
                await sub.unsubscribe()
                await js.delete_consumer(self._stream, info.name)
        return out


def build_turns(
    store: SessionStore, session: Session, events: Mapping[str, TurnEvent], entries: Mapping[str, TurnEntry]
) -> int:
    """Add the turns of ``events`` (by turn id) to ``session``, parents first; returns how many.

    A turn that reused its parent's ids while the parent is neither in ``session`` nor among
    ``events`` cannot be rebuilt, and is left out.
    """
    added = 0
    left = dict(events)
    progress = True
    while left and progress:
        progress = False
        for turn_id, event in list(left.items()):
            parent = session.turns.get(event.parent_turn_id) if event.parent_turn_id else None
            if event.reused_prompt_tokens and parent is None:
                if event.parent_turn_id in left:
                    continue  # its parent comes first
                del left[turn_id]  # its parent cannot be read back: the turn cannot be either
                continue
            entry = entries.get(turn_id)
            turn = turn_from_event(
                event,
                session_id=session.session_id,
                parent=parent,
                key=entry.key if entry is not None else None,
                context_length=int(entry.context_length) if entry is not None else 0,
            )
            store.add_turn(session, turn)
            del left[turn_id]
            added += 1
            progress = True
    return added
