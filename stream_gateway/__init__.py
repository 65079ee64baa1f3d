"""stream-gateway: a streaming OpenAI-compatible gateway that records agent traffic for RL.

The public surface: :func:`create_app` builds the ASGI app for an engine, :class:`Settings`
configures a process, and the error hierarchy lives in :mod:`stream_gateway._errors`.
"""

from stream_gateway._errors import (
    AuthenticationFailed,
    ContextLengthExceeded,
    EngineError,
    EngineUnavailable,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    UnsupportedParameter,
)
from stream_gateway._settings import Settings
from stream_gateway.app import create_app

__all__ = [
    "AuthenticationFailed",
    "ContextLengthExceeded",
    "EngineError",
    "EngineUnavailable",
    "GatewayError",
    "InvalidRequest",
    "ModelNotFound",
    "NotFound",
    "Settings",
    "UnsupportedParameter",
    "create_app",
]
