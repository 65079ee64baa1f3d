"""The console's reads of NATS: following the durable streams into the index, reading one
message back for a page, and a session's live deltas.

Each stream is read with an ordered consumer (nats-py 2.16: ``js.subscribe(ordered_consumer=True)``,
which re-creates itself from its last sequence after a lost heartbeat, e.g. a NATS restart) from
the sequence after the index's last one, and written to the index in batches: one transaction per
read of up to ``_BATCH`` messages or ``_FLUSH_S`` seconds, in a thread, so the pages stay quick
while a long history is read.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import orjson

from consumers.streams import ConsumerStreams
from pipeline.events import decode_event, subject_token
from pipeline.subscriber import message_payload
from pipeline.tombstones import Tombstones

from ._index import ConsoleIndex

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["Feed", "read_message"]

log = logging.getLogger(__name__)

_BATCH = 512
_FLUSH_S = 0.2
_HEARTBEAT_S = 1.0
_RETRY_S = 2.0


async def read_message(js: JetStreamContext, stream: str, seq: int) -> bytes:
    """The JSON of message ``seq`` of ``stream`` (an oversized one fetched from its object)."""
    msg = await js.get_msg(stream, seq)
    return await message_payload(msg, js)  # type: ignore[arg-type]  # RawStreamMsg has .headers and .data


class Feed:
    """Keeps a :class:`ConsoleIndex` current with the streams named by ``names``, until cancelled."""

    def __init__(
        self, nc: Client, index: ConsoleIndex, names: ConsumerStreams, batcher_bucket: str = "sg_batcher"
    ) -> None:
        self._batcher_bucket = batcher_bucket
        self._nc = nc
        self._js = nc.jetstream()
        self._index = index
        self._names = names
        self.tombstones = Tombstones(names.prefix, replicas=names.replicas)
        self._sweep_soon: anyio.Event = anyio.Event()
        self.tombstones.on_forgotten = lambda _key: self._sweep_soon.set()
        self.caught_up = {names.events: False, names.trajectories: False, names.batches: False}

    @property
    def js(self) -> JetStreamContext:
        return self._js

    @property
    def nc(self) -> Client:
        return self._nc

    @property
    def names(self) -> ConsumerStreams:
        return self._names

    async def run(self) -> None:
        names = self._names
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.tombstones.follow, self._js)
            tg.start_soon(self._sweeper)
            tg.start_soon(self._follow, names.events, names.event_subjects, self._event)
            tg.start_soon(self._follow, names.trajectories, names.trajectory_subjects, self._trajectory)
            tg.start_soon(self._follow, names.batches, names.batch_subject, self._batch)
            # Why the batcher left a trajectory out (its bucket's d.<trajectory> keys).
            bucket = self._batcher_bucket
            tg.start_soon(self._follow, f"KV_{bucket}", f"$KV.{bucket}.d.>", self._drop)

    def _forgotten(self, tenant: str, session_id: str | None) -> bool:
        return session_id is not None and self.tombstones.forgets(subject_token(tenant), subject_token(session_id))

    async def _event(self, payload: bytes) -> tuple[str, Any] | None:
        event = decode_event(payload)
        if self._forgotten(event.tenant, event.session_id):
            return None
        return "event", event

    async def _trajectory(self, payload: bytes) -> tuple[str, Any] | None:
        data = orjson.loads(payload)
        if self._forgotten(data["tenant"], data["session_id"]):
            return None
        return "trajectory", data

    async def _batch(self, payload: bytes) -> tuple[str, Any] | None:
        return "batch", orjson.loads(payload)

    async def _drop(self, payload: bytes) -> tuple[str, Any] | None:
        return ("drop", orjson.loads(payload)) if payload else None  # empty: a key deleted

    async def _follow(self, stream: str, subject: str, decode: Callable[[bytes], Any]) -> None:
        from nats.js.api import ConsumerConfig, DeliverPolicy

        while True:
            try:
                await self._read(stream, subject, decode, ConsumerConfig, DeliverPolicy)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as exc:  # the stream not there yet, NATS away: try again shortly
                log.info("console: reading %s: %r; again in %g s", stream, exc, _RETRY_S)
            await anyio.sleep(_RETRY_S)

    async def _read(self, stream: str, subject: str, decode: Any, consumer_config: Any, deliver: Any) -> None:
        info = await self._js.stream_info(stream)
        start = self._index.position(stream) + 1
        if info.state.last_seq < start and stream in self.caught_up:
            self.caught_up[stream] = True
        config = consumer_config(deliver_policy=deliver.BY_START_SEQUENCE, opt_start_seq=max(start, 1))
        sub = await self._js.subscribe(
            subject, stream=stream, config=config, ordered_consumer=True, idle_heartbeat=_HEARTBEAT_S
        )
        send, receive = anyio.create_memory_object_stream[Any](_BATCH)

        async def pump() -> None:  # the subscription's iterator is read by one task, never cancelled mid-read
            async for msg in sub.messages:
                await send.send(msg)

        try:
            async with send, receive, anyio.create_task_group() as tg:
                tg.start_soon(pump)
                pending: list[tuple[int, str, Any]] = []
                while True:
                    msg = await _next(receive, _FLUSH_S if pending else math.inf)
                    if msg is not None:
                        seq = msg.metadata.sequence.stream
                        try:
                            item = await decode(await message_payload(msg, self._js))
                        except Exception as exc:  # one bad message never stops the console
                            log.warning("console: %s message %d not indexed: %r", stream, seq, exc)
                            item = None
                        pending.append((seq, *item) if item is not None else (seq, "skip", None))
                        if msg.metadata.num_pending == 0 and stream in self.caught_up:
                            self.caught_up[stream] = True
                    if pending and (msg is None or len(pending) >= _BATCH or self.caught_up.get(stream, True)):
                        await anyio.to_thread.run_sync(self._index.apply, stream, pending)
                        pending = []
        finally:
            with anyio.CancelScope(shield=True):
                await sub.unsubscribe()

    async def _sweeper(self) -> None:
        """Drop from the index every session a tombstone forgets (learned after start, or before)."""
        while True:
            await anyio.to_thread.run_sync(self._sweep)
            await self._sweep_soon.wait()
            self._sweep_soon = anyio.Event()

    def _sweep(self) -> None:
        if not self.tombstones.loaded:
            return
        for tenant, session_id in self._index.all_sessions():
            if self._forgotten(tenant, session_id):
                self._index.forget(tenant, session_id)

    @asynccontextmanager
    async def live(self, tenant: str, session_id: str) -> AsyncIterator[Any]:
        """A subscription to a session's live deltas and durable events (core NATS, from now on)."""
        prefix = self._names.prefix
        where = f"{subject_token(tenant)}.{subject_token(session_id)}"
        deltas = await self._nc.subscribe(f"{prefix}.live.{where}.>")
        events = await self._nc.subscribe(f"{prefix}.events.{where}.>")
        send, receive = anyio.create_memory_object_stream[tuple[str, bytes]](256)

        async def pump(sub: Any, kind: str) -> None:
            async for msg in sub.messages:
                await send.send((kind, bytes(msg.data)))

        try:
            async with send, receive, anyio.create_task_group() as tg:
                tg.start_soon(pump, deltas, "delta")
                tg.start_soon(pump, events, "event")
                try:
                    yield receive
                finally:
                    tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await deltas.unsubscribe()
                await events.unsubscribe()


async def _next(receive: Any, wait_s: float) -> Msg | None:
    """The next message, or ``None`` after ``wait_s`` seconds without one (a memory stream's
    receive loses nothing when cancelled)."""
    with anyio.move_on_after(wait_s):
        msg: Msg = await receive.receive()
        return msg
    return None
