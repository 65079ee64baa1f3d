"""Publishing events without ever blocking a stream and without losing a durable one.

The request path calls :meth:`EventPublisher.publish_nowait`, which encodes the event and
appends it to a bounded in-memory buffer (or, see below, the disk outbox) and returns: it never
awaits, so a slow or dead NATS cannot slow a client's tokens. One drain task publishes:

* **Durable events** go to JetStream with ``publish_async``, up to ``window`` in flight, each
  with ``Nats-Msg-Id`` = event id. A window is removed from the buffer only once every message in
  it is acknowledged; a failed window (ack timeout, connection lost, server error) is retried
  whole after a backoff, and the stream's deduplication drops the copies that had arrived.
* **Lingering.** Woken from idle, the drain task waits ``linger_s`` (2 ms) before it publishes, so
  that the events of that moment go out as one window, and the request that produced the first of
  them writes its first token before any publishing work competes with it for the event loop.
  Events that end something (``turn.completed``, ``turn.aborted``, ``session.closed``) cut the
  wait short: another replica continuing the conversation reads the turn from the stream, and the
  client may send its next request the moment its answer ends.
* **Spilling.** When NATS has been failing for ``spill_after_s``, or the buffer is full, new
  durable events go to the disk outbox instead (:mod:`pipeline._outbox`). The buffer then holds
  only events older than anything on disk, so the drain task publishes the buffer first, then
  replays the outbox oldest segment first, and only when both are empty do new events go to the
  buffer again: the stream receives events in the order they were produced (but see
  "Ordering" below). On shutdown,
  whatever is still buffered after ``drain_timeout_s`` is written to the front of the outbox; on
  start, a non-empty outbox is replayed before anything new.
* **Large events** (over the server's max payload, e.g. a long prompt's ids) are stored in the
  JetStream object store under their event id, and a small pointer message with header
  ``Sg-Payload-Object: <bucket>/<event id>`` takes their place on the stream;
  :func:`pipeline.subscriber.message_payload` resolves it.
* **Objects** (:meth:`EventPublisher.put_object_nowait`: images, keyed by their SHA-256) travel
  in the same ordered queue and outbox as the events, so an object is stored before any event
  published after it (the turn that refers to it) and survives NATS being away just the same.
  Content-addressed: an object already in the bucket is not written again.
* **Live deltas** (``turn.delta``) are published on core NATS from a small ring of their own;
  when it is full, or NATS is not connected, they are dropped and counted: they are a live view,
  the durable ``turn.completed`` carries the same tokens. Woken, their task waits
  ``delta_linger_s`` (20 ms), so that the deltas of every stream in that time leave in one socket
  write: each write to the server costs the gateway a syscall and a wake-up of its flusher, and
  hundreds of streams each publish a delta every half second.

Guarantee: every durable event handed to ``publish_nowait`` reaches the stream exactly once
(within the stream's duplicate window), unless the process dies with events still in the memory
buffer (bounded by ``buffer_size``; a graceful shutdown writes them to disk first) or the disk
fails.

Ordering is the production order, with one rare exception: when the connection drops in the
middle of a window, nats-py re-sends the part of it still in its own write buffer as soon as it
reconnects, before the publisher retries the whole window, so the head of that window can land
after its tail. Consumers that need order sort each session's events by ``seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio

from pipeline.errors import NatsRefused

from ._outbox import Outbox, OutboxRecord
from .connection import NatsAuth, connect
from .durable import PAYLOAD_HEADROOM, put_oversized
from .events import Event, encode_event
from .streams import (
    PAYLOAD_OBJECT_HEADER,
    StreamSpec,
    delta_subject,
    ensure_bucket,
    ensure_object_store,
    ensure_stream,
    event_subject,
    live_subject,
)
from .tombstones import Tombstones

if TYPE_CHECKING:
    from types import TracebackType

    from anyio.abc import TaskGroup
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.object_store import ObjectStore

__all__ = ["EventPublisher", "PublisherConfig", "PublisherStatistics"]

log = logging.getLogger(__name__)

_ENDINGS = frozenset({"turn.completed", "turn.aborted", "session.closed"})
# The subject of an outbox record that is an object to store, not a message: "$object.<bucket>".
_OBJECT_SUBJECT = "$object."


def _aging(mtime: str | None, max_age_s: float | None) -> bool:
    """Whether an object stored at ``mtime`` (ISO 8601, as nats-py writes it in the object's meta)
    should be stored again: past half its bucket's age limit (none: never)."""
    if not max_age_s:
        return False
    try:
        stored = datetime.fromisoformat(mtime or "").timestamp()
    except ValueError:
        return True
    return time.time() - stored > max_age_s / 2


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """How the publisher buffers, retries and spills."""

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    auth: NatsAuth = field(default_factory=NatsAuth)  # credentials and TLS
    outbox_dir: Path = Path("outbox")
    stream: StreamSpec = field(default_factory=StreamSpec)
    buffer_size: int = 10_000  # durable events held in memory before new ones go to disk
    delta_buffer_size: int = 2_000  # live deltas waiting; beyond, they are dropped
    window: int = 256  # durable publishes awaiting their ack at once
    ack_timeout_s: float = 5.0  # for a whole window
    spill_after_s: float = 2.0  # NATS failing this long: new durable events go to disk
    retry_backoff_s: tuple[float, float] = (0.05, 2.0)  # first and largest wait between retries
    drain_timeout_s: float = 5.0  # on shutdown, before the rest is written to the outbox
    linger_s: float = 0.002  # after an idle spell, wait this long for more events before publishing
    delta_linger_s: float = 0.02  # woken by a live delta, wait this long for more before sending them
    provision: bool = True  # create/update the stream and the payload bucket on connect
    outbox_max_age_s: float = 0.0  # outbox segments older are deleted unsent (retention); 0: never


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    """A snapshot of the publisher's counters."""

    connected: bool
    published: int  # durable events acknowledged by JetStream (replays included)
    pending: int  # durable events not yet acknowledged: buffer + outbox
    buffered: int
    outbox: int
    spilled: int  # durable events written to the outbox
    replayed: int  # durable events published from the outbox
    large: int  # durable events sent through the object store
    failures: int  # failed publish attempts (each retried)
    deltas_published: int
    deltas_dropped: int
    objects: int = 0  # objects stored (put_object_nowait; those already in their bucket are not counted)
    expired: int = 0  # durable events deleted unsent from the outbox, older than its age limit (retention)
    withheld: int = 0  # durable events not published: their session or tenant was forgotten (erasure)


class EventPublisher:
    """Owns one NATS connection and the drain task; an async context manager.

    ``async with EventPublisher(config) as publisher:`` returns at once, whether or not NATS is
    reachable: connecting (and reconnecting) happens in the background.
    """

    def __init__(self, config: PublisherConfig, tombstones: Tombstones | None = None) -> None:
        """``tombstones``: the sessions and tenants erased (``stream-gateway forget``), whose events
        are never published, from memory or from the outbox (:mod:`pipeline.tombstones`)."""
        self._config = config
        self._tombstones = tombstones
        self._withheld = 0
        self._subject_prefix = config.stream.prefix
        self._buffer: deque[OutboxRecord] = deque()
        self._deltas: deque[tuple[str, bytes]] = deque()
        self._outbox = Outbox(config.outbox_dir)
        self._spilling = len(self._outbox) > 0  # leftovers from a previous run go first
        self._durable_waiters: dict[str, anyio.Event] = {}  # event id -> set once stored or spilled
        self._wake = anyio.Event()
        self._urgent = anyio.Event()  # an event that ends something is waiting: no lingering
        self._delta_wake = anyio.Event()
        self._drained = anyio.Event()  # set while nothing is pending
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._ready = False  # connected and provisioned
        self._failing_since: float | None = None
        self._closing = False
        self._tg: TaskGroup | None = None
        self._store: ObjectStore | None = None
        self._buckets: dict[str, ObjectStore] = {}
        self._objects = 0
        self._published = self._spilled = self._replayed = self._large = self._failures = self._expired = 0
        self._deltas_published = self._deltas_dropped = 0
        if self._spilling:
            log.info("outbox %s holds %d events from a previous run: replaying", config.outbox_dir, len(self._outbox))

    # -- the request path --------------------------------------------------------------------

    def publish_nowait(self, event: Event) -> None:
        """Queue ``event`` for publishing; never blocks, never raises for NATS trouble."""
        if not event.durable:
            self.publish_live_nowait(delta_subject(self._subject_prefix, event), encode_event(event))
            return
        record = OutboxRecord(event_subject(self._subject_prefix, event), event.event_id, encode_event(event))
        self._queue(record, urgent=event.kind in _ENDINGS)

    def live_subject(self, tenant: str, session_id: str | None) -> str:
        """The subject a session's live ``turn.delta`` events go to (for :meth:`publish_live_nowait`)."""
        return live_subject(self._subject_prefix, tenant, session_id)

    def publish_live_nowait(self, subject: str, payload: bytes) -> None:
        """Queue an encoded live event (a ``turn.delta``, never stored) for ``subject``; never blocks.
        Dropped (and counted) while the live buffer is full or NATS is not ready: best effort by design."""
        if len(self._deltas) >= self._config.delta_buffer_size or not self._ready:
            self._deltas_dropped += 1
            return
        self._deltas.append((subject, payload))
        self._delta_wake.set()

    def put_object_nowait(self, name: str, data: bytes) -> None:
        """Queue ``data`` for the object store as ``name`` (in the image bucket), before every event
        queued after it; never blocks. Content-addressed names only: an existing object is kept."""
        self._queue(OutboxRecord(_OBJECT_SUBJECT + self._config.stream.image_bucket, name, data), urgent=False)

    def _queue(self, record: OutboxRecord, *, urgent: bool) -> None:
        if self._closing:
            self._spill([record])
        elif self._spilling or len(self._buffer) >= self._config.buffer_size or self._down_too_long():
            if not self._spilling:
                log.warning("NATS is behind or away: new events go to %s", self._outbox.directory)
            self._spilling = True
            self._spill([record])
        else:
            self._buffer.append(record)
        if self._drained.is_set():
            self._drained = anyio.Event()
        if urgent:
            self._urgent.set()
        self._wake.set()

    def publish_durable(self, event: Event) -> anyio.Event:
        """:meth:`publish_nowait` a durable event; what it returns is set once the event is durable:
        acknowledged by JetStream, or written to the disk outbox (to the OS at once: it survives
        the process; fsynced when its segment is sealed). While NATS fails, that is at most
        ``spill_after_s`` later, when new events start going to disk."""
        assert event.durable, "only durable events are stored"
        waiter = self._durable_waiters[event.event_id] = anyio.Event()
        self.publish_nowait(event)
        return waiter

    def _settle(self, records: list[OutboxRecord]) -> None:
        """Release whoever waits for these records to be durable."""
        if self._durable_waiters:
            for record in records:
                waiter = self._durable_waiters.pop(record.msg_id, None)
                if waiter is not None:
                    waiter.set()

    def _down_too_long(self) -> bool:
        since = self._failing_since
        return not self._ready and since is not None and time.monotonic() - since >= self._config.spill_after_s

    def statistics(self) -> PublisherStatistics:
        """The counters now."""
        return PublisherStatistics(
            connected=self._ready,
            published=self._published,
            pending=len(self._buffer) + len(self._outbox),
            buffered=len(self._buffer),
            outbox=len(self._outbox),
            spilled=self._spilled,
            replayed=self._replayed,
            large=self._large,
            failures=self._failures,
            deltas_published=self._deltas_published,
            deltas_dropped=self._deltas_dropped,
            objects=self._objects,
            expired=self._expired,
            withheld=self._withheld,
        )

    async def wait_published(self) -> None:
        """Wait until nothing is pending: every durable event so far acknowledged by JetStream."""
        while self._buffer or len(self._outbox):
            await self._drained.wait()

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._failing_since = time.monotonic()  # until the first connection: see _down_too_long
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._connect_and_drain)
        self._tg.start_soon(self._drain_deltas)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        with anyio.CancelScope(shield=True):
            with anyio.move_on_after(self._config.drain_timeout_s):
                await self.wait_published()
                await self._send_deltas()  # those still lingering: a clean stop sends them too
        self._closing = True
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(exc_type, exc, tb)
        finally:
            left = list(self._buffer)
            self._buffer.clear()
            if left:
                self._outbox.prepend(left)  # older than anything already on disk
                self._spilled += len(left)
                log.warning("shutdown: %d events not yet published saved to %s", len(left), self._outbox.directory)
            self._outbox.close()
            if self._nc is not None and not self._nc.is_closed:
                with anyio.move_on_after(2, shield=True):
                    await self._nc.close()

    # -- the drain task ----------------------------------------------------------------------

    async def _connect_and_drain(self) -> None:
        config = self._config

        async def disconnected() -> None:
            self._ready = False
            if not self._closing:  # closing the connection ourselves is no loss
                log.warning("NATS connection lost; events are kept until it returns")

        async def reconnected() -> None:
            self._ready = True
            log.info("NATS connection back")
            self._wake.set()

        async def error(exc: Exception) -> None:
            log.debug("NATS client error: %r", exc)

        backoff = config.retry_backoff_s[0]
        while self._nc is None:
            try:
                self._nc = await connect(
                    config.servers,
                    config.auth,
                    name="stream-gateway-publisher",
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    disconnected_cb=disconnected,
                    reconnected_cb=reconnected,
                    error_cb=error,
                )
            except Exception as exc:  # nats-py raises several unrelated types for "cannot connect"
                if isinstance(exc, NatsRefused):  # a misconfiguration: said loudly, events kept all the same
                    log.error("%s; retrying, events are kept", exc)
                else:
                    log.warning("cannot connect to NATS at %s (%s); retrying, events are kept", config.servers, exc)
                self._note_failure()
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, config.retry_backoff_s[1])
        self._js = self._nc.jetstream()
        if self._tombstones is not None:
            assert self._tg is not None
            self._tg.start_soon(self._tombstones.follow, self._js)
        await self._drain()

    async def _drain(self) -> None:
        config = self._config
        backoff = config.retry_backoff_s[0]
        segment: tuple[Path, list[OutboxRecord]] | None = None
        done_in_segment = 0
        while True:
            if not self._ready and not await self._provision():
                await self._sleep_backoff(backoff)
                backoff = min(backoff * 2, config.retry_backoff_s[1])
                continue
            if self._buffer:
                window = [self._buffer[i] for i in range(min(config.window, len(self._buffer)))]
                if await self._publish_window(window):
                    for _ in window:
                        self._buffer.popleft()
                    self._settle(window)
                    backoff = config.retry_backoff_s[0]
                else:
                    await self._sleep_backoff(backoff)
                    backoff = min(backoff * 2, config.retry_backoff_s[1])
                continue
            if segment is None and len(self._outbox):
                if config.outbox_max_age_s:
                    self._expired += self._outbox.expire(config.outbox_max_age_s)
                segment, done_in_segment = self._outbox.oldest(), 0
            if segment is not None:
                path, records = segment
                window = records[done_in_segment : done_in_segment + config.window]
                if window and not await self._publish_window(window):
                    await self._sleep_backoff(backoff)
                    backoff = min(backoff * 2, config.retry_backoff_s[1])
                    continue
                backoff = config.retry_backoff_s[0]
                self._replayed += len(window)
                done_in_segment += len(window)
                if done_in_segment >= len(records):
                    self._outbox.remove(path, len(records))
                    segment = None
                continue
            if self._spilling:
                log.info("outbox replayed; events go straight to NATS again")
                self._spilling = False
            self._wake = anyio.Event()
            self._drained.set()
            await self._wake.wait()
            if config.linger_s and not self._urgent.is_set():
                # Let the events of the next moment gather into one window, and let the request
                # that produced this one write its first token before its events go out. (asyncio's
                # timeout, here and below: anyio's cancel scope costs several times as much a window.)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(config.linger_s):
                        await self._urgent.wait()
            self._urgent = anyio.Event()

    async def _provision(self) -> bool:
        """Make sure the stream and bucket exist once connected; ``True`` when ready to publish."""
        assert self._nc is not None and self._js is not None
        if not self._nc.is_connected:
            self._note_failure()
            return False
        if self._config.provision:
            try:
                with anyio.fail_after(self._config.ack_timeout_s):
                    await ensure_stream(self._js, self._config.stream)
                    await ensure_object_store(self._js, self._config.stream)
                    if self._tombstones is not None:  # before anything is replayed
                        await self._tombstones.load(self._js)
            except Exception as exc:  # timeouts and JetStream API errors alike: retried
                log.warning("cannot provision stream %s yet: %r", self._config.stream.stream, exc)
                self._note_failure()
                return False
        self._ready = True
        self._failing_since = None
        return True

    async def _publish_window(self, window: list[OutboxRecord]) -> bool:
        """Publish and await every ack; ``False`` (and nothing raised) if any failed."""
        from nats.js.errors import NoStreamResponseError

        assert self._nc is not None and self._js is not None
        js = self._js
        limit = self._nc.max_payload - PAYLOAD_HEADROOM
        futures: list[Any] = []
        large = 0
        withheld = 0
        try:
            async with asyncio.timeout(self._config.ack_timeout_s):
                if (tombstones := self._tombstones) is not None:
                    await tombstones.current(js, strict=False)
                for record in window:
                    subject, payload = record.subject, record.payload
                    if tombstones is not None and tombstones.blocks(subject):
                        withheld += 1  # erased: it never reaches the stream (settled as if it had)
                        continue
                    if subject.startswith(_OBJECT_SUBJECT):
                        await self._put_object(subject[len(_OBJECT_SUBJECT) :], record.msg_id, payload)
                        continue
                    headers = {"Nats-Msg-Id": record.msg_id}
                    if len(payload) > limit:
                        payload = await self._store_large(record)
                        headers[PAYLOAD_OBJECT_HEADER] = f"{self._config.stream.payload_bucket}/{record.msg_id}"
                        large += 1
                    futures.append(await js.publish_async(subject, payload, headers=headers))
                for future in futures:
                    await future
        except Exception as exc:  # ack timeout, connection trouble, JetStream errors: all retried
            self._note_failure()
            log.debug("publishing %d events failed: %r", len(window), exc)
            if isinstance(exc, NoStreamResponseError):
                # The stream is gone (deleted, or a server with a fresh store answered the
                # reconnect): provision it again before the retry.
                self._ready = False
            return False
        finally:
            for future in futures:
                if not future.done():
                    future.cancel()  # frees nats-py's pending slot; a late ack is simply ignored
                elif not future.cancelled():
                    future.exception()  # seen, so asyncio does not log the rest of a failed window
        self._published += sum(1 for record in window if not record.subject.startswith(_OBJECT_SUBJECT)) - withheld
        self._withheld += withheld
        self._large += large
        self._failing_since = None
        return True

    async def _store_large(self, record: OutboxRecord) -> bytes:
        """Put an oversized event in the object store; the pointer body that replaces it."""
        assert self._nc is not None and self._js is not None
        if self._store is None:
            self._store = await ensure_object_store(self._js, self._config.stream)
        bucket = self._config.stream.payload_bucket
        return await put_oversized(self._nc, self._store, bucket, record.msg_id, record.payload)

    async def _put_object(self, bucket: str, name: str, data: bytes) -> None:
        """Store object ``name`` unless the bucket has it already (names are content hashes)."""
        from nats.js.errors import NotFoundError

        assert self._nc is not None and self._js is not None
        spec = self._config.stream
        store = self._buckets.get(bucket)
        if store is None:
            # No size limit; an age limit only where one is set (retention, docs/data-rights.md): an
            # object is written once and referred to by every later turn that uses it, so it is
            # written again once half its age has passed, lest it expire from under them.
            store = self._buckets[bucket] = await ensure_bucket(
                self._js, bucket, replicas=spec.replicas, max_age_s=spec.image_max_age_s
            )
        try:
            info = await store.get_info(name)
            if not _aging(info.mtime, spec.image_max_age_s):
                return
        except NotFoundError:
            pass
        await put_oversized(self._nc, store, bucket, name, data)
        self._objects += 1

    def _note_failure(self) -> None:
        self._failures += 1
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        elif not self._spilling and now - self._failing_since >= self._config.spill_after_s:
            log.warning("NATS failing for %.1f s: new events go to disk", now - self._failing_since)
            self._spilling = True

    def _spill(self, records: list[OutboxRecord]) -> None:
        self._spilled += self._outbox.append(records)
        self._settle(records)

    async def _sleep_backoff(self, seconds: float) -> None:
        # A new event does not end the wait: retrying sooner would not help a failing server.
        await anyio.sleep(seconds)

    # -- live deltas -------------------------------------------------------------------------

    async def _drain_deltas(self) -> None:
        linger = self._config.delta_linger_s
        while True:
            if linger:
                await anyio.sleep(linger)  # the deltas of this moment, from every stream, in one write
            await self._send_deltas()
            self._delta_wake = anyio.Event()
            await self._delta_wake.wait()

    async def _send_deltas(self) -> None:
        """Publish the live deltas waiting (dropped, and counted, while NATS is not connected)."""
        while self._deltas:
            subject, payload = self._deltas.popleft()
            nc = self._nc
            if nc is None or not nc.is_connected:
                self._deltas_dropped += 1 + len(self._deltas)
                self._deltas.clear()
                return
            try:
                await nc.publish(subject, payload)
                self._deltas_published += 1
            except Exception:  # best effort by design: a live view, not a record
                self._deltas_dropped += 1
