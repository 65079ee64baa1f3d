"""Capture: a gateway's events, built from its sessions and turns and handed to the publisher.

:class:`EventRecorder` builds every event the gateway publishes (sessions, turns, live deltas,
feedback, policies) without blocking: the publisher (:mod:`pipeline.publisher`) buffers, sends
and falls back to its disk outbox.
"""

from stream_gateway.capture._recorder import DeltaCoalescer, EventRecorder

__all__ = ["DeltaCoalescer", "EventRecorder"]
