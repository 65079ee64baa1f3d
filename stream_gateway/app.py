"""The composition root: one gateway process's services, wired once, and the app's lifespan.

:func:`create_app` builds every service from the settings (each gets what it needs through its
constructor: nothing is wired by assigning attributes afterwards) and hands them to the routers
of :mod:`stream_gateway.http` as one typed :class:`~stream_gateway.http.GatewayState`.

Deliberate choices:

* The engine belongs to the app's lifespan: it starts before the first request is accepted and
  stops after the last response ended. So does the event publisher when ``nats_url`` is set:
  it starts after the engine (so it is ready before the first request), and on shutdown the
  publisher drains, writing what NATS has not taken to its disk outbox. Open sessions are closed
  first (``session.closed``, reason ``shutdown``) unless they are shared (the default with NATS):
  another replica may continue them.
* With ``nats_url`` the sessions are shared through NATS (:mod:`stream_gateway.sessions`): this
  process's store is a cache, and any replica continues any session.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup
from fastapi import FastAPI
from starlette.types import ASGIApp

from stream_gateway._metrics import GatewayMetrics
from stream_gateway._settings import Settings
from stream_gateway.capture import EventRecorder
from stream_gateway.completion import CompletionService, Histories
from stream_gateway.control import KeyRing, Limits, PolicyApplier, PolicyFollower, RateLimiter, UpstreamFollower
from stream_gateway.engines import Engine, UpstreamControl
from stream_gateway.http import (
    Authorizer,
    ErrorShapes,
    GatewayState,
    GenerationFront,
    LengthLimit,
    RawSendApp,
    admin_bodies,
    admin_router,
    decode_body,
    generation_bodies,
    generation_router,
    install_error_handlers,
    install_openapi,
    session_bodies,
    sessions_router,
)
from stream_gateway.protocols import Edge
from stream_gateway.protocols import edges as protocol_edges
from stream_gateway.sessions import SessionDirectory, SharingConfig

if TYPE_CHECKING:
    from pipeline.publisher import PublisherConfig

__all__ = ["GatewayApp", "create_app", "default_outbox_dir", "publisher_config"]

log = logging.getLogger(__name__)


class GatewayApp(FastAPI):
    """FastAPI with two layers outside its middleware stack: :class:`~stream_gateway.http.RawSendApp`
    (streamed frames skip the wrappers) and the refusal of bodies whose Content-Length is over the
    limit (:class:`~stream_gateway.http.LengthLimit`)."""

    def __init__(
        self, *, max_request_bytes: int | None, shapes: ErrorShapes, edges: Sequence[Edge[Any]] = (), **options: Any
    ) -> None:
        super().__init__(**options)
        self.max_request_bytes = max_request_bytes
        self.error_shapes = shapes
        self.edges = edges

    def build_middleware_stack(self) -> ASGIApp:
        app = RawSendApp(GenerationFront(super().build_middleware_stack(), self, self.edges))
        if self.max_request_bytes is None:
            return app
        return LengthLimit(app, self.max_request_bytes, self.error_shapes.response)


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    """The gateway's ASGI app serving ``engine``; entering its lifespan starts the engine."""
    metrics = GatewayMetrics()
    recorder = EventRecorder(
        None,
        engine.model_id,
        live_deltas=settings.live_deltas,
        delta_tokens=settings.delta_tokens,
        delta_interval_s=settings.delta_interval_ms / 1000,
        image_max_age_s=settings.image_max_age_seconds,
    )
    defaults = Limits(
        settings.max_concurrent_requests_per_key,
        settings.requests_per_minute_per_key,
        settings.tokens_per_minute_per_key,
        settings.max_sessions_per_key,
    )
    limiter = RateLimiter(lambda tenant: sessions.open_sessions(tenant))
    sessions = SessionDirectory(
        max_sessions=settings.max_sessions,
        idle_seconds=settings.session_idle_seconds,
        max_tokens=settings.max_session_tokens,
        sharing=_sharing(settings),
        on_closed=lambda session, reason, expected: recorder.session_closed(
            session, engine.policy_version, reason, expected
        ),
        before_open=limiter.check_new_session,
    )
    metrics.watch_sessions(sessions.store)
    keyring = KeyRing(settings.api_keys, settings.api_key_file, defaults)
    histories = Histories(settings.history_cache_bytes, decode_body)
    metrics.watch_histories(histories)
    service = CompletionService(
        engine,
        settings,
        metrics,
        sessions,
        recorder,
        spend=limiter.spend,
        adapter_owner=keyring.adapter_owner,
    )
    edges = protocol_edges(service)
    replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    state = GatewayState(
        settings=settings,
        engine=engine,
        metrics=metrics,
        recorder=recorder,
        sessions=sessions,
        service=service,
        edges=edges,
        auth=Authorizer(keyring, settings.admin_api_keys, defaults),
        limiter=limiter,
        applier=PolicyApplier(engine, recorder, metrics, replica),
        replica=replica,
        started=int(time.time()),
        histories=histories,
    )
    shapes = ErrorShapes()
    for edge in edges:
        for path in (edge.path, *(side.path for side in edge.side_routes)):
            shapes.register(path, edge.error_body)
    app = GatewayApp(
        title="stream-gateway",
        lifespan=partial(_lifespan, state),
        docs_url=None,
        redoc_url=None,
        max_request_bytes=settings.max_request_bytes,
        shapes=shapes,
        edges=edges,
    )
    app.state.gateway = state
    for router in (generation_router(edges), sessions_router, admin_router):
        app.include_router(router)
    install_error_handlers(app, shapes, metrics)
    install_openapi(app, generation_bodies(edges) | session_bodies | admin_bodies, engine.model_id)
    return app


def _sharing(settings: Settings) -> SharingConfig | None:
    """Where sessions are shared (with NATS, unless turned off), or ``None``."""
    if settings.nats_url is None or not settings.shared_sessions:
        return None
    return SharingConfig(
        servers=settings.nats_servers(),
        auth=settings.nats_auth(),
        bucket=settings.sessions_bucket,
        events_stream=settings.events_stream,
        subject_prefix=settings.subject_prefix,
        replicas=settings.stream_replicas,
        timeout_s=settings.session_sync_timeout_seconds,
        handoff_s=settings.session_handoff_seconds,
        record_ttl_s=settings.session_state_ttl_seconds,
    )


@asynccontextmanager
async def _lifespan(state: GatewayState, _: FastAPI) -> AsyncIterator[None]:
    engine, settings = state.engine, state.settings
    async with engine, anyio.create_task_group() as tg:
        log.info("engine %s ready: model %s", engine.name, engine.model_id)
        # Chosen and logged now: a bad --reasoning-parser fails the start.
        thinks = state.service.thinks
        # (--workers N: the supervisor hands its workers one key file; replicas on other hosts need theirs.)
        if thinks and settings.reasoning_key_file is None and _sharing(settings) is not None:
            log.warning(
                "the model thinks and sessions are shared, but --reasoning-key-file is unset: this process "
                "signs thinking with its own random key, so a block echoed to another replica is not "
                "recognised as ours (the chain does not depend on it; see docs/reasoning.md)"
            )
        # Everything alive now (modules, the tokenizer, the model's Python objects) lives as long
        # as the process: out of the collector's reach, a full collection under load walks only
        # what requests create (it walked the whole transformers import before: pauses of
        # hundreds of ms in the 1,000-stream soak).
        gc.collect()
        gc.freeze()
        if settings.api_key_file is not None:
            # SIGHUP reloads the key file (only where the loop runs in the main thread).
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, state.auth.keyring.reload)
        try:
            if settings.upstreams_bucket and settings.nats_url and engine.upstreams is not None:
                await _start_upstream_follower(tg, engine.upstreams, settings)
            if settings.nats_url is None:
                yield
            else:
                async with _capturing(state, tg):
                    yield
        finally:
            tg.cancel_scope.cancel()


@asynccontextmanager
async def _capturing(state: GatewayState, tg: TaskGroup) -> AsyncIterator[None]:
    """Events to NATS while the app runs: the publisher, the policy follower, shared sessions."""
    from pipeline.publisher import EventPublisher
    from pipeline.tombstones import Tombstones

    settings, recorder, sessions = state.settings, state.recorder, state.sessions
    shared = sessions.shared
    config = publisher_config(settings)
    tombstones = Tombstones(settings.subject_prefix, replicas=settings.stream_replicas)
    tombstones.on_forgotten = sessions.forgotten
    if shared is not None:
        shared.tombstones = tombstones
    async with EventPublisher(config, tombstones) as publisher:
        durable = publisher.publish_durable if settings.durable_wait_seconds > 0 else None
        recorder.attach(publisher.publish_nowait, durable, publisher.put_object_nowait, live=publisher)
        state.metrics.watch_publisher(publisher.statistics)
        log.info("capturing events to %s (outbox %s)", ", ".join(config.servers), config.outbox_dir)
        if settings.follow_policies:
            await _start_follower(tg, state.applier, settings, config)
        if shared is not None:
            tg.start_soon(shared.run)
            with anyio.move_on_after(10):
                await shared.ready.wait()
            log.info("sessions shared through NATS KV bucket %s", settings.sessions_bucket)
        try:
            yield
        finally:
            if shared is not None:
                with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                    await shared.flush()
            tg.cancel_scope.cancel()
            close_on_shutdown = settings.close_sessions_on_shutdown
            if close_on_shutdown is None:
                close_on_shutdown = shared is None
            still_open = sum(not s.closed for s in sessions.store)
            if close_on_shutdown:
                log.info("shutting down: closing %d open sessions, draining events", still_open)
                sessions.store.close_all("shutdown")
            else:
                log.info("shutting down: %d sessions stay open (shared), draining events", still_open)
            recorder.attach(None)


async def _start_follower(tg: TaskGroup, applier: PolicyApplier, settings: Settings, config: PublisherConfig) -> None:
    """Follow published policies; wait (bounded) until this replica serves the latest one."""
    follower = PolicyFollower(applier, config.servers, config.stream, auth=config.auth)
    tg.start_soon(follower.run)
    with anyio.move_on_after(settings.policy_sync_timeout_seconds):
        await follower.caught_up.wait()
    if not follower.caught_up.is_set():
        log.warning(
            "policy follower: not caught up after %.0f s; serving version %d, applying the latest in the background",
            settings.policy_sync_timeout_seconds,
            applier.policy_version,
        )


async def _start_upstream_follower(tg: TaskGroup, upstreams: UpstreamControl, settings: Settings) -> None:
    """Follow the servers written into ``--upstreams-bucket``; wait (bounded) for its contents."""
    assert settings.nats_url is not None and settings.upstreams_bucket is not None
    follower = UpstreamFollower(upstreams, settings.nats_servers(), settings.upstreams_bucket, settings.nats_auth())
    tg.start_soon(follower.run)
    with anyio.move_on_after(10):
        await follower.synced.wait()


def default_outbox_dir(settings: Settings) -> Path:
    """Where a gateway without ``--outbox-dir`` keeps the events NATS has not taken (one per port)."""
    return Path.home() / ".local" / "state" / "stream-gateway" / f"outbox-{settings.port}"


def publisher_config(settings: Settings) -> PublisherConfig:
    """The event publisher's configuration from the gateway's settings (``nats_url`` must be set)."""
    from pipeline.publisher import PublisherConfig
    from pipeline.streams import StreamSpec

    assert settings.nats_url is not None
    outbox = settings.outbox_dir or default_outbox_dir(settings)
    stream = StreamSpec(
        prefix=settings.subject_prefix,
        stream=settings.events_stream,
        replicas=settings.stream_replicas,
        max_bytes=settings.stream_max_bytes,
        max_age_s=settings.stream_max_age_seconds,
        image_max_age_s=settings.image_max_age_seconds,
    )
    outbox_age = settings.outbox_max_age_seconds
    return PublisherConfig(
        servers=settings.nats_servers(),
        auth=settings.nats_auth(),
        outbox_dir=outbox,
        outbox_max_age_s=settings.stream_max_age_seconds if outbox_age is None else outbox_age,
        stream=stream,
        buffer_size=settings.event_buffer_size,
    )
