"""The JetStream durable pull consumer that every consumer reads through: the assembler, the
batcher and the trainer's :class:`~consumers.verl_adapter.StreamAgentLoopManager`.

:class:`DurableRunner` owns what the two share: connecting (waiting for a server that is not up
yet; one that refuses the credentials ends the run with ``NatsRefused``), provisioning the
consumers' streams and buckets, creating or binding the durable consumer (explicit acks,
delivery from the start of the stream), the fetch loop, and closing the connection. What a
message means, and when it is acknowledged, stays with the caller: its handler receives every
fetch, empty ones included, so timers (the assembler's sweep, the batcher's batches) run
between fetches without a task of their own. The trainer's adapter does not loop forever: it
calls :meth:`DurableRunner.fetch` itself, one batch at a time under its own deadline, on a
connection it keeps between calls (:meth:`DurableRunner.open`).

Deliberate choices, each a field of :class:`PullSpec` because the two consumers differ:

* **``sole_reader``**: the batcher is the only reader of its durable (a batch needs one view of
  the groups), so its configuration is authoritative and applied on every start: a restart
  with another ``ack_wait`` takes effect. Assembler instances share one durable: the first one
  creates it and the others bind to it as it is, so instances configured differently do not
  keep rewriting each other's consumer.
* **``ride_out_disconnects``**: the batcher holds messages across fetches, so a fetch refused
  because the connection is reconnecting or closed is retried a second later rather than
  ending the run and dropping what it holds; the assembler holds nothing between fetches and
  lets the error end its run. A fetch refused because the stream or the consumer has no leader
  (a NATS cluster electing one: 503 or no responders, for seconds) is retried by both.
* A fetch that times out is an empty fetch, whichever ``TimeoutError`` nats-py raises.
* The connection is closed in a shielded scope of 2 s (``pipeline.connection.close_quietly``),
  so cancellation cannot skip it and a server gone away cannot hold shutdown up.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
from pipeline.connection import NatsAuth, close_quietly, connect

from .streams import ConsumerStreams, ensure_consumer_streams

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["DurableRunner", "PullSpec"]

_RETRY_FETCH_S = 1.0


@dataclass(frozen=True, slots=True)
class PullSpec:
    """The durable consumer one runner reads, and how (see the module docstring)."""

    stream: str
    subjects: str  # the consumer's filter subject
    durable: str
    ack_wait_s: float
    max_ack_pending: int
    fetch_timeout_s: float  # how long one fetch waits for a first message
    sole_reader: bool
    ride_out_disconnects: bool


class DurableRunner:
    """Connects, binds the durable consumer of a :class:`PullSpec`, and fetches until cancelled."""

    def __init__(
        self,
        spec: PullSpec,
        *,
        servers: tuple[str, ...],
        auth: NatsAuth,
        names: ConsumerStreams,
        role: str,
        log: logging.Logger,
    ) -> None:
        self._spec = spec
        self._servers = servers
        self._auth = auth
        self._names = names
        self._role = role  # "assembler", "batcher": names the connection and starts log lines
        self._log = log  # the caller's: its records keep their logger name

    async def open(self, **options: Any) -> tuple[Client, JetStreamContext]:
        """A connection with the consumers' streams and buckets provisioned (closed again if that
        fails). ``options`` are nats-py's; by default it reconnects for ever."""
        name = f"{self._role}-{self._spec.durable}"
        nc = await connect(self._servers, self._auth, name=name, **{"max_reconnect_attempts": -1, **options})
        try:
            js = nc.jetstream()
            await ensure_consumer_streams(js, self._names)
        except BaseException:
            await close_quietly(nc)
            raise
        return nc, js

    @asynccontextmanager
    async def connected(self) -> AsyncIterator[tuple[Client, JetStreamContext]]:
        """:meth:`open`, closed on exit."""
        nc, js = await self.open()
        try:
            yield nc, js
        finally:
            await close_quietly(nc)

    async def bind(self, js: JetStreamContext) -> JetStreamContext.PullSubscription:
        """Create (or, for a sole reader, update) the durable consumer and subscribe to it."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        spec = self._spec
        if not spec.sole_reader:  # created by the first instance, bound as found by the others
            return await js.pull_subscribe(
                spec.subjects,
                durable=spec.durable,
                stream=spec.stream,
                config=ConsumerConfig(
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    ack_wait=spec.ack_wait_s,
                    max_ack_pending=spec.max_ack_pending,
                ),
            )
        await js.add_consumer(
            spec.stream,
            ConsumerConfig(
                durable_name=spec.durable,
                filter_subject=spec.subjects,
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=spec.ack_wait_s,
                max_ack_pending=spec.max_ack_pending,
                max_deliver=-1,
            ),
        )
        return await js.pull_subscribe_bind(spec.durable, stream=spec.stream)

    async def fetch(self, subscription: JetStreamContext.PullSubscription, size: int, wait_s: float) -> list[Msg]:
        """One fetch of up to ``size`` messages: an empty list when none came within ``wait_s``, or
        when the stream is between leaders or (``ride_out_disconnects``) the connection is away;
        then it has waited a second before returning, so a caller can simply fetch again."""
        import nats.errors
        import nats.js.errors

        # On a cluster, the stream or the consumer between leaders: nats-server answers 503 (or
        # nobody does) until one is elected, seconds later. Every role waits that out.
        electing = (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError)
        disconnected = (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError)
        try:
            return await subscription.fetch(size, timeout=wait_s)
        except TimeoutError:  # nats-py raises its own subclass or a plain one, depending on the path
            return []
        except (*electing, *disconnected) as exc:
            if isinstance(exc, disconnected) and not self._spec.ride_out_disconnects:
                raise
            self._log.warning("%s: fetch failed (%r); retrying", self._role, exc)
            await anyio.sleep(_RETRY_FETCH_S)
            return []

    async def consume(
        self,
        subscription: JetStreamContext.PullSubscription,
        handle: Callable[[list[Msg]], Awaitable[None]],
        size: Callable[[], int],
    ) -> NoReturn:
        """Fetch up to ``size()`` messages at a time and hand every fetch to ``handle``, forever."""
        while True:
            await handle(await self.fetch(subscription, size(), self._spec.fetch_timeout_s))
