"""Sessions shared by gateway replicas through NATS: any replica continues any conversation.

A replica's :class:`SessionStore` is a cache over state that lives in JetStream. What lives where
(bucket ``--sessions-bucket``, default ``sg_sessions``, and the events stream):

* ``s.<tenant>.<session>``: the session record (JSON), under its tenant's digest (a session id is a
  name within its tenant: two tenants' ``run-1`` are two records; records of the layout before
  that, ``s.<session>`` at record version 1, are migrated when their tenant first reads them):
  its tenant (the digest events carry), when it was
  created and last active, whether it was closed (and why), ``next_seq`` (the first durable event
  number no replica has reserved), its feedback, and per turn: its parent, how many request
  messages formed its context, its conversation key, the ``seq`` of its events and whether it
  finished. Every write is a compare-and-set on the record's revision: two replicas adding turns
  to one session at once both land, as siblings of a tree.
* ``k.<tenant>.<key>``: the turn key index of automatic detection: the key of a conversation that
  ends with an assistant message -> the session and turn that produced it.
* ``c.<tenant>.<session>``: written when a session is closed; every replica watches ``c.>`` and stops
  finding the session automatically.
* The exact ids (the prompt after the reused prefix, the sampled ids, their logprobs, the tool
  calls) are the turn's ``turn.completed``/``turn.aborted`` event on the events stream, read back
  with a consumer filtered on the session's subjects (from the last stream sequence read).

Writes happen when a turn ends: the turn's entry joins the record, then its key joins the index.
A streamed response sends its last frames (usage, ``[DONE]``) once that is stored, so an agent's
next request finds the turn on any replica; bounded by ``--session-sync-timeout-seconds``, and not
at all while NATS is away.

A cluster healing (a node lost, a stream electing a new leader: seconds in which reads and writes
time out or find no leader while the connection is up, or is being re-made to another node) is
waited out, within ``--session-handoff-seconds``: a request that needs the shared state retries
its reads until they answer, and a turn's last frames wait until its entry is stored, so a
conversation handed to another replica right after a node loss continues its chain. Only NATS
away for longer than the reconnect grace (``_RECONNECT_GRACE_S``: no server to reconnect to) or a
wait past that bound gives up.

NATS away (connection lost, server paused): requests are served from the cache; a request that
needs the shared state (a session this replica does not hold, or a turn newer than its copy)
starts a new root turn with a ``fallback_reason`` (saying how long it waited) instead of
failing. Writes wait in memory and are retried until NATS is back: then the index heals. What a
replica that dies during an outage held unwritten is lost from the index (its events are still
in its disk outbox), so a later turn continuing one of its turns starts a new root.

Event numbers: each replica numbers a session's durable events from a block of ``seq`` values it
reserved in the record (the creator holds ``[0, SEQ_BLOCK)``), and ``session.closed`` lists the
numbers that exist (``expected_seqs``) so consumers know when they have them all.

Where the pieces are: the record's typed form and the pure merge of a write are
:mod:`._record`, reading turns back from the events stream is :mod:`._replay`, and this module is
the I/O around them (the connection, the reads, the write loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import orjson
from pipeline.connection import NatsAuth, connect
from pipeline.errors import NatsRefused
from pipeline.events import subject_token, tenant_id

from stream_gateway._errors import SharedUnavailable
from stream_gateway.sessions._record import RECORD_VERSION, SeqBlock, SessionRecord, TurnEntry, merge_record
from stream_gateway.sessions._replay import ReplayCursor, TurnReplay
from stream_gateway.sessions._store import Session, SessionKey, SessionStore, Turn

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue
    from pipeline.tombstones import Tombstones

__all__ = ["SharedSessions", "SharedUnavailable", "expected_seqs", "record_key"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_BACKOFF = (0.2, 5.0)  # first and largest wait between retries of a write
_BACKOFF_CONNECTED_S = 1.0  # the largest while connected (an election ends any moment)
_RECONNECT_GRACE_S = 3.0  # a lost connection is being re-made to another server this long
_RETRY_READ_S = (0.05, 1.0)  # first and largest wait between retries of a read, within the handoff bound


@dataclass(slots=True)
class SharedState:
    """A cached session's bookkeeping against its record."""

    revision: int | None = None  # the record revision last read or written here; None: not stored yet
    record: SessionRecord | None = None  # that revision's record, when it holds nothing this replica lacks
    cursor: ReplayCursor = field(default_factory=ReplayCursor)  # how far this session's events were read
    pending: dict[str, TurnEntry] = field(default_factory=dict)  # turn entries not yet stored
    pending_feedback: list[dict[str, Any]] = field(default_factory=list)
    pending_close: str | None = None
    waiters: dict[str, anyio.Event] = field(default_factory=dict)  # turn id -> set once stored (or given up)
    # One write of the record at a time, per replica. asyncio's lock (and timeout, in ``_write``):
    # taken once a turn, where anyio's yields to the loop even when free and costs several times as much.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    known_turns: dict[str, TurnEntry] = field(default_factory=dict)  # the record's turn entries

    def learn(self, session: Session, record: SessionRecord) -> None:
        """Take the record's turn entries and event numbers (not its turns' ids: see :mod:`._replay`)."""
        self.known_turns.update(record.turns)
        if record.opened_seq is not None:
            session.opened_seq = record.opened_seq
        for turn_id, entry in record.turns.items():
            session.turn_seqs.setdefault(turn_id, list(entry.seqs))

    def written(self, session: Session, record: SessionRecord, revision: int, block: SeqBlock | None) -> None:
        """``record`` is stored at ``revision``: take what it says, and the ``block`` of event numbers."""
        # Turns other replicas wrote are read (with their events) at the next refresh: until
        # then the copy is not trusted for the next write.
        complete = all(t in session.turns for t in record.turns)
        self.revision = revision if complete else -1
        self.record = record if complete else None
        self.learn(session, record)
        if block is not None:
            session.seq_blocks.append(block)

    def settle(self, turns: Mapping[str, TurnEntry], feedback: list[dict[str, Any]], close: str | None) -> None:
        """What a write stored is no longer pending; its turns' waiters are told."""
        for turn_id in turns:
            self.pending.pop(turn_id, None)
            waiter = self.waiters.pop(turn_id, None)
            if waiter is not None:
                waiter.set()
        self.pending_feedback = [f for f in self.pending_feedback if f not in feedback]
        if close is not None and self.pending_close == close:
            self.pending_close = None

    def trusted(self) -> tuple[SessionRecord | None, int | None] | None:
        """The record (and revision) a write may merge into without reading it; ``None``: read it.

        That is the copy last read or written here, unless it lacks turns another replica added;
        or no record at all for a session this replica created and never stored.
        """
        if self.record is not None and self.revision is not None and self.revision >= 0:
            return self.record, self.revision
        if self.record is None and self.revision is None:
            return None, None
        return None

    def nothing_pending(self) -> bool:
        """Whether every turn, feedback record and close queued here is stored."""
        return not self.pending and not self.pending_feedback and self.pending_close is None


class SessionsBucket:
    """The sessions bucket's layout: records (``s.``), the turn key index (``k.``), close markers (``c.``)."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get_record(self, owner: str, session_id: str) -> tuple[bytes | None, int | None]:
        """The stored record of the tenant ``owner``'s (its digest) session and its revision;
        ``(None, None)``: there is none.

        A record of the layout before tenants named sessions (``s.<session>``, record version 1)
        that the same tenant owns is migrated on first read: copied to its tenant's key, version 2,
        and read from there on; one another tenant owns is not this tenant's (``(None, None)``).
        """
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        key = record_key(owner, session_id)
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            entry = None
        if entry is not None and entry.value:
            return entry.value, entry.revision
        try:
            legacy = await self.kv.get(f"s.{subject_token(session_id)}")
        except KeyNotFoundError:
            return None, None
        if not legacy.value:
            return None, None
        record = SessionRecord.from_json(orjson.loads(legacy.value))
        if record.tenant != owner:
            return None, None
        value = orjson.dumps(replace(record, version=RECORD_VERSION).to_json())
        try:
            revision = await self.kv.create(key, value)
        except KeyWrongLastSequenceError:  # another replica migrated it first: theirs
            entry = await self.kv.get(key)
            return entry.value, entry.revision
        log.info("session %s: record migrated to its tenant's key %s", session_id, key)
        return value, revision

    async def read_record(self, owner: str, session_id: str) -> tuple[SessionRecord | None, int | None]:
        """The stored record and its revision; ``(None, None)``: there is none."""
        value, revision = await self.get_record(owner, session_id)
        return (SessionRecord.from_json(orjson.loads(value)), revision) if value is not None else (None, None)

    async def put_record(self, record: SessionRecord, revision: int | None) -> int:
        """Compare-and-set ``record`` over ``revision`` (``None``: create it); its new revision."""
        value = orjson.dumps(record.to_json())
        key = record_key(record.tenant, record.session_id)
        if revision is None:
            return await self.kv.create(key, value)
        return await self.kv.update(key, value, last=revision)

    async def find_turn(self, owner: str, key: bytes) -> tuple[str, str] | None:
        """The (session, turn) the tenant ``owner``'s conversation ``key`` closes, if indexed."""
        from nats.js.errors import KeyNotFoundError

        try:
            entry = await self.kv.get(f"k.{owner}.{key.hex()}")
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        value = orjson.loads(entry.value)
        return value["s"], value["t"]

    async def index_turn(self, owner: str, key: bytes, session_id: str, turn_id: str) -> None:
        """Index the tenant ``owner``'s conversation ``key`` as closed by ``turn_id``."""
        await self.kv.put(f"k.{owner}.{key.hex()}", orjson.dumps({"s": session_id, "t": turn_id}))

    async def index_written(
        self, session: Session, record: SessionRecord, turns: Mapping[str, TurnEntry], close: str | None, *, by: str
    ) -> None:
        """After ``record`` was written: index its new ``turns``' keys (unless the session is closed),
        and announce a ``close``."""
        for turn_id, entry in turns.items():
            if entry.key and turn_id in session.turns and not record.closed:
                await self.index_turn(tenant_id(session.tenant), entry.key, session.session_id, turn_id)
        if close is not None:
            await self.announce_close(tenant_id(session.tenant), session.session_id, close, by)

    async def announce_close(self, owner: str, session_id: str, reason: str, by: str) -> None:
        """Tell every replica (watching :meth:`watch_closes`) that the tenant ``owner``'s (its digest)
        session ``session_id`` is closed."""
        marker = {"session_id": session_id, "tenant": owner, "reason": reason, "by": by}
        await self.kv.put(f"c.{subject_token(owner)}.{subject_token(session_id)}", orjson.dumps(marker))

    async def watch_closes(self) -> KeyValue.KeyWatcher:
        """A watch of the close markers written from now on."""
        return await self.kv.watch("c.>", include_history=False, ignore_deletes=True)


def record_key(owner: str, session_id: str) -> str:
    """The bucket key of the tenant ``owner``'s (its digest) session record: a session id is a name
    within its tenant, so two tenants' ``run-1`` are two records."""
    return f"s.{subject_token(owner)}.{subject_token(session_id)}"


def expected_seqs(session: Session) -> list[tuple[int, int]]:
    """The numbers of the session's durable events known here, as sorted [first, end) ranges."""
    seqs: set[int] = set()
    if session.opened_seq is not None:
        seqs.add(session.opened_seq)
    for numbers in session.turn_seqs.values():
        seqs.update(numbers)
    seqs.update(f["seq"] for f in session.feedback if isinstance(f.get("seq"), int))
    ranges: list[tuple[int, int]] = []
    for seq in sorted(seqs):
        if ranges and ranges[-1][1] == seq:
            ranges[-1] = (ranges[-1][0], seq + 1)
        else:
            ranges.append((seq, seq + 1))
    return ranges


class SharedSessions:
    """The NATS side: one connection, the sessions bucket, the close watch and the write worker."""

    def __init__(
        self,
        store: SessionStore,
        *,
        servers: tuple[str, ...],
        auth: NatsAuth | None = None,
        bucket: str,
        events_stream: str,
        subject_prefix: str,
        replicas: int = 1,
        timeout_s: float = 1.0,
        handoff_s: float = 30.0,
        record_ttl_s: float = 0.0,
        idle_seconds: float = 3600.0,
        on_remote_close: Callable[[Session, str], Awaitable[object]] | None = None,
    ) -> None:
        self._store = store
        self._servers = servers
        self._auth = auth
        self._bucket_name = bucket
        self._replicas = replicas
        self.timeout_s = timeout_s
        self.handoff_s = handoff_s
        self._ttl = record_ttl_s
        self._idle_seconds = idle_seconds
        self._replay = TurnReplay(store, stream=events_stream, subject_prefix=subject_prefix, timeout_s=timeout_s)
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._bucket: SessionsBucket | None = None  # once provisioned
        self._disconnected_at: float | None = None  # when the connection was lost; None: connected
        self._backoff = _BACKOFF[0]  # before the next retry of a failed write
        self._me = secrets.token_hex(8)  # tells this replica's close markers from others'
        self._dirty: dict[SessionKey, Session] = {}
        self.tombstones: Tombstones | None = None  # the erased sessions' (pipeline.tombstones), set by the app
        self._idle: dict[SessionKey, Session] = {}
        self._wake = anyio.Event()
        self.ready = anyio.Event()  # set once the bucket exists (or the first attempt failed)
        self._on_remote_close = on_remote_close  # called with a cached session gone idle everywhere

    # -- lifecycle ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, provision the bucket, watch closes and write what is pending; until cancelled."""

        async def disconnected() -> None:
            if not nc.is_closed:
                self._disconnected_at = time.monotonic()
                log.warning("shared sessions: NATS connection lost; serving from the cache")

        async def reconnected() -> None:
            self._disconnected_at = None
            log.info("shared sessions: NATS connection back")
            self._wake.set()

        backoff = _BACKOFF[0]
        while True:
            try:
                nc = await connect(
                    self._servers,
                    self._auth,
                    name="stream-gateway-sessions",
                    connect_timeout=2,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    ping_interval=5,  # a paused server is noticed in ~10 s; each request is bounded anyway
                    max_outstanding_pings=2,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                    # A server that is away at start must not stop the gateway from serving.
                    allow_reconnect=True,
                )
                break
            except NatsRefused as exc:  # a misconfiguration: requests fall back meanwhile
                log.error("shared sessions: %s; serving without shared state, retrying", exc)
                self.ready.set()
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF[1])
        self._nc, self._js = nc, nc.jetstream()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._provision_and_watch)
                tg.start_soon(self._write_loop)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                await nc.close()

    async def _provision_and_watch(self) -> None:
        from nats.js.api import KeyValueConfig
        from nats.js.errors import BadRequestError
        from pipeline.streams import keep_for

        backoff = _BACKOFF[0]
        while True:
            try:
                assert self._js is not None
                with anyio.fail_after(max(self.timeout_s, 5.0)):
                    try:
                        kv = await self._js.create_key_value(
                            KeyValueConfig(
                                bucket=self._bucket_name, history=1, replicas=self._replicas, ttl=self._ttl or None
                            )
                        )
                    except BadRequestError:  # it exists with other settings (another replica's): use it,
                        kv = await self._js.key_value(self._bucket_name)  # its records kept as this one says
                        await keep_for(self._js, f"KV_{self._bucket_name}", self._ttl)
                    self._bucket = SessionsBucket(kv)
                self.ready.set()
                self._wake.set()
                async for entry in await self._bucket.watch_closes():
                    if entry is None or not entry.value:
                        continue
                    marker = orjson.loads(entry.value)
                    if marker.get("by") == self._me:
                        continue
                    session = self._closed_here(marker)
                    if session is not None and not session.closed:
                        self._store.mark_closed(session)
                        log.info("session %s was closed by another replica", session.session_id)
                backoff = _BACKOFF[0]
            except Exception as exc:  # connection trouble of every kind: retried
                log.warning("shared sessions: bucket %s unavailable (%r); retrying", self._bucket_name, exc)
                self.ready.set()  # serve meanwhile: requests fall back
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF[1])

    @property
    def available(self) -> bool:
        """Whether reads are worth trying now (connected and provisioned)."""
        nc = self._nc
        return self._bucket is not None and nc is not None and nc.is_connected

    @property
    def clustered(self) -> bool:
        """Whether NATS is a cluster (more than one server known, named or announced): only then
        can another server take over, and a wait for an election be worth it."""
        return self._nc is not None and len(self._nc.servers) > 1

    @property
    def wait_limit(self) -> float:
        """The longest wait for the shared state: ``handoff_s`` on a cluster, else two read timeouts."""
        return self.handoff_s if self.clustered else self.timeout_s * 2

    @property
    def worth_waiting(self) -> bool:
        """Whether the shared state may answer soon: provisioned, and connected or, on a cluster,
        reconnecting within the grace (the connection moving to another server)."""
        if self._bucket is None or self._nc is None or self._nc.is_closed:
            return False
        lost = self._disconnected_at
        reconnecting = self.clustered and lost is not None and time.monotonic() - lost < _RECONNECT_GRACE_S
        return self._nc.is_connected or reconnecting

    async def patiently(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()``, tried again while it raises :class:`SharedUnavailable` and the shared state
        is :attr:`worth_waiting`, within :attr:`wait_limit`; the last failure says how long it waited."""
        started = time.monotonic()
        pause = _RETRY_READ_S[0]
        while True:
            try:
                return await attempt()
            except SharedUnavailable as exc:
                waited = time.monotonic() - started
                if not self.worth_waiting or waited + pause > self.wait_limit:
                    if waited < pause:
                        raise
                    raise SharedUnavailable(f"{exc} (waited {waited:.1f} s)") from exc
            await anyio.sleep(pause)
            pause = min(pause * 2, _RETRY_READ_S[1])

    def _unavailable(self, exc: BaseException) -> SharedUnavailable:
        log.warning("shared sessions: NATS did not answer (%r)", exc)
        return SharedUnavailable(f"the shared session state (NATS) is unreachable: {exc!r}")

    def _check(self) -> SessionsBucket:
        if not self.available or self._bucket is None:
            raise SharedUnavailable("the shared session state (NATS) is unreachable")
        return self._bucket

    # -- reading ------------------------------------------------------------------------------

    async def probe(self, tenant: str, keys: list[bytes]) -> tuple[int, str, str] | None:
        """The deepest of ``keys`` (ordered shallow to deep) in the index: (position, session, turn)."""
        bucket = self._check()
        owner = tenant_id(tenant)
        found: dict[int, tuple[str, str]] = {}

        async def one(position: int, key: bytes) -> None:
            hit = await bucket.find_turn(owner, key)
            if hit is not None:
                found[position] = hit

        try:
            with anyio.fail_after(self.timeout_s):
                async with anyio.create_task_group() as tg:
                    for position, key in enumerate(keys):
                        tg.start_soon(one, position, key)
        except Exception as exc:
            raise self._unavailable(exc) from exc
        if not found:
            return None
        deepest = max(found)
        return deepest, *found[deepest]

    async def load(self, session_id: str, tenant: str) -> Session | None:
        """The tenant's session from the shared state (``None``: the tenant has none)."""
        record, revision = await self._get_record(tenant, session_id)
        if record is None:
            return None
        now = time.time()
        session = Session(session_id, tenant, float(record.created_at), now, announced=True)
        session.seq_end = 0  # no event numbers yet: reserved when this replica first writes
        session.shared = SharedState(revision=revision, record=record)
        await self._absorb(session, record)
        if record.closed:
            session.closed = True
        return session

    async def refresh(self, session: Session) -> None:
        """Bring a cached session up to its record (new turns, feedback, closed)."""
        state = self._state(session)
        record, revision = await self._get_record(session.tenant, session.session_id)
        if record is None or (revision == state.revision and not self.unread(session)):
            return
        state.revision, state.record = revision, record
        await self._absorb(session, record)
        if record.closed and not session.closed:
            self._store.mark_closed(session)

    def unread(self, session: Session) -> set[str]:
        """The turns the shared record names whose events could not be read back yet (still on
        their way from another replica's publisher, or the events stream between leaders)."""
        state = _state_of(session)
        if state is None:
            return set()
        return {turn_id for turn_id in state.known_turns if turn_id not in session.turns}

    async def create_named(self, session: Session) -> Session:
        """Store a new named session's record; if another replica created it first, that one."""
        from nats.js.errors import KeyWrongLastSequenceError

        bucket = self._check()
        record = SessionRecord.new(session)
        try:
            with anyio.fail_after(self.timeout_s):
                revision = await bucket.put_record(record, None)
        except KeyWrongLastSequenceError:
            loaded = await self.load(session.session_id, session.tenant)
            if loaded is None:  # created and deleted in between: ours is as good
                return session
            return loaded
        except Exception as exc:
            raise self._unavailable(exc) from exc
        state = self._state(session)
        state.revision, state.record = revision, record
        return session

    async def ensure_seqs(self, session: Session) -> None:
        """Reserve event numbers for ``session`` here if it has none left (best effort)."""
        if session.seq_end is None or session.seq_next < session.seq_end or session.seq_blocks:
            return
        state = self._state(session)
        if state.revision is None or not self.available:
            return  # not stored yet (its creator's block is in use) or NATS away: take_seq copes
        with contextlib.suppress(SharedUnavailable):
            await self._write(session, reserve=True)

    async def _get_record(self, tenant: str, session_id: str) -> tuple[SessionRecord | None, int | None]:
        bucket = self._check()
        try:
            with anyio.fail_after(self.timeout_s):
                value, revision = await bucket.get_record(tenant_id(tenant), session_id)
        except Exception as exc:
            raise self._unavailable(exc) from exc
        if value is None:
            return None, None
        return SessionRecord.from_json(orjson.loads(value)), revision

    async def _absorb(self, session: Session, record: SessionRecord) -> None:
        """Take the record's turns (reading their events), feedback and event numbers into ``session``."""
        state = self._state(session)
        state.learn(session, record)
        seen = {f["id"] for f in session.feedback}
        session.feedback.extend(f for f in record.feedback if f["id"] not in seen)
        missing = {t for t in record.turns if t not in session.turns}
        if not missing:
            return
        assert self._js is not None  # a record was read: the connection is up
        try:
            await self._replay.read_turns(self._js, session, state.cursor, missing, state.known_turns)
        except Exception as exc:
            raise self._unavailable(exc) from exc

    # -- writing ------------------------------------------------------------------------------

    def turn_recorded(self, session: Session, turn: Turn) -> anyio.Event:
        """Queue ``turn`` for the shared state; the event is set once it is stored (or given up)."""
        state = self._state(session)
        state.pending[turn.turn_id] = TurnEntry(
            parent_id=turn.parent_id,
            context_length=turn.context_length,
            key=turn.key,
            seqs=tuple(session.turn_seqs.get(turn.turn_id, ())),
            finished=turn.finish_reason is not None,
            created_at=round(turn.created_at, 3),
        )
        done = state.waiters[turn.turn_id] = anyio.Event()
        self._mark_dirty(session)
        return done

    def feedback_recorded(self, session: Session, record: dict[str, Any]) -> None:
        """Queue a feedback record for the shared state."""
        self._state(session).pending_feedback.append(record)
        self._mark_dirty(session)

    async def close(self, session: Session, reason: str) -> None:
        """Mark ``session`` closed in the shared state and tell every replica; learns every event number."""
        state = self._state(session)
        state.pending_close = reason
        try:
            await self._write(session)
        except SharedUnavailable:
            self._mark_dirty(session)  # stored when NATS is back

    async def _erased(self, session: Session) -> bool:
        """Whether ``session`` was forgotten (``stream-gateway forget``), as far as the tombstones
        say now (a replica stopped during the forget learns it here, before writing): then nothing
        more of it is written."""
        from pipeline.tombstones import tokens

        tombstones = self.tombstones
        assert tombstones is not None and self._js is not None
        await tombstones.current(self._js, strict=False)
        tenant_token, session_token = tokens(session.tenant, session.session_id)
        assert session_token is not None
        if tombstones.forgets(tenant_token, session_token):
            self.drop(session)
            return True
        return False

    def drop(self, session: Session) -> None:
        """Write nothing more of ``session`` (it was erased): what is pending for it is discarded."""
        self._dirty.pop(session.key, None)
        self._idle.pop(session.key, None)
        session.shared = None

    def evicted(self, session: Session, reason: str) -> None:
        """``session`` left this replica's cache; if it went idle everywhere, close it."""
        if reason == "idle" and not session.closed:
            self._idle[session.key] = session
            self._wake.set()

    async def flush(self) -> None:
        """Write everything pending now (shutdown); what cannot be written is logged."""
        for session in list(self._dirty.values()):
            with contextlib.suppress(SharedUnavailable):
                await self._write(session)
        left = sum(len(state.pending) for s in self._dirty.values() if (state := _state_of(s)) is not None)
        if left:
            log.warning("shared sessions: %d turns not written to NATS at shutdown (their events are)", left)

    def _mark_dirty(self, session: Session) -> None:
        self._dirty[session.key] = session
        self._wake.set()

    async def _write_loop(self) -> None:
        # One writer task per dirty session, started as soon as it is dirty: a turn's record is
        # written while others are, and never waits for a batch of other sessions' writes. A
        # session's writer keeps writing until nothing is pending for it (see ``_write``).
        writing: set[SessionKey] = set()

        async def write(session: Session) -> None:
            try:
                await self._write(session)
                self._backoff = _BACKOFF[0]
            except SharedUnavailable:
                await anyio.sleep(self._backoff)  # NATS away or slow: retried after a growing pause
                largest = _BACKOFF_CONNECTED_S if self.worth_waiting else _BACKOFF[1]
                self._backoff = min(self._backoff * 2, largest)
            finally:
                writing.discard(session.key)
                if session.key in self._dirty:
                    self._wake.set()

        async with anyio.create_task_group() as tg:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                if self._bucket is None:
                    continue
                for key, session in list(self._dirty.items()):
                    if key not in writing:
                        writing.add(key)
                        tg.start_soon(write, session)
                while self._idle:
                    _, session = self._idle.popitem()
                    tg.start_soon(self._close_if_idle, session)

    async def _close_if_idle(self, session: Session) -> None:
        try:
            record, _ = await self._get_record(session.tenant, session.session_id)
        except SharedUnavailable:
            return  # the assembler's idle timeout covers it
        if record is None or record.closed:
            return
        if time.time() - float(record.last_active) < self._idle_seconds:
            return  # active on another replica
        if self._on_remote_close is not None:
            await self._on_remote_close(session, "idle")

    async def _write(self, session: Session, *, reserve: bool = False) -> None:
        """Merge what is pending for ``session`` into its record (compare-and-set), then the index."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        state = self._state(session)
        bucket = self._bucket
        if bucket is None or not (self._nc is not None and self._nc.is_connected):
            raise SharedUnavailable("the shared session state (NATS) is unreachable")
        if self.tombstones is not None and await self._erased(session):
            return
        # The first attempt trusts what this replica last wrote or read (or, for a session it
        # created and never stored, that there is no record): one round trip fewer per turn while
        # one replica serves the session. A conflict means another replica wrote: read, merge, retry.
        trust = True
        async with state.lock:
            while True:
                turns, feedback, close = dict(state.pending), list(state.pending_feedback), state.pending_close
                want_block = reserve or session.seqs_low()
                try:
                    async with asyncio.timeout(self.timeout_s * 2):
                        trusted = state.trusted() if trust else None
                        if trusted is None:
                            trusted = await bucket.read_record(tenant_id(session.tenant), session.session_id)
                        stored, revision = trusted
                        new = SessionRecord.new(session)
                        record, block = merge_record(
                            stored, turns, feedback, close, session.last_active, want_block, new=new
                        )
                        revision = await bucket.put_record(record, revision)
                        await bucket.index_written(session, record, turns, close, by=self._me)
                except (KeyWrongLastSequenceError, KeyNotFoundError):
                    trust = False
                    continue  # another replica wrote in between: merge again
                except Exception as exc:
                    raise self._unavailable(exc) from exc
                state.written(session, record, revision, block)
                state.settle(turns, feedback, close)
                reserve = False
                if state.nothing_pending():
                    self._dirty.pop(session.key, None)
                    return

    def _closed_here(self, marker: Mapping[str, Any]) -> Session | None:
        """The cached session a close marker names (a marker of the layout before tenants named
        sessions has no tenant: any tenant's session of that id)."""
        owner = marker.get("tenant")
        return next(
            (
                s
                for s in self._store
                if s.session_id == marker.get("session_id") and (owner is None or tenant_id(s.tenant) == owner)
            ),
            None,
        )

    @staticmethod
    def _state(session: Session) -> SharedState:
        state = _state_of(session)
        if state is None:
            state = session.shared = SharedState()
        return state


def _state_of(session: Session) -> SharedState | None:
    """``session``'s shared bookkeeping, if it has any (the store carries it untyped)."""
    state = session.shared
    assert state is None or isinstance(state, SharedState)
    return state
