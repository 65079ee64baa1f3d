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

__all__ = ["ensure_named_stream", "publish_durable"]

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


async def ensure_named_stream(
    js: JetStreamContext,
    name: str,
    subjects: list[str],
    *,
    replicas: int = 1,
    max_bytes: int = -1,
    max_age_s: float = 0.0,
    duplicate_window_s: float = 600.0,
) -> None:
    """Create a file-backed limits stream, or bring an existing one's settings to these."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
    from nats.js.errors import NotFoundError

    wanted = StreamConfig(
        name=name,
        subjects=subjects,
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        num_replicas=replicas,
        max_bytes=max_bytes,
        max_age=max_age_s,
        duplicate_window=duplicate_window_s,
    )
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(wanted)
        return
    have = info.config
    managed = ("subjects", "num_replicas", "max_bytes", "max_age", "duplicate_window")
    if any(getattr(have, f) != getattr(wanted, f) for f in managed):
        await js.update_stream(wanted)
