"""stream-gateway: a streaming OpenAI-compatible gateway that records agent traffic for RL.

The public surface: :func:`create_app` builds the ASGI app for an engine, :class:`Settings`
configures a process, and the error hierarchy lives in :mod:`stream_gateway._errors`.

``create_app`` and ``Settings`` are imported on first use: trainer-side modules
(``stream_gateway.moe``'s ``replay_routes``, what ``docs/moe.md`` tells trainers to import) must not
pay for FastAPI, transformers and the engines (2.5 s) to read a batch.
"""

from typing import TYPE_CHECKING, Any

from stream_gateway._errors import (
    AuthenticationFailed,
    Conflict,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    ForgetFailed,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PermissionDenied,
    RateLimited,
    Refused,
    RequestTooLarge,
    SequenceFailed,
    ShuttingDown,
    StreamGatewayError,
    UnsupportedParameter,
    UpstreamFailed,
)

if TYPE_CHECKING:
    from stream_gateway._settings import Settings
    from stream_gateway.app import create_app

__all__ = [
    "AuthenticationFailed",
    "Conflict",
    "ContextLengthExceeded",
    "EngineError",
    "EngineUnavailable",
    "ForgetFailed",
    "GatewayError",
    "InvalidRequest",
    "ModelNotFound",
    "NotFound",
    "PermissionDenied",
    "RateLimited",
    "Refused",
    "RequestTooLarge",
    "SequenceFailed",
    "Settings",
    "ShuttingDown",
    "StreamGatewayError",
    "UnsupportedParameter",
    "UpstreamFailed",
    "create_app",
]


def __getattr__(name: str) -> Any:
    if name == "Settings":
        from stream_gateway._settings import Settings

        return Settings
    if name == "create_app":
        from stream_gateway.app import create_app

        return create_app
    raise AttributeError(f"module 'stream_gateway' has no attribute {name!r}")
