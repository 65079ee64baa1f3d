"""The sessions' front door: find, open and close sessions, locally and, when shared, through NATS.

:class:`SessionDirectory` owns the local :class:`~._store.SessionStore` and, with
:class:`SharingConfig`, the :class:`~._shared.SharedSessions` that make it a cache over NATS. The
completion core asks it for the turn a conversation continues (:meth:`SessionDirectory.find`,
:meth:`SessionDirectory.match`, :meth:`SessionDirectory.match_tokens`) and tells it about turns
and feedback; it decides what is local and what goes to the shared state.

A session whose user did not consent to capture (``captured`` False) is local to the replica
that holds it: nothing of it is read from or written to the shared state, not even its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import anyio
from pipeline.connection import NatsAuth

from stream_gateway._errors import Conflict, NotFound, SharedUnavailable
from stream_gateway.sessions._shared import SharedSessions, expected_seqs
from stream_gateway.sessions._store import SEQ_BLOCK, Session, SessionStore, Turn, scope_of, session_not_found

__all__ = ["SessionDirectory", "SharingConfig"]

log = logging.getLogger(__name__)

_RECHECK_S = 0.25  # how often a wait for the shared state checks that NATS may still answer


@dataclass(frozen=True, slots=True)
class SharingConfig:
    """Where and how sessions are shared between replicas (see :mod:`._shared`)."""

    servers: tuple[str, ...]
    auth: NatsAuth | None
    bucket: str
    events_stream: str
    subject_prefix: str
    replicas: int = 1
    timeout_s: float = 1.0
    handoff_s: float = 30.0
    record_ttl_s: float = 0.0


class SessionDirectory:
    """Finds, opens and closes sessions: the local store, and the shared state when there is one."""

    def __init__(
        self,
        *,
        max_sessions: int,
        idle_seconds: float,
        max_tokens: int | None = None,
        sharing: SharingConfig | None = None,
        on_closed: Callable[[Session, str, list[tuple[int, int]] | None], None] | None = None,
        before_open: Callable[[str], None] | None = None,
    ) -> None:
        """``on_closed(session, reason, expected_seqs)``: a session ended here (``expected_seqs``
        with shared sessions: the numbers of its durable events); ``before_open(tenant)`` may
        refuse a tenant's new session (its limits)."""
        self._on_closed = on_closed
        self.before_open = before_open
        self.store = SessionStore(
            max_sessions=max_sessions,
            idle_seconds=idle_seconds,
            max_tokens=max_tokens,
            on_close=self._closed,
            on_evict=self._evicted if sharing is not None else None,
        )
        self.shared = (
            SharedSessions(self.store, **_options(sharing), idle_seconds=idle_seconds, on_remote_close=self.close)
            if sharing is not None
            else None
        )

    def _closed(self, session: Session, reason: str) -> None:
        if self._on_closed is not None:
            self._on_closed(session, reason, expected_seqs(session) if self.shared is not None else None)

    def _evicted(self, session: Session, reason: str) -> None:
        assert self.shared is not None
        if session.captured:
            self.shared.evicted(session, reason)

    def _shared_for(self, session: Session) -> SharedSessions | None:
        """The shared state, for a session that may go there (a captured one)."""
        return self.shared if session.captured else None

    def open_sessions(self, tenant: str) -> int:
        """How many sessions of ``tenant`` this replica holds open."""
        return sum(1 for s in self.store if s.tenant == tenant and not s.closed)

    # -- by id --------------------------------------------------------------------------------

    async def get(self, session_id: str, tenant: str) -> Session:
        """The tenant's session, as current as the shared state allows (404 if there is none)."""
        session = await self.lookup(session_id, tenant)
        if session is None:
            raise session_not_found(session_id)
        return session

    async def lookup(self, session_id: str, tenant: str, captured: bool | None = None) -> Session | None:
        """The tenant's session ``session_id`` (refreshed, or loaded into the cache), ``None`` if none.

        ``captured``: what the request asking for it will be; a session of the other kind is a
        409 (a capture-off request never joins a captured session, nor the reverse), and a
        capture-off one never asks the shared state (``None``: either kind, e.g. to read it).
        """
        session = self.store.lookup(session_id, tenant)
        if session is not None and captured is not None and session.captured != captured:
            raise _capture_conflict(session)
        shared = self.shared if captured is not False and (session is None or session.captured) else None
        if shared is None:
            return session
        try:
            if session is not None:
                await shared.patiently(lambda: shared.refresh(session))
                return session
            loaded = await shared.patiently(lambda: shared.load(session_id, tenant))
        except SharedUnavailable:
            return session
        return self.store.insert(loaded) if loaded is not None else None

    async def open(self, session_id: str | None, tenant: str, captured: bool = True) -> Session:
        """A new session (named, or with a generated id) for a request that will run; a capture-off
        one (``captured`` False) is this replica's alone."""
        if self.before_open is not None:
            self.before_open(tenant)
        store = self.store
        session = (
            store.create(tenant, captured) if session_id is None else store.get_or_create(session_id, tenant, captured)
        )
        if session.captured != captured:
            raise _capture_conflict(session)
        shared = self.shared
        if shared is None or not captured or session.turns or session.shared is not None:
            return session

        session.seq_end = SEQ_BLOCK  # the creator numbers from the first block
        if session_id is None:
            return session  # a generated id: its record is written with its first turn
        try:
            created = await shared.create_named(session)
        except SharedUnavailable:
            return session  # written when NATS is back
        if created is not session:  # another replica created it first
            self.store.discard(session)
            return self.store.insert(created)
        return session

    # -- by conversation ----------------------------------------------------------------------

    async def match(self, session: Session, keys: list[bytes], positions: list[int]) -> tuple[Turn | None, str | None]:
        """The deepest turn of ``session`` the conversation continues; and why a deeper one was not usable."""
        turn, at = session.match(keys, positions)
        shared = self._shared_for(session)
        if shared is None or not positions or at == positions[-1]:
            return turn, None

        async def deeper() -> Turn | None:
            await shared.refresh(session)
            turn, at = session.match(keys, positions)
            if at != positions[-1] and (unread := shared.unread(session)):
                # The record names turns not readable yet: the one continued may be among them.
                raise SharedUnavailable(f"turns {sorted(unread)} could not be read back from the stream yet")
            return turn

        try:
            return await shared.patiently(deeper), None
        except SharedUnavailable as exc:
            return session.match(keys, positions)[0], str(exc)

    async def find(
        self, tenant: str, keys: list[bytes], positions: list[int], captured: bool = True
    ) -> tuple[tuple[Session, Turn] | None, str | None]:
        """The tenant's session and turn the conversation continues (deepest first); and a fallback
        reason. A capture-off request (``captured`` False) continues only capture-off sessions."""
        local = self.store.find_at(scope_of(tenant, captured), keys, positions)
        shared = self.shared if captured else None
        at = local[2] if local is not None else -1
        deeper = [i for i in positions if i > at]
        found = (local[0], local[1]) if local is not None else None
        if shared is None or not deeper:
            return found, None

        async def indexed() -> tuple[Session, Turn] | None:
            hit = await shared.probe(tenant, [keys[i] for i in deeper])
            if hit is None:
                return None
            _, session_id, turn_id = hit
            session = self.store.cached(session_id, tenant)
            if session is not None and turn_id not in session.turns:
                await shared.refresh(session)
            elif session is None:
                loaded = await shared.load(session_id, tenant)
                session = self.store.insert(loaded) if loaded is not None else None
            if session is None or session.closed or session.tenant != tenant or not session.captured:
                return None
            if turn_id not in session.turns:  # indexed, but its event is not readable yet
                raise SharedUnavailable(
                    f"turn {turn_id} of session {session_id} could not be read back from the stream"
                )
            turn, _ = session.match(keys, positions)
            return (session, turn) if turn is not None else None

        try:
            hit = await shared.patiently(indexed)
        except SharedUnavailable as exc:
            return found, str(exc)
        except NotFound:
            return found, None
        return (hit, None) if hit is not None else (found, None)

    async def match_tokens(self, session: Session, ids: list[int]) -> Turn | None:
        """The deepest finished turn of ``session`` that ``ids`` extend, refreshing it on a miss."""
        turn = session.match_tokens(ids)
        shared = self._shared_for(session)
        if turn is None and shared is not None and session.shared is not None:
            try:
                await shared.patiently(lambda: shared.refresh(session))
            except SharedUnavailable:
                return None
            turn = session.match_tokens(ids)
        return turn

    # -- writing ------------------------------------------------------------------------------

    async def prepare_to_write(self, session: Session) -> None:
        """Make sure this replica holds event numbers for ``session``."""
        if (shared := self._shared_for(session)) is not None:
            await shared.ensure_seqs(session)

    def record_turn(self, session: Session, turn: Turn) -> anyio.Event | None:
        """Add a finished (or aborted) ``turn`` to ``session``, findable here at once, and share it:
        the one call a turn's end makes. Returns an event set once the shared state stores it
        (``None`` without shared sessions)."""
        self.store.add_turn(session, turn)
        if (shared := self._shared_for(session)) is None:
            return None
        return shared.turn_recorded(session, turn)

    async def wait_shared(self, done: anyio.Event | None) -> None:
        """Wait until a turn is stored in the shared state, so that any replica finds it next:
        while NATS may answer soon (connected, or reconnecting to another server), within
        ``--session-handoff-seconds`` on a cluster (two ``--session-sync-timeout-seconds`` on one
        server); not at all while NATS is away."""
        shared = self.shared
        if done is None or shared is None:
            return
        # asyncio's timeouts, not anyio's cancel scopes: two of those a turn cost a capturing
        # request ~2% of its CPU (the gateway runs on asyncio; benchmarks/request_steps.py --capture).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + shared.wait_limit
        while not done.is_set() and shared.worth_waiting and (left := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(_RECHECK_S, left)):
                    await done.wait()
        if not done.is_set():
            log.warning("a turn's end did not wait longer for the shared session state (NATS away or too slow)")

    def feedback_recorded(self, session: Session, record: dict[str, Any]) -> None:
        session.feedback.append(record)
        if (shared := self._shared_for(session)) is not None:
            shared.feedback_recorded(session, record)

    def forgotten(self, key: str) -> int:
        """A tombstone ``key`` was learned (:mod:`pipeline.tombstones`): the sessions it names end
        here at once, with no event, leave the cache, and nothing more of them is written. Returns
        how many there were."""
        from pipeline.tombstones import forgets, tokens

        dropped = 0
        for session in self.store:
            if not session.captured:
                continue
            tenant_token, session_token = tokens(session.tenant, session.session_id)
            assert session_token is not None
            if not forgets({key}, tenant_token, session_token):
                continue
            self.store.mark_closed(session)
            self.store.discard(session)
            if self.shared is not None:
                self.shared.drop(session)
            dropped += 1
        if dropped:
            log.info("%d sessions erased elsewhere (stream-gateway forget): ended and dropped here", dropped)
        return dropped

    async def close(self, session: Session, reason: str) -> bool:
        """Close ``session`` everywhere; ``False`` if it already was."""
        if session.closed:
            return False
        if (shared := self._shared_for(session)) is not None:
            await shared.ensure_seqs(session)
            await shared.close(session, reason)  # learns every turn's event numbers first
        return self.store.close(session, reason)


def _capture_conflict(session: Session) -> Conflict:
    if session.captured:
        message = f"Session `{session.session_id}` is captured; a request with capture off cannot join it."
    else:
        message = f"Session `{session.session_id}` is not captured (capture off); a captured request cannot join it."
    return Conflict(message, param="session_id", code="session_capture_mismatch")


def _options(sharing: SharingConfig) -> dict[str, Any]:
    # Not dataclasses.asdict: it would turn the NatsAuth inside into a dict too.
    return {f.name: getattr(sharing, f.name) for f in fields(sharing)}
