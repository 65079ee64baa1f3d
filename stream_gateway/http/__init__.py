"""The HTTP edge: ASGI and FastAPI, and no wire protocol of its own.

Request bodies and their limits (:mod:`._body`), keys and tenants (:mod:`._auth`), the SSE
response (:mod:`._sse`), error rendering (:mod:`._render`), and the routers: generation (one
handler over every :class:`~stream_gateway.protocols.Edge`), sessions, and admin (weights,
LoRA adapters, inference servers, models, erasure, health, metrics). Routers take their services from
``app.state.gateway`` (:class:`GatewayState`).
"""

from stream_gateway._errors import HTTPError
from stream_gateway.http._auth import Authorizer, bearer
from stream_gateway.http._body import LengthLimit, check_session_id, decode_body, parse_body, validation_error
from stream_gateway.http._render import ErrorShapes, HeldResponse, ORJSONResponse, install_error_handlers
from stream_gateway.http._sse import RawSendApp, TokenStreamResponse
from stream_gateway.http._state import GatewayState, gateway_state
from stream_gateway.http.admin import UpstreamsBody, WeightsBody, admin_bodies, admin_router, running_loop
from stream_gateway.http.generation import GenerationFront, generation_bodies, generation_router
from stream_gateway.http.openapi import install_openapi
from stream_gateway.http.sessions import FeedbackBody, session_bodies, sessions_router

__all__ = [
    "Authorizer",
    "ErrorShapes",
    "FeedbackBody",
    "GatewayState",
    "GenerationFront",
    "HTTPError",
    "HeldResponse",
    "LengthLimit",
    "ORJSONResponse",
    "RawSendApp",
    "TokenStreamResponse",
    "UpstreamsBody",
    "WeightsBody",
    "admin_bodies",
    "admin_router",
    "bearer",
    "check_session_id",
    "decode_body",
    "gateway_state",
    "generation_bodies",
    "generation_router",
    "install_error_handlers",
    "install_openapi",
    "parse_body",
    "running_loop",
    "session_bodies",
    "sessions_router",
    "validation_error",
]
