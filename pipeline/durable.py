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
    from nats.js.object_store import ObjectStore

__all__ = ["PAYLOAD_HEADROOM", "publish_durable", "put_oversized"]

PAYLOAD_HEADROOM = 8 * 1024  # headers and protocol overhead under the server's max payload
_OBJECT_CHUNK_BYTES = 128 * 1024  # nats-py's default object store chunk


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
    if len(payload) > nc.max_payload - PAYLOAD_HEADROOM:
        headers[PAYLOAD_OBJECT_HEADER] = f"{bucket}/{msg_id}"
        payload = await put_oversized(nc, await js.object_store(bucket), bucket, msg_id, payload)
    return await js.publish(subject, payload, headers=headers, timeout=ack_wait_s)


async def put_oversized(nc: Client, store: ObjectStore, bucket: str, msg_id: str, payload: bytes) -> bytes:
    """Store ``payload`` as object ``msg_id``; the pointer body to publish in its place.

    Chunks are kept under the server's max payload: nats-py's default (128 KiB) is itself too
    large for a server configured smaller.
    """
    from nats.js.api import ObjectMeta, ObjectMetaOptions

    chunk = min(_OBJECT_CHUNK_BYTES, nc.max_payload - PAYLOAD_HEADROOM)
    await store.put(msg_id, payload, meta=ObjectMeta(name=msg_id, options=ObjectMetaOptions(max_chunk_size=chunk)))
    return orjson.dumps({"event_id": msg_id, "object": msg_id, "bucket": bucket, "size": len(payload)})
