"""The HTTP application: OpenAI routes, health and metrics.

Deliberate choices:

* Request bodies are parsed by hand (``orjson`` + ``model_validate``) instead of FastAPI's
  automatic body validation, so that every malformed body gets OpenAI's error shape and status
  (400, with the offending ``param``) rather than FastAPI's 422.
* Every error, including unknown routes and wrong methods, is rendered as
  ``{"error": {"message", "type", "param", "code"}}``.
* The engine belongs to the app's lifespan: it starts before the first request is accepted and
  stops after the last response ended. So does the event publisher when ``nats_url`` is set:
  it starts after the engine (so it is ready before the first request), and on shutdown the
  publisher drains, writing what NATS has not taken to its disk outbox. Open sessions are closed
  first (``session.closed``, reason ``shutdown``) unless they are shared (the default with NATS):
  another replica may continue them.
* With ``nats_url`` the sessions are shared through NATS (:mod:`._shared_sessions`): this
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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from stream_gateway.protocols import _anthropic as anthropic
from stream_gateway.protocols import _responses as responses_api
from stream_gateway.completion._request import ChatCompletionRequest
from stream_gateway.capture._recorder import EventRecorder
from stream_gateway.completion._service import CompletionService
from stream_gateway._errors import (
    AuthenticationFailed,
    Conflict,
    GatewayError,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    RequestTooLarge,
)
from stream_gateway._metrics import GatewayMetrics
from stream_gateway.control._policy_sync import PolicyApplier, PolicyNotNewer
from stream_gateway.sessions._store import Session, SessionStore, session_body
from stream_gateway._settings import Settings
from stream_gateway.sessions._shared import SessionDirectory, SharedSessions, expected_seqs
from stream_gateway.completion._channel import RawSendApp, TokenStreamResponse, UpdateChannel
from stream_gateway.control._tenants import KeyEntry, KeyRing, Limits, RateLimited, RateLimiter
from stream_gateway.protocols._token_in import CompletionRequest, TextChunkEncoder, TokenInService, text_completion_body
from stream_gateway.engines import Engine, WeightsRejected
from stream_gateway.engines._pool import normalize_url
from stream_gateway.engines.remote import RemoteEngine

log = logging.getLogger(__name__)

BodyT = TypeVar("BodyT", bound=BaseModel)


class WeightsBody(BaseModel):
    """``POST /policy/weights``: load a checkpoint as the next policy version."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1, description="a directory of *.safetensors files (the engine's model)")
    policy_version: int = Field(strict=True, gt=0)


class UpstreamsBody(BaseModel):
    """``POST /admin/upstreams``: servers to add to and remove from a remote engine's pool."""

    model_config = ConfigDict(extra="forbid")

    add: list[str] = Field(default_factory=list, max_length=256, description="server URLs to add")
    remove: list[str] = Field(default_factory=list, max_length=256, description="server URLs to take out")


class FeedbackBody(BaseModel):
    """``POST /sessions/{id}/feedback``: a reward for the session, or for one of its turns."""

    model_config = ConfigDict(extra="forbid")

    score: float = Field(strict=True, allow_inf_nan=False)
    label: str | None = Field(None, max_length=256)
    comment: str | None = Field(None, max_length=16_384)
    turn_id: str | None = Field(None, max_length=128)
    source: str = Field("user", min_length=1, max_length=128)


class GatewayApp(FastAPI):
    """FastAPI with two layers outside its middleware stack: :class:`RawSendApp` (streamed frames
    skip the wrappers) and the refusal of bodies whose Content-Length is over the limit."""

    max_request_bytes: int | None = None

    def build_middleware_stack(self) -> ASGIApp:
        app = RawSendApp(super().build_middleware_stack())
        return app if self.max_request_bytes is None else _LengthLimit(app, self.max_request_bytes)


class _LengthLimit:
    """413 before a byte of the body is read when its Content-Length is over the limit. (Starlette's
    RequestBodyLimitMiddleware, which FastAPI 0.165 offers, answers that case in plain text whatever
    the app's error handlers say.) Chunked bodies are counted as they are read (:func:`_parse`)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for name, value in scope["headers"]:
                if name == b"content-length":
                    if value.isdigit() and int(value) > self.limit:
                        refused = _error_response(scope.get("path", ""), RequestTooLarge(self.limit))
                        await refused(scope, receive, send)
                        return
                    break
        await self.app(scope, receive, send)


def _bearer(request: Request) -> str:
    """The request's API key: ``Authorization: Bearer``, else Anthropic's ``x-api-key``."""
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() == "bearer":
        return key.strip()
    return request.headers.get("x-api-key", "").strip()


def _anthropic_path(path: str) -> bool:
    """Whether ``path`` is a Messages API route (errors there take Anthropic's shape)."""
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def _error_response(path: str, error: GatewayError, headers: dict[str, str] | None = None) -> Response:
    body = anthropic.error_body(error) if _anthropic_path(path) else error.body()
    return ORJSONResponse(body, status_code=error.status_code, headers=headers)


class HeldResponse(Response):
    """``inner``, then ``release`` once it has been sent (or failed, or the client left)."""

    def __init__(self, inner: Response, release: Callable[[], None]) -> None:
        self.inner, self.release = inner, release
        self.status_code = inner.status_code
        self.raw_headers = inner.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            self.release()


class ORJSONResponse(JSONResponse):
    """JSON responses encoded with orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def create_app(engine: Engine, settings: Settings) -> FastAPI:
    """The gateway's ASGI app serving ``engine``; entering its lifespan starts the engine."""
    metrics = GatewayMetrics()
    recorder = EventRecorder(
        None,
        engine.model_id,
        live_deltas=settings.live_deltas,
        delta_tokens=settings.delta_tokens,
        delta_interval_s=settings.delta_interval_ms / 1000,
    )

    share = settings.nats_url is not None and settings.shared_sessions
    shared: SharedSessions | None = None

    def session_closed(session: Session, reason: str) -> None:
        expected = expected_seqs(session) if share else None
        recorder.session_closed(session, engine.policy_version, reason, expected)

    def session_evicted(session: Session, reason: str) -> None:
        assert shared is not None
        shared.evicted(session, reason)

    store = SessionStore(
        max_sessions=settings.max_sessions,
        idle_seconds=settings.session_idle_seconds,
        on_close=session_closed,
        on_evict=session_evicted if share else None,
    )
    if share:
        assert settings.nats_url is not None
        shared = SharedSessions(
            store,
            servers=settings.nats_servers(),
            auth=settings.nats_auth(),
            bucket=settings.sessions_bucket,
            events_stream=settings.events_stream,
            subject_prefix=settings.subject_prefix,
            replicas=settings.stream_replicas,
            timeout_s=settings.session_sync_timeout_seconds,
            record_ttl_s=settings.session_state_ttl_seconds,
            idle_seconds=settings.session_idle_seconds,
        )
    sessions = SessionDirectory(store, shared)
    if shared is not None:

        async def close_idle(session: Session, reason: str) -> None:
            await sessions.close(session, reason)

        shared.on_remote_close = close_idle
    close_on_shutdown = settings.close_sessions_on_shutdown
    if close_on_shutdown is None:
        close_on_shutdown = not share
    service = CompletionService(engine, settings, metrics, sessions, recorder)
    token_in = TokenInService(engine, settings, sessions, recorder)
    started = int(time.time())
    replica = settings.replica_id or f"{socket.gethostname()}-{os.getpid()}"
    applier = PolicyApplier(engine, recorder, metrics, replica)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async with engine, anyio.create_task_group() as tg:
            log.info("engine %s ready: model %s", engine.name, engine.model_id)
            # Everything alive now (modules, the tokenizer, the model's Python objects) lives as long
            # as the process: out of the collector's reach, a full collection under load walks only
            # what requests create (it walked the whole transformers import before: pauses of
            # hundreds of ms in the 1,000-stream soak).
            gc.collect()
            gc.freeze()
            if settings.api_key_file is not None:
                # SIGHUP reloads the key file (only where the loop runs in the main thread).
                with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keyring.reload)
            try:
                if settings.upstreams_bucket and settings.nats_url and isinstance(engine, RemoteEngine):
                    await _start_upstream_follower(tg, engine, settings)
                if settings.nats_url is None:
                    yield
                    return
                from pipeline.publisher import EventPublisher

                config = publisher_config(settings)
                async with EventPublisher(config) as publisher:
                    durable = publisher.publish_durable if settings.durable_wait_seconds > 0 else None
                    recorder.attach(publisher.publish_nowait, durable)
                    metrics.watch_publisher(publisher.statistics)
                    log.info("capturing events to %s (outbox %s)", ", ".join(config.servers), config.outbox_dir)
                    if settings.follow_policies:
                        await _start_follower(tg, applier, settings, config)
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
                        still_open = sum(not s.closed for s in store)
                        if close_on_shutdown:
                            log.info("shutting down: closing %d open sessions, draining events", still_open)
                            store.close_all("shutdown")
                        else:
                            log.info("shutting down: %d sessions stay open (shared), draining events", still_open)
                        recorder.attach(None)
            finally:
                tg.cancel_scope.cancel()

    defaults = Limits(
        settings.max_concurrent_requests_per_key,
        settings.requests_per_minute_per_key,
        settings.tokens_per_minute_per_key,
        settings.max_sessions_per_key,
    )
    keyring = KeyRing(settings.api_keys, settings.api_key_file, defaults)
    limiter = RateLimiter(lambda tenant: sum(1 for s in store if s.tenant == tenant and not s.closed))
    sessions.before_open = limiter.check_new_session
    service.spend = limiter.spend
    app = GatewayApp(title="stream-gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.keyring = keyring
    app.max_request_bytes = settings.max_request_bytes

    def authorize_entry(request: Request) -> KeyEntry:
        """The request's tenant and limits (see :mod:`._tenants`); 401 for a key not accepted."""
        key = _bearer(request)
        entry = keyring.entry(key)
        if entry is None:
            if key not in settings.admin_api_keys:  # an admin key is also accepted where others are
                raise AuthenticationFailed("Incorrect API key provided.")
            entry = KeyEntry(key, defaults)
        return entry

    def authorize(request: Request) -> str:
        """The request's tenant: its key file name, or else its bearer key (``anonymous`` without one)."""
        return authorize_entry(request).tenant

    def event_stream(
        frames: AsyncIterator[bytes], producer: Callable[[], Coroutine[Any, Any, None]], headers: dict[str, str]
    ) -> Response:
        """An SSE response of ``frames``; ``producer`` runs beside it and is cancelled if the client leaves."""
        return TokenStreamResponse(
            frames,
            headers=headers,
            data_sender_callable=producer,
            ping=settings.sse_ping_seconds,
            send_timeout=settings.sse_send_timeout_seconds,
        )

    async def limited(
        request: Request,
        handler: Callable[[Request, str | None, str], Awaitable[Response]],
        session_id: str | None,
    ) -> Response:
        """``handler``'s response, under the tenant's limits: its slot is held until the response ends."""
        entry = authorize_entry(request)
        release = limiter.admit(entry.tenant, entry.limits)
        try:
            response = await handler(request, session_id, entry.tenant)
        except BaseException:
            release()
            raise
        return HeldResponse(response, release)

    async def chat_completion(request: Request, session_id: str | None, tenant: str) -> Response:
        body = await _parse(request, ChatCompletionRequest)
        session_id = session_id or request.headers.get("x-session-id") or None
        if session_id is not None:
            _check_session_id(session_id)
        agent = request.headers.get("user-agent")
        prepared = await service.prepare(body, tenant=tenant, session_id=session_id, agent=agent)
        headers = {"x-session-id": prepared.session.session_id}
        if body.stream:
            channel = UpdateChannel()
            return event_stream(
                service.stream_frames(prepared, channel), partial(service.produce, prepared, channel), headers
            )
        result = await service.complete(prepared, _disconnect_waiter(request))
        if result is None:  # the client is gone; nobody reads this
            return Response(status_code=499)
        return ORJSONResponse(result, headers=headers)

    async def text_completion(request: Request, session_id: str | None, tenant: str) -> Response:
        body = await _parse(request, CompletionRequest)
        session_id = session_id or request.headers.get("x-session-id") or body.session_id or None
        if session_id is not None:
            _check_session_id(session_id)
        batch = await token_in.prepare(
            body, tenant=tenant, session_id=session_id, agent=request.headers.get("user-agent")
        )
        first = batch[0]
        headers = {"x-session-id": first.session.session_id}
        token_text = service.token_text
        if body.stream:
            channel = UpdateChannel()
            prompts = {p.first_index + i: p.prompt_ids for p in batch for i in range(p.n)}
            encoder = TextChunkEncoder(
                first.completion_id,
                first.created,
                first.model,
                token_text=token_text,
                logprobs=first.logprobs,
                token_ids=first.return_token_ids,
                tokens_as_ids=bool(body.return_tokens_as_token_ids),
                weight_versions=body.return_weight_versions,
                prompts=prompts,
            )
            prompt_tokens = sum(len(p.prompt_ids) for p in batch)
            frames = service.frames(encoder, channel, None, len(prompts), prompt_tokens, first.include_usage)
            return event_stream(frames, partial(service.produce, batch, channel), headers)
        results = await service.collect(batch, _disconnect_waiter(request))
        if results is None:
            return Response(status_code=499)
        as_ids, versions = bool(body.return_tokens_as_token_ids), body.return_weight_versions
        completion = text_completion_body(
            batch, results, token_text=token_text, tokens_as_ids=as_ids, weight_versions=versions
        )
        return ORJSONResponse(completion, headers=headers)

    async def anthropic_messages(request: Request, session_id: str | None, tenant: str) -> Response:
        """Anthropic's Messages API: translated at the edge (:mod:`._anthropic`), served as chat."""
        body = await _parse(request, anthropic.MessagesRequest)
        session_id = session_id or request.headers.get("x-session-id") or None
        if session_id is not None:
            _check_session_id(session_id)
        chat = anthropic.to_chat_request(body)
        agent = request.headers.get("user-agent")
        prepared = await service.prepare(chat, tenant=tenant, session_id=session_id, agent=agent)
        headers = {"x-session-id": prepared.session.session_id}
        message = anthropic.message_id()
        input_tokens = len(prepared.prompt_ids)
        if body.stream:
            channel = UpdateChannel()
            encoder = anthropic.MessagesEncoder(message, prepared.model)
            frames = service.frames(encoder, channel, encoder.start(input_tokens), 1, input_tokens, True)
            return event_stream(frames, partial(service.produce, prepared, channel), headers)
        results = await service.collect([prepared], _disconnect_waiter(request))
        if results is None:
            return Response(status_code=499)
        body_out = anthropic.message_body(message, prepared.model, results[0], input_tokens)
        return ORJSONResponse(body_out, headers=headers)

    held_responses = responses_api.ResponseStore()

    async def openai_responses(request: Request, session_id: str | None, tenant: str) -> Response:
        """OpenAI's Responses API: translated at the edge (:mod:`._responses`), served as chat."""
        body = await _parse(request, responses_api.ResponsesRequest)
        session_id = session_id or request.headers.get("x-session-id") or None
        if session_id is not None:
            _check_session_id(session_id)
        previous = body.previous_response_id
        history = held_responses.history(previous, tenant) if previous else None
        chat = responses_api.to_chat_request(body, history)
        agent = request.headers.get("user-agent")
        prepared = await service.prepare(chat, tenant=tenant, session_id=session_id, agent=agent)
        headers = {"x-session-id": prepared.session.session_id}
        rid = responses_api.response_id()
        input_tokens = len(prepared.prompt_ids)
        conversation = [m.model_dump(exclude_none=True) for m in chat.messages]

        def remember(response: dict[str, Any]) -> None:
            if response["status"] == "completed" or response["status"] == "incomplete":
                held_responses.put(rid, tenant, [*conversation, responses_api.assistant_message(response["output"])])

        if body.stream:
            channel = UpdateChannel()
            encoder = responses_api.ResponsesEncoder(rid, prepared.created, prepared.model, body, input_tokens)
            encoder.on_end = remember
            frames = service.frames(encoder, channel, encoder.start(), 1, input_tokens, True)
            return event_stream(frames, partial(service.produce, prepared, channel), headers)
        results = await service.collect([prepared], _disconnect_waiter(request))
        if results is None:
            return Response(status_code=499)
        response = responses_api.response_body(rid, prepared.created, prepared.model, body, results[0], input_tokens)
        remember(response)
        return ORJSONResponse(response, headers=headers)

    def generation_routes(path: str, handler: Callable[[Request, str | None, str], Awaitable[Response]]) -> None:
        """``POST path`` and its session-scoped twin ``/sessions/{session_id}path``, under the tenant's limits."""

        async def route(request: Request) -> Response:
            return await limited(request, handler, None)

        async def session_route(request: Request, session_id: str) -> Response:
            return await limited(request, handler, session_id)

        app.post(path, name=handler.__name__)(route)
        app.post(f"/sessions/{{session_id}}{path}", name=f"session_{handler.__name__}")(session_route)

    generation_routes("/v1/chat/completions", chat_completion)
    generation_routes("/v1/completions", text_completion)
    generation_routes("/v1/messages", anthropic_messages)
    generation_routes("/v1/responses", openai_responses)

    async def count_message_tokens(request: Request) -> Response:
        authorize(request)
        body = await _parse(request, anthropic.CountTokensRequest)
        return ORJSONResponse({"input_tokens": await service.count_tokens(anthropic.to_chat_request(body))})

    app.post("/v1/messages/count_tokens")(count_message_tokens)
    app.post("/sessions/{session_id}/v1/messages/count_tokens")(count_message_tokens)

    @app.get("/sessions/{session_id}")
    async def inspect_session(request: Request, session_id: str) -> Response:
        tenant = authorize(request)
        return ORJSONResponse(session_body(await sessions.get(session_id, tenant)))

    async def record_feedback(request: Request, session_id: str, turn_id: str | None) -> Response:
        tenant = authorize(request)
        body = await _parse(request, FeedbackBody)
        session = await sessions.get(session_id, tenant)
        if turn_id is not None and body.turn_id is not None and body.turn_id != turn_id:
            raise InvalidRequest("turn_id in the body differs from the one in the path.", param="turn_id")
        turn_id = turn_id or body.turn_id
        if turn_id is not None and turn_id not in session.turns:
            raise NotFound(f"No turn `{turn_id}` in session `{session_id}`.", param="turn_id", code="turn_not_found")
        await sessions.prepare_to_write(session)
        event_id, seq = recorder.feedback(
            session, engine.policy_version, turn_id, body.score, body.label, body.comment, body.source
        )
        record = {"id": event_id, "object": "session.feedback", "session_id": session_id, "turn_id": turn_id}
        record |= body.model_dump(exclude={"turn_id"})
        sessions.feedback_recorded(session, record | {"seq": seq} if seq is not None else record)
        return ORJSONResponse(record)

    @app.post("/sessions/{session_id}/feedback")
    async def session_feedback(request: Request, session_id: str) -> Response:
        return await record_feedback(request, session_id, None)

    @app.post("/sessions/{session_id}/turns/{turn_id}/feedback")
    async def turn_feedback(request: Request, session_id: str, turn_id: str) -> Response:
        return await record_feedback(request, session_id, turn_id)

    @app.post("/sessions/{session_id}/close")
    async def close_session(request: Request, session_id: str) -> Response:
        tenant = authorize(request)
        session = await sessions.get(session_id, tenant)
        closed_now = await sessions.close(session, "client")
        body = {"id": session_id, "object": "session", "closed": True, "already_closed": not closed_now}
        return ORJSONResponse(body | {"turns": len(session.turns)})

    def authorize_admin(request: Request, action: str) -> None:
        authorize(request)
        key = _bearer(request)
        if not settings.admin_api_keys:
            raise PermissionDenied(f"{action.capitalize()} is disabled; start the gateway with --admin-api-key.")
        if key not in settings.admin_api_keys:
            raise PermissionDenied(f"This key may not do {action}.")

    @app.post("/policy/weights")
    async def load_weights(request: Request) -> Response:
        authorize_admin(request, "weight updates")
        body = await _parse(request, WeightsBody)
        if not await anyio.Path(body.path).is_dir():
            raise InvalidRequest(f"No directory `{body.path}` on the gateway's machine.", param="path")
        try:
            report = await applier.apply_directory(body.path, body.policy_version, source=body.path)
        except PolicyNotNewer as exc:
            raise Conflict(
                f"policy_version must be above the current {engine.policy_version}.",
                param="policy_version",
                code="stale_policy_version",
            ) from exc
        except (WeightsRejected, OSError) as exc:  # unreadable or mismatched checkpoint
            raise InvalidRequest(f"The engine could not load `{body.path}`: {exc}", param="path") from exc
        result = {
            "object": "policy",
            "policy_version": report.policy_version,
            "previous_version": report.previous_version,
        }
        return ORJSONResponse(
            result | {"weights": body.path, "pause_s": report.pause_s, "copy_s": report.copy_s, "replica": replica}
        )

    def remote_engine() -> RemoteEngine:
        if not isinstance(engine, RemoteEngine):
            raise NotFound(
                f"The {engine.name} engine has no inference servers to manage (only vllm-http and sglang-http do).",
                code="no_upstreams",
            )
        return engine

    @app.get("/admin/upstreams")
    async def list_upstreams(request: Request) -> Response:
        authorize_admin(request, "managing inference servers")
        return ORJSONResponse({"object": "list", "data": remote_engine().pool.describe()})

    @app.post("/admin/upstreams")
    async def change_upstreams(request: Request) -> Response:
        authorize_admin(request, "managing inference servers")
        remote = remote_engine()
        body = await _parse(request, UpstreamsBody)
        for url in [*body.add, *body.remove]:
            normalize_url(url)  # refuse the whole request before changing anything
        removed = [u.url for u in (remote.remove_upstream(url) for url in body.remove) if u is not None]
        added = []
        for url in body.add:
            upstream, new = await remote.add_upstream(url)
            if new:
                added.append(upstream.url)
        return ORJSONResponse({"object": "list", "added": added, "removed": removed, "data": remote.pool.describe()})

    @app.get("/v1/models")
    @app.get("/sessions/{session_id}/v1/models")
    async def list_models(request: Request) -> Response:
        authorize(request)
        model = {
            "id": engine.model_id,
            "object": "model",
            "created": started,
            "owned_by": "stream-gateway",
            "max_model_len": engine.max_model_len,
        }
        return ORJSONResponse({"object": "list", "data": [model]})

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        """Claude Code opens a connection with ``HEAD /`` before its first request."""
        return ORJSONResponse({"object": "stream-gateway", "model": engine.model_id})

    @app.get("/health")
    async def health() -> Response:
        stats = engine.statistics()
        body: dict[str, Any] = {
            "status": "ok" if stats.running else "unavailable",
            "engine": engine.name,
            "model": engine.model_id,
            "policy_version": engine.policy_version,
            "replica": replica,
            "server": {"loop": running_loop(), "http": settings.server_stack()[1]},
            "active_requests": stats.active_requests,
            "waiting_requests": stats.waiting_requests,
            "total_requests": stats.total_requests,
            "total_generated_tokens": stats.total_generated_tokens,
        }
        if isinstance(engine, RemoteEngine):
            body["upstreams"] = [
                {"url": u.url, "healthy": u.healthy, "outstanding": u.outstanding} for u in engine.pool
            ]
        if (publisher_stats := metrics.publisher_statistics()) is not None:
            body["events"] = {
                "connected": publisher_stats.connected,
                "pending": publisher_stats.pending,
                "outbox": publisher_stats.outbox,
            }
        return ORJSONResponse(body, status_code=200 if stats.running else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, exc: GatewayError) -> Response:
        metrics.requests.labels("unknown", str(exc.status_code)).inc()
        headers = exc.headers if isinstance(exc, RateLimited) else None
        return _error_response(request.url.path, exc, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if _anthropic_path(request.url.path):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": str(exc.detail)}}
            return ORJSONResponse(body, status_code=exc.status_code, headers=exc.headers)
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}}
        return ORJSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error_response(request.url.path, InvalidRequest(str(exc)))

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        body = GatewayError("The server had an error while processing your request.").body()
        return ORJSONResponse(body, status_code=500)

    # The routes read their bodies themselves (OpenAI's error shapes, null handling, size limits):
    # the OpenAPI document at /openapi.json gets their schemas from the same models.
    bodies: dict[str, type[BaseModel]] = {
        "/v1/chat/completions": ChatCompletionRequest,
        "/sessions/{session_id}/v1/chat/completions": ChatCompletionRequest,
        "/v1/messages": anthropic.MessagesRequest,
        "/sessions/{session_id}/v1/messages": anthropic.MessagesRequest,
        "/v1/messages/count_tokens": anthropic.CountTokensRequest,
        "/sessions/{session_id}/v1/messages/count_tokens": anthropic.CountTokensRequest,
        "/v1/responses": responses_api.ResponsesRequest,
        "/sessions/{session_id}/v1/responses": responses_api.ResponsesRequest,
        "/v1/completions": CompletionRequest,
        "/sessions/{session_id}/v1/completions": CompletionRequest,
        "/sessions/{session_id}/feedback": FeedbackBody,
        "/sessions/{session_id}/turns/{turn_id}/feedback": FeedbackBody,
        "/policy/weights": WeightsBody,
        "/admin/upstreams": UpstreamsBody,
    }
    app.openapi = partial(_openapi, app, bodies, engine.model_id)  # type: ignore[method-assign]
    return app


def _openapi(app: FastAPI, bodies: dict[str, type[BaseModel]], model: str) -> dict[str, Any]:
    """FastAPI's OpenAPI document of the routes, with the request bodies they parse (``model``:
    the one served model id, the only value the completion routes accept)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, kind in bodies.items():
            body = kind.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            if "model" in body.get("properties", {}):
                body["properties"]["model"] = {"type": "string", "enum": [model], "title": "Model"}
            components[kind.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{kind.__name__}"}}},
            }
        app.openapi_schema = schema
    return app.openapi_schema


async def _start_follower(tg: Any, applier: PolicyApplier, settings: Settings, config: Any) -> None:
    """Follow published policies; wait (bounded) until this replica serves the latest one."""
    from stream_gateway.control._policy_sync import PolicyFollower

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


async def _start_upstream_follower(tg: Any, engine: RemoteEngine, settings: Settings) -> None:
    """Follow the servers written into ``--upstreams-bucket``; wait (bounded) for its contents."""
    from stream_gateway.control._upstream_sync import UpstreamFollower

    assert settings.nats_url is not None and settings.upstreams_bucket is not None
    follower = UpstreamFollower(engine, settings.nats_servers(), settings.upstreams_bucket, settings.nats_auth())
    tg.start_soon(follower.run)
    with anyio.move_on_after(10):
        await follower.synced.wait()


def running_loop() -> str:
    """The running event loop's implementation: ``uvloop`` or ``asyncio``."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def default_outbox_dir(settings: Settings) -> Path:
    """Where a gateway without ``--outbox-dir`` keeps the events NATS has not taken (one per port)."""
    return Path.home() / ".local" / "state" / "stream-gateway" / f"outbox-{settings.port}"


def publisher_config(settings: Settings) -> Any:
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
    )
    return PublisherConfig(
        servers=settings.nats_servers(),
        auth=settings.nats_auth(),
        outbox_dir=outbox,
        stream=stream,
        buffer_size=settings.event_buffer_size,
    )


def _disconnect_waiter(request: Request) -> Callable[[], Awaitable[None]]:
    """A function that returns once the client of ``request`` has disconnected."""

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait_disconnect


def _check_session_id(session_id: str) -> None:
    if not (0 < len(session_id) <= 128 and session_id.isascii() and session_id.isprintable()):
        raise InvalidRequest("A session id must be 1-128 printable ASCII characters.", param="session_id")


async def _parse(request: Request, model: type[BodyT]) -> BodyT:
    """Parse and validate a JSON body, translating every failure into a 400 InvalidRequest."""
    limit = getattr(request.app, "max_request_bytes", None)
    if limit is None:
        raw = await request.body()
    else:  # a chunked body has no Content-Length for _LengthLimit to check: count it as it comes
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise RequestTooLarge(limit)
            parts.append(part)
        raw = b"".join(parts)
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


def _validation_error(exc: ValidationError) -> InvalidRequest:
    """The first validation error as OpenAI words it; ``param`` is the top-level field."""
    first = exc.errors(include_url=False)[0]
    location = first["loc"]
    param = str(location[0]) if location else None
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in location).lstrip(".")
    if first["type"] == "extra_forbidden" and len(location) == 1:
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    if first["type"] == "missing":
        return InvalidRequest(f"Missing required parameter: '{path}'.", param=param)
    message = first["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"Invalid value for '{path}': {message}", param=param)
