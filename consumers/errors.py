"""Every error the consumers raise, one small hierarchy under :class:`ConsumerError`::

    ConsumerError
    ├── ImagesRefused         a trajectory whose images cannot be trained on (a ValueError)
    └── WeightPublishError    weights could not be published on NATS (a RuntimeError)

Each keeps the builtin base it always had, and the module that raises it re-exports it under its
old name (``consumers.images.ImagesRefused``). The assembler refuses a chain whose images do not
line up with :class:`ImagesRefused` too (the chain is left out).
"""

from __future__ import annotations

__all__ = ["ConsumerError", "ImagesRefused", "WeightPublishError"]


class ConsumerError(Exception):
    """Base of every error the consumers raise."""


class ImagesRefused(ConsumerError, ValueError):
    """A trajectory whose images cannot be rebuilt exactly: never to be trained on.

    ``missing``: an object is not in the bucket (deleted, expired); otherwise what was rebuilt
    differs from what was recorded (the reason says how).
    """

    def __init__(self, trajectory_id: str, reason: str, *, missing: bool) -> None:
        super().__init__(f"trajectory {trajectory_id}: {reason}")
        self.trajectory_id = trajectory_id
        self.reason = reason
        self.missing = missing


class WeightPublishError(ConsumerError, RuntimeError):
    """The weights could not be published on NATS (connection, upload or event); the cause is chained."""
