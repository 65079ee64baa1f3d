"""Publishing one durable message and waiting for its ack: what the consumers use downstream.

The gateway's :class:`~pipeline.publisher.EventPublisher` never waits; the assembler and the
batcher must (they acknowledge their input only once their output is stored), so they publish
with :func:`publish_durable`: ``Nats-Msg-Id`` for deduplication, and a payload over the
server's max payload stored in the object store with a pointer message in its place (the same
``Sg-Payload-Object`` convention as events, read back by :func:`pipeline.subscriber.message_payload`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

from .streams import PAYLOAD_OBJECT_HEADER

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.api import PubAck

__all__ = ["publish_durable"]

_PAYLOAD_HEADROOM = 8 * 1024


async def publish_durable(
    nc: Client,
    js: JetStreamContext,
    subject: str,
    msg_id: str,
    payload: bytes,
    *,
    bucket: str,
    ack_wait_s: float = 10.0,
) -> PubAck:
    """Publish and wait for the ack; oversized payloads go through the object store ``bucket``."""
    headers = {"Nats-Msg-Id": msg_id}
    if len(payload) > nc.max_payload - _PAYLOAD_HEADROOM:
        store = await js.object_store(bucket)
        await store.put(msg_id, payload)
        headers[PAYLOAD_OBJECT_HEADER] = f"{bucket}/{msg_id}"
        payload = orjson.dumps({"object": msg_id, "bucket": bucket, "size": len(payload)})
    return await js.publish(subject, payload, headers=headers, timeout=ack_wait_s)
