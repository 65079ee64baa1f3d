"""Every error the pipeline raises, one small hierarchy under :class:`PipelineError`::

    PipelineError
    ├── NatsRefused               the server refused this client: credentials or TLS (a ConnectionError)
    ├── TailError                 NATS unreachable, no events stream, or the connection closed (a RuntimeError)
    ├── PolicyDownloadError       a published policy could not be fetched whole (``reason``)
    ├── StalePolicyVersion        an adapter version not above the newest published (a ValueError)
    ├── ImageRefused              an image the gateway will not process (a ValueError)
    └── NatsServerError           the embedded server used wrongly (a RuntimeError)
        ├── NatsServerNotInstalled
        └── NatsServerStartError

Each keeps the builtin base it always had, and the module that raises it re-exports it under its
old name (``pipeline.connection.NatsRefused``).
"""

from __future__ import annotations

__all__ = [
    "ImageRefused",
    "NatsRefused",
    "NatsServerError",
    "NatsServerNotInstalled",
    "NatsServerStartError",
    "PipelineError",
    "PolicyDownloadError",
    "StalePolicyVersion",
    "TailError",
]


class PipelineError(Exception):
    """Base of every error the pipeline raises."""


class NatsRefused(PipelineError, ConnectionError):
    """The NATS server refused this client: wrong credentials or a failed TLS handshake."""


class TailError(PipelineError, RuntimeError):
    """NATS cannot be reached, the events stream does not exist, or the connection was closed."""


class PolicyDownloadError(PipelineError):
    """A published policy could not be fetched whole; ``reason`` is ``download_failed`` or ``digest_mismatch``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class StalePolicyVersion(PipelineError, ValueError):
    """An adapter version not above the newest one published for that adapter (nothing was uploaded)."""

    def __init__(self, message: str, newest: int) -> None:
        super().__init__(message)
        self.newest = newest


class ImageRefused(PipelineError, ValueError):
    """An image the gateway will not process: too large, corrupt or of an unsupported format."""


class NatsServerError(PipelineError, RuntimeError):
    """The embedded server was used wrongly (e.g. started twice, paused while not running)."""


class NatsServerNotInstalled(NatsServerError):
    """No ``nats-server`` binary was found."""


class NatsServerStartError(NatsServerError):
    """The server exited or did not become ready in time; the message ends with its log tail."""
