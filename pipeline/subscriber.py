"""Reading events back: resolving oversized payloads and decoding.

A message on the events stream is either the event's JSON itself, or (for an event over the
server's max payload) a small pointer whose ``Sg-Payload-Object`` header names the object that
holds the JSON. :func:`message_payload` returns the JSON in both cases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .events import Event, decode_event
from .streams import PAYLOAD_OBJECT_HEADER

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["decode_message", "message_payload"]


async def message_payload(msg: Msg, js: JetStreamContext) -> bytes:
    """The event JSON carried by ``msg``, fetched from the object store if it is a pointer."""
    ref = (msg.headers or {}).get(PAYLOAD_OBJECT_HEADER)
    if ref is None:
        return bytes(msg.data)
    bucket, _, name = ref.partition("/")
    store = await js.object_store(bucket)
    result = await store.get(name)
    if result.data is None:
        raise LookupError(f"object {ref} of message {msg.subject} is empty or gone")
    return bytes(result.data)


async def decode_message(msg: Msg, js: JetStreamContext) -> Event:
    """The validated event carried by ``msg``."""
    return decode_event(await message_payload(msg, js))
