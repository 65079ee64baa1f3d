"""The session routes: inspect a session, give it (or one of its turns) feedback, close it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from stream_gateway._errors import InvalidRequest, NotFound
from stream_gateway.http._body import parse_body
from stream_gateway.http._render import ORJSONResponse
from stream_gateway.http._state import gateway_state
from stream_gateway.sessions import session_body

__all__ = ["FeedbackBody", "session_bodies", "sessions_router"]

sessions_router = APIRouter()


class FeedbackBody(BaseModel):
    """``POST /sessions/{id}/feedback``: a reward for the session, or for one of its turns."""

    model_config = ConfigDict(extra="forbid")

    score: float = Field(strict=True, allow_inf_nan=False)
    label: str | None = Field(None, max_length=256)
    comment: str | None = Field(None, max_length=16_384)
    turn_id: str | None = Field(None, max_length=128)
    source: str = Field("user", min_length=1, max_length=128)
    author: str | None = Field(None, max_length=256)  # who gave it (the console: the signed-in tenant)


session_bodies: dict[str, type[BaseModel]] = {
    "/sessions/{session_id}/feedback": FeedbackBody,
    "/sessions/{session_id}/turns/{turn_id}/feedback": FeedbackBody,
}


INCLUDABLE = ("routed_experts",)


@sessions_router.get("/sessions/{session_id}")
async def inspect_session(request: Request, session_id: str) -> Response:
    state = gateway_state(request)
    tenant = state.auth.tenant(request)
    include = {part for value in request.query_params.getlist("include") for part in value.split(",") if part}
    if unknown := include - set(INCLUDABLE):
        raise InvalidRequest(
            f"include: unknown value {sorted(unknown)[0]!r}; available: {', '.join(INCLUDABLE)}", param="include"
        )
    routes = "routed_experts" in include
    if routes and state.engine.experts is None:
        raise InvalidRequest(
            "include=routed_experts: the served model has no experts (a dense model records no routes)",
            param="include",
        )
    # On the loop: the session may change between awaits. (Encoding is a copy and base64 per
    # turn: ~1 ms per MB of routes.)
    return ORJSONResponse(session_body(await state.sessions.get(session_id, tenant), routed_experts=routes))


@sessions_router.post("/sessions/{session_id}/feedback")
async def session_feedback(request: Request, session_id: str) -> Response:
    return await _record_feedback(request, session_id, None)


@sessions_router.post("/sessions/{session_id}/turns/{turn_id}/feedback")
async def turn_feedback(request: Request, session_id: str, turn_id: str) -> Response:
    return await _record_feedback(request, session_id, turn_id)


@sessions_router.post("/sessions/{session_id}/close")
async def close_session(request: Request, session_id: str) -> Response:
    state = gateway_state(request)
    tenant = state.auth.tenant(request)
    session = await state.sessions.get(session_id, tenant)
    closed_now = await state.sessions.close(session, "client")
    body = {"id": session_id, "object": "session", "closed": True, "already_closed": not closed_now}
    return ORJSONResponse(body | {"turns": len(session.turns)})


async def _record_feedback(request: Request, session_id: str, turn_id: str | None) -> Response:
    state = gateway_state(request)
    tenant = state.auth.tenant(request)
    body = await parse_body(request, FeedbackBody, state.settings.max_request_bytes)
    sessions = state.sessions
    session = await sessions.get(session_id, tenant)
    if turn_id is not None and body.turn_id is not None and body.turn_id != turn_id:
        raise InvalidRequest("turn_id in the body differs from the one in the path.", param="turn_id")
    turn_id = turn_id or body.turn_id
    if turn_id is not None and turn_id not in session.turns:
        raise NotFound(f"No turn `{turn_id}` in session `{session_id}`.", param="turn_id", code="turn_not_found")
    await sessions.prepare_to_write(session)
    event_id, seq = state.recorder.feedback(
        session, state.engine.policy_version, turn_id, body.score, body.label, body.comment, body.source, body.author
    )
    record = {"id": event_id, "object": "session.feedback", "session_id": session_id, "turn_id": turn_id}
    record |= body.model_dump(exclude={"turn_id"})
    sessions.feedback_recorded(session, record | {"seq": seq} if seq is not None else record)
    return ORJSONResponse(record)
