"""Subjects, the JetStream stream and the payload object store: names and idempotent provisioning.

Subjects (``prefix`` defaults to ``sg``)::

    sg.events.<tenant>.<session>.<kind>     durable events: the EVENTS stream stores these
    sg.live.<tenant>.<session>.turn.delta   coalesced token deltas: core NATS only, never stored

``<kind>`` is two tokens (``turn.completed``), so ``nats sub 'sg.events.*.*.turn.>'`` shows
every turn event, ``nats sub 'sg.events.*.sess42.>'`` one session, and
``nats sub 'sg.events.t1f2e3d4c5b6a7980.>'`` one tenant. Events that belong to no session
(``policy.updated``) use ``_`` for both tenant and session. A session id that is not a safe
subject token (``[A-Za-z0-9_-]{1,64}``) appears as a digest of itself; the event body always
carries the real id.

Provisioning never deletes anything: a missing stream or bucket is created, an existing one
whose managed settings differ is updated in place (what JetStream allows to change; a change it
refuses, such as the storage type, is reported with the server's message).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .events import Event, subject_token

if TYPE_CHECKING:
    from nats.js import JetStreamContext
    from nats.js.object_store import ObjectStore

__all__ = [
    "PAYLOAD_OBJECT_HEADER",
    "StreamSpec",
    "delta_subject",
    "ensure_bucket",
    "ensure_named_stream",
    "ensure_object_store",
    "ensure_stream",
    "event_subject",
]

# On a pointer message: "<bucket>/<object name>" of the event too large for one NATS message.
PAYLOAD_OBJECT_HEADER = "Sg-Payload-Object"

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """Where durable events go and how long JetStream keeps them."""

    prefix: str = "sg"
    stream: str = "SG_EVENTS"
    payload_bucket: str = "sg_payloads"
    image_bucket: str = "sg_images"  # images by the SHA-256 of their bytes, and their processors (docs/images.md)
    replicas: int = 1
    max_bytes: int = -1  # -1: unlimited
    max_age_s: float = 0.0  # 0: forever
    duplicate_window_s: float = 600.0  # how long a replayed event id is still recognised

    @property
    def subjects(self) -> list[str]:
        """The stream's subject filter."""
        return [f"{self.prefix}.events.>"]


def event_subject(prefix: str, event: Event) -> str:
    """The subject a durable ``event`` is published on."""
    if event.session_id is None:
        return f"{prefix}.events._._.{event.kind}"
    return f"{prefix}.events.{subject_token(event.tenant)}.{subject_token(event.session_id)}.{event.kind}"


def delta_subject(prefix: str, event: Event) -> str:
    """The subject a live ``turn.delta`` is published on."""
    return f"{prefix}.live.{subject_token(event.tenant)}.{subject_token(event.session_id or '_')}.{event.kind}"


async def ensure_stream(js: JetStreamContext, spec: StreamSpec) -> None:
    """Create the events stream, or bring an existing one's managed settings to ``spec``."""
    await ensure_named_stream(
        js,
        spec.stream,
        spec.subjects,
        replicas=spec.replicas,
        max_bytes=spec.max_bytes,
        max_age_s=spec.max_age_s,
        duplicate_window_s=spec.duplicate_window_s,
    )


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
    """Create a file-backed limits stream, or bring an existing one's managed settings to these."""
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
        log.info("created stream %s (%s)", name, ", ".join(subjects))
        return
    have = info.config
    managed = ("subjects", "num_replicas", "max_bytes", "max_age", "duplicate_window", "retention", "discard")
    if any(getattr(have, f) != getattr(wanted, f) for f in managed):
        await js.update_stream(wanted)
        log.info("updated stream %s to the configured settings", name)


async def ensure_object_store(js: JetStreamContext, spec: StreamSpec) -> ObjectStore:
    """The bucket holding events too large for one message, created if missing."""
    return await ensure_bucket(
        js, spec.payload_bucket, replicas=spec.replicas, max_bytes=spec.max_bytes, max_age_s=spec.max_age_s
    )


async def ensure_bucket(
    js: JetStreamContext, bucket: str, *, replicas: int = 1, max_bytes: int = -1, max_age_s: float = 0.0
) -> ObjectStore:
    """A file-backed object store bucket, created if missing (an existing one is used as is)."""
    from nats.js.api import ObjectStoreConfig, StorageType
    from nats.js.errors import BucketNotFoundError, NotFoundError

    try:
        return await js.object_store(bucket)
    except (BucketNotFoundError, NotFoundError):
        config = ObjectStoreConfig(
            bucket=bucket, storage=StorageType.FILE, replicas=replicas, max_bytes=max_bytes, ttl=max_age_s or None
        )
        return await js.create_object_store(bucket, config=config)
